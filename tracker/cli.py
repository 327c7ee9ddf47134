"""``rabit2-tracker``: run the tracker alone, for workers started by something else.

Prints the environment the workers need between ``DMLC_TRACKER_ENV_START`` and
``DMLC_TRACKER_ENV_END`` (as dmlc-core's standalone tracker does), then waits for the job.
Exit status: 0 when every rank shut down, 1 when the job was aborted, 130 on Ctrl-C (which
aborts the job: its workers raise ``JobAbortedError`` at once) or SIGTERM (which does not:
its workers go on and rejoin a tracker restarted at the same address within 30 s, as a
supervisor restarts it).

``rabit2-tracker --query [TARGET]`` asks a running tracker for its status instead: ranks,
hosts, losses, restarts and each worker's progress, as JSON.  TARGET is the job file a
``rabit2-submit`` job wrote (:mod:`tracker.jobfile`; without TARGET, the one such job of this
user running on this machine) or ``HOST:PORT``, whose secret comes from ``--secret`` or
``RABIT2_SECRET`` (what a tracker started this way printed; inside a worker, its own
environment names its job's tracker and secret).  Exit status 1 if no job is found, the
tracker cannot be reached or it refuses the secret.

``--metrics-port P`` serves the job's metrics in the Prometheus text format
(:mod:`tracker.metrics`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import rabit2
from rabit2.config import secret_bytes
from rabit2.errors import TrackerError
from rabit2.io.tracker_query import query_tracker_status
from tracker import jobfile
from tracker.launch.options import check_metrics, check_seconds
from tracker.metrics import MetricsServer
from tracker.server import Tracker, status_on_loop

EXIT_OK = 0
EXIT_ABORTED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse the command line; exits with status 2 on bad usage (argparse)."""
    parser = argparse.ArgumentParser(
        prog="rabit2-tracker", description="Run a rabit2 tracker and print the worker env."
    )
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s (rabit2 {rabit2.__version__})")
    parser.add_argument("--n", "-n", type=int, help="number of workers (required to run one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (0: any free)")
    parser.add_argument(
        "--secret",
        help="job secret, read as the workers read RABIT2_SECRET (hex is decoded, other "
             "text used as UTF-8); a fresh random one is generated when omitted",
    )
    parser.add_argument("--sortby", choices=("task", "arrival"), default="task")
    parser.add_argument("--heartbeat-timeout", type=float, default=30.0)
    parser.add_argument("--classic", choices=("loopback", "any", "none"), default="loopback",
                        help="from where workers of the classic rabit protocol (XGBoost "
                             "1.x/2.0; it carries no secret) are served")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    parser.add_argument("--query", metavar="JOBFILE|HOST:PORT", nargs="?", const="",
                        help="print a running tracker's status as JSON instead: of the job "
                             "whose job file rabit2-submit wrote (default: this user's one "
                             "running job), or at HOST:PORT (secret: --secret or "
                             "RABIT2_SECRET)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="P",
                        help="serve the job's metrics in the Prometheus text format at "
                             "http://HOST:P/metrics (0: any free port)")
    parser.add_argument("--metrics-host", default=None, metavar="HOST",
                        help="address of the metrics endpoint (default 127.0.0.1; with "
                             "--metrics-port)")
    parser.add_argument("--query-timeout", type=float, default=10.0, metavar="S")
    args = parser.parse_args(argv)
    args.metrics_host = check_metrics(parser, args.metrics_host, args.metrics_port)
    if not 0 <= args.port < 65536:
        parser.error("--port must be a TCP port (0: any free one)")
    check_seconds(parser, "--heartbeat-timeout", args.heartbeat_timeout, None)
    check_seconds(parser, "--query-timeout", args.query_timeout, None)
    if args.query is not None:
        if args.query == "" or os.path.isfile(args.query) or os.sep in args.query or (
                args.query.endswith(".json")):
            return args  # a job file: read when the query runs (one that is gone: exit 1)
        host, sep, port = args.query.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            parser.error("--query expects a job file or HOST:PORT")
        args.query = (host, int(port))
        if args.secret is None:
            args.secret = os.environ.get("RABIT2_SECRET", "")
    elif args.n is None:
        parser.error("--n is required (or --query HOST:PORT)")
    elif args.n < 1:
        parser.error("--n must be >= 1")
    if args.secret is None:
        args.secret = secrets.token_hex(32)
    # (as the workers read it: hex decoded, other text as UTF-8)
    args.secret = secret_bytes(args.secret)
    if not args.secret and args.query is None:  # (a key anyone can compute: no authentication)
        parser.error("--secret must not be empty (leave it out for a random one)")
    return args


