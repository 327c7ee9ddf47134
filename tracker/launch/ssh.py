"""``--cluster ssh``: a worker started through ``ssh HOST``, where :mod:`tracker.remote`
runs it and stops it when the launcher's ssh goes away."""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping

from tracker.launch.common import Attempt, build_worker_env
from tracker.launch.options import Host, LaunchOptions
from tracker.remote import encode_header


def ssh_attempt(options: LaunchOptions, job_env: Mapping[str, str], task_id: int,
                attempt: int) -> Attempt:
    """Attempt ``attempt`` of task ``task_id`` on its host."""
    # the job's variables go to tracker.remote on ssh's stdin (never on a command
    # line); ssh itself runs with the launcher's environment, and is not pinned
    env = build_worker_env(forwarded_env(os.environ), job_env, task_id, attempt, options.env,
                           None, options.max_attempts > 1)
    return Attempt(ssh_argv(options, options.hosts[task_id]), None,
                   header=encode_header(env, options.kill_grace))


def ssh_argv(options: LaunchOptions, host: Host) -> list[str]:
    """The ``ssh`` command line that starts one worker attempt on ``host`` (pure).

    The job's environment is not on it: it goes to :mod:`tracker.remote` on ssh's stdin.
    ``BatchMode=yes`` (a password prompt would wait forever), ``ConnectTimeout`` and
    ``ServerAliveInterval`` (a host that stops answering ends the ssh in about 30 s, where
    TCP alone would wait for many minutes) follow the ``--ssh`` command, so options given
    there win (ssh keeps an option's first value).
    """
    remote = " ".join(shlex.quote(word) for word in (
        options.remote_python, "-m", "tracker.remote", "--", *options.command))
    if options.remote_dir:
        remote = f"cd {shlex.quote(options.remote_dir)} && exec {remote}"
    else:
        remote = f"exec {remote}"
    argv = [*options.ssh, "-o", "BatchMode=yes", "-o", "ConnectTimeout=20",
            "-o", "ServerAliveInterval=10", "-o", "ServerAliveCountMax=3"]
    if host.port is not None:
        argv += ["-p", str(host.port)]
    return [*argv, host.name, remote]


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What of the launcher's environment an ssh worker gets: the ``RABIT2_*`` settings
    only (not ``PATH``, ``HOME``, ... of this machine; ``--env`` adds more) (pure)."""
    return {key: value for key, value in environ.items() if key.startswith("RABIT2_")}
