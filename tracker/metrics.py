"""The job's metrics in the Prometheus text format: an opt-in HTTP endpoint of the tracker.

``rabit2-submit --metrics-port P`` and ``rabit2-tracker --metrics-port P`` serve
``http://HOST:P/metrics`` (HOST: ``--metrics-host``, loopback by default) for as long as the
tracker runs.  Every scrape takes one status snapshot of the tracker (:meth:`Tracker.status`,
with the progress the workers report in their heartbeats) and turns it into job series and
per-rank series (:func:`families`).  The HTTP server and the exposition format are
``prometheus_client``'s (the ``metrics`` extra).

Per-rank counters count from zero in every process: a restarted worker starts again, which
Prometheus reads as a counter reset (``rate()`` and ``increase()`` handle it).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

StatusFn = Callable[[], "dict[str, Any] | None"]

# per-rank series from the heartbeats' progress: (progress field, name, kind, help)
_PROGRESS_SERIES = (
    ("version", "rabit2_worker_version", "gauge", "checkpoint version"),
    ("seqno", "rabit2_worker_seqno", "gauge", "calls made in the current version"),
    ("calls", "rabit2_worker_calls", "counter", "collectives completed by this process"),
    ("sent", "rabit2_worker_sent_bytes", "counter", "payload bytes sent to peers"),
    ("received", "rabit2_worker_received_bytes", "counter",
     "payload bytes received from peers"),
    ("links_reset", "rabit2_worker_links_reset", "counter", "peer links re-established"),
    ("replayed", "rabit2_worker_replayed_calls", "counter",
     "calls whose result a restarted worker fetched from a neighbour"),
    ("resumed", "rabit2_worker_resumed_calls", "counter",
     "calls resumed at a byte offset after a link broke"),
    ("replaying", "rabit2_worker_replaying", "gauge",
     "1 while a restarted worker replays what it missed"),
)


def families(status: dict[str, Any]) -> Iterator[Any]:
    """The metric families of one tracker status snapshot (``prometheus_client`` objects)."""
    from prometheus_client.core import (  # noqa: PLC0415 (an optional dependency)
        CounterMetricFamily,
        GaugeMetricFamily,
    )

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, doc, value=value)

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, value=value)

    yield gauge("rabit2_job_world_size", "workers the job runs with", status["world_size"])
    yield gauge("rabit2_job_workers_registered", "tasks that joined", status["registered"])
    yield gauge("rabit2_job_workers_connected", "workers connected to the tracker now",
                status.get("connected", 0))
    yield gauge("rabit2_job_workers_finished", "workers that shut down for good",
                status["finished"])
    yield gauge("rabit2_job_workers_recovering",
                "ranks lost and not back yet, or back and still replaying",
                len(status.get("recovering", ())))
    yield counter("rabit2_job_failures", "workers lost so far", status["failures"])
    yield counter("rabit2_job_restarts", "workers that joined again after a loss",
                  status["restarts"])
    yield counter("rabit2_job_printed_lines", "tracker_print lines relayed", status["prints"])
    state = GaugeMetricFamily("rabit2_job_state", "1 for the job's current state",
                              labels=["state"])
    current = ("running" if not status["done"]
               else "succeeded" if status["success"] else "aborted")
    for name in ("running", "succeeded", "aborted"):
        state.add_metric([name], 1.0 if name == current else 0.0)
    yield state

    labels = ["rank", "task"]
    connected = GaugeMetricFamily("rabit2_worker_connected",
                                  "1 while the worker's tracker connection is up", labels=labels)
    incarnation = GaugeMetricFamily("rabit2_worker_incarnation",
                                    "times this rank was taken over by a new process",
                                    labels=labels)
    losses = CounterMetricFamily("rabit2_worker_losses", "times this rank's worker was lost",
                                 labels=labels)
    age = GaugeMetricFamily("rabit2_worker_heartbeat_age_seconds",
                            "seconds since the worker was last heard from", labels=labels)
    progress: dict[str, Any] = {}
    for field, name, kind, doc in _PROGRESS_SERIES:
        family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        progress[field] = family(name, doc, labels=labels)
    for task in status["tasks"]:
        key = ["" if task["rank"] is None else str(task["rank"]), str(task["task_id"])]
        connected.add_metric(key, 1.0 if task["connected"] else 0.0)
        incarnation.add_metric(key, task["incarnation"])
        losses.add_metric(key, task["losses"])
        if task.get("heartbeat_age") is not None:
            age.add_metric(key, task["heartbeat_age"])
        for field, value in (task.get("progress") or {}).items():
            if field in progress:
                progress[field].add_metric(key, float(value))
    yield from (connected, incarnation, losses, age)
    yield from progress.values()


class _Collector:
    """Takes a fresh status snapshot at every scrape."""

    def __init__(self, status: StatusFn) -> None:
        self._status = status

    def collect(self) -> Iterator[Any]:
        snapshot = self._status()
        if snapshot is not None:  # (the tracker did not answer in time: an empty scrape)
            yield from families(snapshot)


class MetricsServer:
    """The ``/metrics`` endpoint of one tracker, on a thread of ``prometheus_client``'s.

    ``status`` is called on the server's thread at every scrape and must be safe there
    (:meth:`TrackerThread.status` is); it returns None when no snapshot can be had.
    Raises ``ImportError`` (with the line to install it) without ``prometheus_client``.
    """

    def __init__(self, status: StatusFn, host: str = "127.0.0.1", port: int = 0) -> None:
        try:
            from prometheus_client import CollectorRegistry  # noqa: PLC0415
        except ImportError:
            raise ImportError("the metrics endpoint needs prometheus-client: "
                              "pip install 'rabit2[metrics]'") from None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(status))
        self._host = host
        self._port = port
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Listen; raises ``OSError`` when the address cannot be bound."""
        from prometheus_client import start_http_server  # noqa: PLC0415

        self._server, self._thread = start_http_server(self._port, self._host, self.registry)

    @property
    def url(self) -> str:
        """Where it serves (valid after :meth:`start`)."""
        host, port = self._server.server_address[:2]
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}/metrics"

    def close(self) -> None:
        """Stop serving; idempotent."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None


__all__ = ["MetricsServer", "families"]
