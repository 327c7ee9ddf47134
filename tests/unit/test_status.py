"""What a job shows of itself: job files (``tracker.jobfile``) and the Prometheus series of a
status snapshot (``tracker.metrics``); no sockets, no job."""

from __future__ import annotations

import json
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tracker import jobfile
from tracker.registry import Registry

prometheus_parser = pytest.importorskip("prometheus_client.parser")


def _a_dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_job_file_is_private_and_names_the_tracker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RABIT2_RUN_DIR", str(tmp_path / "run"))
    path = jobfile.write({"host": "127.0.0.1", "port": 4242, "secret": "ab" * 32, "pid": 1})
    assert path.parent == tmp_path / "run"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert jobfile.read(path) == ("127.0.0.1", 4242, "ab" * 32)
    assert jobfile.running() == [path]  # this process wrote it and runs
    jobfile.remove(path)
    jobfile.remove(path)  # twice is fine
    assert jobfile.running() == []


def test_job_files_of_dead_launchers_are_skipped_and_pruned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    monkeypatch.setenv("RABIT2_RUN_DIR", str(run))
    host = socket.gethostname().replace("-", "_")
    stale = run / f"job-{host}-{_a_dead_pid()}.json"
    stale.write_text(json.dumps({"host": "h", "port": 1, "secret": "00"}))
    elsewhere = run / f"job-otherhost-{_a_dead_pid()}.json"  # (a shared run directory)
    elsewhere.write_text("{}")
    (run / "job-notapid.json").write_text("{}")
    assert jobfile.running() == []
    jobfile.write({"host": "h", "port": 1, "secret": "00"})
    assert not stale.exists() and elsewhere.exists()


def test_a_job_file_others_could_have_written_is_not_trusted(tmp_path: Path) -> None:
    planted = tmp_path / "job.json"
    planted.write_text(json.dumps({"host": "evil", "port": 1, "secret": "00"}))
    planted.chmod(0o644)
    with pytest.raises(ValueError, match="not private"):
        jobfile.read(planted)
    link = tmp_path / "link.json"
    planted.chmod(0o600)
    link.symlink_to(planted)
    with pytest.raises(ValueError, match="cannot read"):
        jobfile.read(link)
    assert jobfile.read(planted) == ("evil", 1, "00")


def test_a_run_dir_others_can_write_is_refused(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("RABIT2_RUN_DIR", str(shared))
    with pytest.raises(OSError, match="not private"):
        jobfile.write({"host": "h", "port": 1, "secret": "00"})
    assert list(shared.iterdir()) == []


@pytest.mark.parametrize("content", ["not json", "[]", '{"host": "h", "port": 0, "secret": ""}',
                                     '{"host": "h", "port": "1", "secret": ""}'])
def test_a_bad_job_file_is_a_clear_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "job.json"
    path.write_text(content)
    path.chmod(0o600)
    with pytest.raises(ValueError, match=str(path)):
        jobfile.read(path)
    with pytest.raises(ValueError, match="cannot read"):
        jobfile.read(tmp_path / "missing.json")


def _scrape(status: dict[str, Any]) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Render a status as the endpoint does, parse it back with prometheus_client's parser."""
    from prometheus_client import generate_latest  # noqa: PLC0415

    from tracker.metrics import MetricsServer  # noqa: PLC0415

    server = MetricsServer(lambda: status)
    text = generate_latest(server.registry).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in prometheus_parser.text_string_to_metric_families(text)
            for sample in family.samples}


def test_metrics_of_a_status_snapshot() -> None:
    registry: Registry[str] = Registry(2)
    for i in range(2):
        registry.register(f"c{i}", {"task_id": str(i), "attempt": 0, "port": 9000 + i,
                                    "world_size": -1}, host="h", peer="p", now=0.0)
    registry.heartbeat("c0", {"version": 4, "seqno": 1, "calls": 9, "sent": 800,
                              "received": 900, "links_reset": 1, "replayed": 0,
                              "resumed": 2, "replaying": False})
    registry.connection_ended("c1", "connection closed by the worker")
    samples = _scrape(registry.status(now=0.5, prints=3))
    rank0 = (("rank", "0"), ("task", "0"))
    rank1 = (("rank", "1"), ("task", "1"))
    assert samples[("rabit2_job_world_size", ())] == 2
    assert samples[("rabit2_job_printed_lines_total", ())] == 3
    assert samples[("rabit2_job_state", (("state", "running"),))] == 1
    assert samples[("rabit2_job_state", (("state", "aborted"),))] == 0
    assert samples[("rabit2_worker_calls_total", rank0)] == 9
    assert samples[("rabit2_worker_sent_bytes_total", rank0)] == 800
    assert samples[("rabit2_worker_resumed_calls_total", rank0)] == 2
    assert samples[("rabit2_worker_version", rank0)] == 4
    assert samples[("rabit2_worker_replaying", rank0)] == 0
    assert samples[("rabit2_worker_heartbeat_age_seconds", rank0)] == 0.5
    assert samples[("rabit2_worker_connected", rank1)] == 0
    assert ("rabit2_worker_calls_total", rank1) not in samples  # it never reported
    assert ("rabit2_worker_heartbeat_age_seconds", rank1) not in samples
    # the rejoin grace has not passed: not lost yet, but not connected: recovering
    assert samples[("rabit2_job_workers_recovering", ())] == 1
    # its restart, connected, before its first heartbeat: still recovering (it read 0 then
    # 1 again once it reported replaying)
    registry.register("c2", {"task_id": "1", "attempt": 1, "port": 9003, "world_size": -1},
                      host="h", peer="p", now=1.0)
    status = registry.status(now=1.0)
    assert status["recovering"] == [1], status
    assert _scrape(status)[("rabit2_job_workers_recovering", ())] == 1


def test_the_endpoint_answers_over_http_and_closes() -> None:
    import urllib.request  # noqa: PLC0415

    from tracker.metrics import MetricsServer  # noqa: PLC0415

    registry: Registry[str] = Registry(1)
    server = MetricsServer(registry.status, "127.0.0.1", 0)
    server.start()
    try:
        with urllib.request.urlopen(server.url, timeout=10) as reply:
            text = reply.read().decode()
    finally:
        server.close()
    server.close()  # idempotent
    assert "rabit2_job_world_size 1.0" in text


def test_a_status_reply_is_cut_to_fit_one_frame() -> None:
    from rabit2.core.control import MAX_FRAME, decode_body  # noqa: PLC0415
    from tracker.service import _status_frame  # noqa: PLC0415

    progress = {"version": 1 << 40, "seqno": 1 << 40, "calls": 1 << 40, "sent": 1 << 60,
                "received": 1 << 60, "links_reset": 9, "replayed": 9, "resumed": 9,
                "replaying": False}
    rows = [{"task_id": f"{i:0>256}", "rank": i, "host": "h" * 255, "progress": progress}
            for i in range(3000)]
    status = {"world_size": 3000, "registered": 3000, "tasks": rows}
    frame = _status_frame(status)
    assert len(frame) <= MAX_FRAME + 4
    fitted = decode_body(frame[4:])["status"]
    assert fitted["tasks_truncated"] and 0 < len(fitted["tasks"]) < 2000
    assert fitted["registered"] == 3000 and fitted["tasks"] == rows[:len(fitted["tasks"])]
    small = {"world_size": 2, "tasks": rows[:2]}
    assert decode_body(_status_frame(small)[4:])["status"] == small  # nothing to cut
