"""``--cluster ssh``: a worker started through ``ssh HOST``, where :mod:`tracker.remote`
runs it and stops it when the launcher's ssh goes away."""

from __future__ import annotations

import shlex
from collections.abc import Mapping

from tracker.launch.options import Host, LaunchOptions


def ssh_argv(options: LaunchOptions, host: Host) -> list[str]:
    """The ``ssh`` command line that starts one worker attempt on ``host`` (pure).

    The job's environment is not on it: it goes to :mod:`tracker.remote` on ssh's stdin.
    ``BatchMode=yes`` (a password prompt would wait forever) and ``ConnectTimeout`` follow
    the ``--ssh`` command, so options given there win (ssh keeps an option's first value).
    """
    remote = " ".join(shlex.quote(word) for word in (
        options.remote_python, "-m", "tracker.remote", "--", *options.command))
    if options.remote_dir:
        remote = f"cd {shlex.quote(options.remote_dir)} && exec {remote}"
    else:
        remote = f"exec {remote}"
    argv = [*options.ssh, "-o", "BatchMode=yes", "-o", "ConnectTimeout=20"]
    if host.port is not None:
        argv += ["-p", str(host.port)]
    return [*argv, host.name, remote]


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What of the launcher's environment an ssh worker gets: the ``RABIT2_*`` settings
    only (not ``PATH``, ``HOME``, ... of this machine; ``--env`` adds more) (pure)."""
    return {key: value for key, value in environ.items() if key.startswith("RABIT2_")}