async def run_tracker(args: argparse.Namespace) -> int:
    """Start the tracker, print the env block, wait for the job; return the exit status."""
    tracker = Tracker(
        args.n,
        args.host,
        args.port,
        secret=args.secret,
        sortby=args.sortby,
        heartbeat_timeout=args.heartbeat_timeout,
        classic=args.classic,
    )
    try:
        await tracker.start()
    except OSError as exc:  # (a port taken, an address that does not resolve)
        print(f"rabit2-tracker: error: cannot listen on {args.host}:{args.port}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    metrics: MetricsServer | None = None
    try:
        if args.metrics_port is not None:
            loop = asyncio.get_running_loop()
            metrics = MetricsServer(lambda: status_on_loop(tracker, loop), args.metrics_host,
                                    args.metrics_port)
            metrics.start()
            logging.getLogger("rabit2.tracker").info("metrics at %s", metrics.url)
        lines = ["DMLC_TRACKER_ENV_START"]
        lines += [f"{key}={value}" for key, value in tracker.worker_env().items()]
        lines.append("DMLC_TRACKER_ENV_END")
        print("\n".join(lines), flush=True)
        # Ctrl-C stops the job: the workers hear it at once.  SIGTERM (what a supervisor
        # sends to restart it) leaves them to rejoin a tracker restarted at this address.
        interrupted = asyncio.Event()

        def on_sigint() -> None:
            if interrupted.is_set():
                raise KeyboardInterrupt  # (a second Ctrl-C: at once)
            interrupted.set()
            tracker.abort("rabit2-tracker was interrupted (Ctrl-C)")

        with contextlib.suppress(NotImplementedError, RuntimeError):  # (not the main thread)
            asyncio.get_running_loop().add_signal_handler(signal.SIGINT, on_sigint)
        result = await tracker.wait_done(None)
        if interrupted.is_set():
            print("rabit2-tracker: interrupted; the job was aborted", file=sys.stderr)
            return EXIT_INTERRUPTED
    except ImportError as exc:  # (the metrics endpoint's extra)
        print(f"rabit2-tracker: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:  # (the metrics endpoint's port)
        print(f"rabit2-tracker: error: the metrics endpoint cannot listen on "
              f"{args.metrics_host}:{args.metrics_port}: {exc.strerror or exc}",
              file=sys.stderr)
        return EXIT_USAGE
    finally:
        if metrics is not None:
            await asyncio.to_thread(metrics.close)
        await tracker.close()
    if result.success:
        logging.getLogger("rabit2.tracker").info("job finished: %s", result.reason)
        return EXIT_OK
    # (the abort itself was logged when it happened; this is how the job ended)
    logging.getLogger("rabit2.tracker").error("job ended, aborted: %s", result.reason)
    return EXIT_ABORTED


def _query_target(target: str) -> tuple[str, int, str]:
    """Host, port and secret of a job file, or of this user's one running job (``""``).
    Raises ``ValueError`` saying why none can be had."""
    if target:
        return jobfile.read(target)
    found = jobfile.running()
    if not found:
        raise ValueError(f"no running rabit2-submit job found in {jobfile.run_dir()}; "
                         "pass its job file or HOST:PORT")
    if len(found) > 1:
        raise ValueError("several rabit2-submit jobs run; pass one of their job files: "
                         + " ".join(str(path) for path in found))
    return jobfile.read(found[0])


def query(args: argparse.Namespace) -> int:
    """Print the status of the tracker that ``args.query`` names; the exit status."""
    if isinstance(args.query, tuple):
        host, port = args.query
    else:
        try:
            host, port, written = _query_target(args.query)
            args.secret = bytes.fromhex(written)  # (the launcher writes it in hex)
        except ValueError as exc:
            print(f"rabit2-tracker: {exc}", file=sys.stderr)
            return EXIT_ABORTED
    try:
        status = asyncio.run(query_tracker_status(host, port, args.secret,
                                                  args.query_timeout))
    except TrackerError as exc:
        gone = (isinstance(args.query, str) and args.query
                and jobfile.launcher_alive(Path(args.query)) is False)
        print(f"rabit2-tracker: {exc}" + (
            "; the launcher that wrote that job file no longer runs (it was killed before it "
            "could remove it): its job has ended" if gone else ""), file=sys.stderr)
        return EXIT_ABORTED
    try:
        print(json.dumps(status, indent=2, sort_keys=True), flush=True)
    except BrokenPipeError:
        # (a reader that took what it wanted and left, as `| head -1` does: no traceback;
        # stdout is pointed at /dev/null so that the exit's flush does not fail again)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point."""
    args = parse_args(argv)
    if args.query is not None:
        return query(args)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    previous = signal.signal(signal.SIGTERM, _interrupt)  # (as Ctrl-C)
    try:
        return asyncio.run(run_tracker(args))
    except KeyboardInterrupt:
        print("rabit2-tracker: interrupted; the job did not finish", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
