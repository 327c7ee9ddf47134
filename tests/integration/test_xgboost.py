"""Real XGBoost (3.x, the PyPI wheel with its federated communicator) training through
rabit2's endpoint: the same model as XGBoost's own collectives, recovery of lost workers with
a bit-identical model, and typed failures for bad requests."""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

xgboost = pytest.importorskip("xgboost")
grpc = pytest.importorskip("grpc")
if not xgboost.build_info().get("USE_FEDERATED"):
    pytest.skip("this XGBoost build has no federated communicator (xgboost-cpu?)",
                allow_module_level=True)

import rabit2  # noqa: E402
from rabit2.xgboost import _proto, service  # noqa: E402
from rabit2.xgboost.service import Endpoint  # noqa: E402
from tests.support import WORKERS  # noqa: E402

pytestmark = pytest.mark.integration

LINE = re.compile(r"xgb rank=(\d+) world=(\d+) model=([0-9a-f]{64}) pred=([0-9a-f]{64})")


def submit(n: int, *args: str, attempts: int = 3, timeout: float = 150,
           script: str = "xgb_worker.py",
           env: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    cmd = ["rabit2-submit", "--cluster", "local", "-n", str(n), "--max-attempts",
           str(attempts), *(f"--env={e}" for e in env), "--", sys.executable,
           str(WORKERS / script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, check=False)


def models(out: str, world: int) -> tuple[str, str]:
    """Every rank printed its digests, and they are all the same: (model, predictions)."""
    found = {int(r): (m, p) for r, w, m, p in LINE.findall(out) if int(w) == world}
    assert sorted(found) == list(range(world)), out[-3000:]
    assert len(set(found.values())) == 1, found
    return found[0]


_clean: dict[tuple[int, str], tuple[str, str]] = {}


def clean(n: int, *args: str) -> tuple[str, str]:
    """The digests of a run without a fault (cached for the module)."""
    key = (n, " ".join(args))
    if key not in _clean:
        result = submit(n, *args)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        _clean[key] = models(result.stdout, n)
    return _clean[key]


def xgboost_own(n: int, *args: str, pred_out: str = "") -> tuple[str, str]:
    """The same training through XGBoost's own tracker and collectives."""
    from xgboost.tracker import RabitTracker  # noqa: PLC0415

    tracker = RabitTracker(n_workers=n, host_ip="127.0.0.1", timeout=120)
    tracker.start()
    env = dict(os.environ, XGB_TRACKER_ARGS=json.dumps(tracker.worker_args()),
               XGB_PRED_OUT=pred_out)
    procs = [subprocess.Popen([sys.executable, str(WORKERS / "xgb_worker.py"), "--backend",
                               "xgboost", *args], env=env, stdout=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL)
             for _ in range(n)]
    out = "".join(p.communicate(timeout=120)[0] for p in procs)
    tracker.wait_for(60)
    assert all(p.returncode == 0 for p in procs), out
    return models(out, n)


# ----------------------------------------------------------------------------- the contract


def test_descriptor_is_the_one_compiled_into_xgboost() -> None:
    """Our ``federated.proto`` is byte for byte the descriptor in ``libxgboost.so``."""
    from google.protobuf import descriptor_pb2  # noqa: PLC0415

    lib = Path(xgboost.__file__).parent / "lib" / "libxgboost.so"
    blob = lib.read_bytes()
    start = blob.find(b"\n\x0ffederated.proto")
    assert start >= 0
    mine = _proto.file_descriptor().SerializeToString()
    assert blob[start:start + len(mine)] == mine
    parsed = descriptor_pb2.FileDescriptorProto.FromString(blob[start:start + len(mine)])
    assert [m.name for m in parsed.service[0].method] == list(_proto.METHODS)


def test_an_xgboost_without_the_federated_communicator_is_refused_at_entry(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from rabit2.xgboost import context  # noqa: PLC0415

    context.check_xgboost()  # the wheel the tests run with is fine
    monkeypatch.setattr(xgboost, "build_info", lambda: {"USE_FEDERATED": False})
    with pytest.raises(RuntimeError, match=r"no federated communicator.*xgboost-cpu"):
        context.check_xgboost()
    for version in ("2.1.4", "3.3.0", "3.4.1", "4.0.0rc1"):  # (3.3 refuses training's calls,
        monkeypatch.setattr(xgboost, "__version__", version)  # later ones have no plugin)
        with pytest.raises(RuntimeError,
                           match=rf"needs XGBoost 3\.0, 3\.1 or 3\.2 .*found {version}"):
            context.check_xgboost()


@pytest.fixture
def alone(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> object:
    """rabit2 alone (world 1) with an endpoint (keeping a prelude of the bytes the test's
    ``prelude_limit`` mark names, if any), and a client for it."""
    # (an early sequence number's wait for the calls before it, shortened)
    monkeypatch.setattr(service, "SEQUENCE_WAIT_SEC", 1.0)
    rabit2.init()
    mark = request.node.get_closest_marker("prelude_limit")
    endpoint = Endpoint(0, 1, None if mark is None else mark.args[0])
    port = endpoint.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")

    def call(method: str, **fields: object) -> bytes:
        stub = channel.unary_unary(
            f"/{_proto.SERVICE}/{method}",
            request_serializer=_proto.MESSAGES[f"{method}Request"].SerializeToString,
            response_deserializer=_proto.MESSAGES[f"{method}Reply"].FromString)
        reply = stub(_proto.MESSAGES[f"{method}Request"](**fields), timeout=30)
        return bytes(reply.receive_buffer)

    call.endpoint = endpoint  # type: ignore[attr-defined]
    yield call
    channel.close()
    endpoint.stop()
    rabit2.finalize()


def _double(values: list[float]) -> bytes:
    return np.array(values, dtype=np.float64).tobytes()


def test_endpoint_answers_each_collective(alone) -> None:  # type: ignore[no-untyped-def]
    dtype, op = _proto.DATA_TYPES.index("DOUBLE"), _proto.REDUCE_OPS.index("SUM")
    assert alone("Allreduce", sequence_number=0, rank=0, send_buffer=_double([1.5, 2]),
                 data_type=dtype, reduce_operation=op) == _double([1.5, 2])
    assert alone("Broadcast", sequence_number=1, rank=0, send_buffer=b"abc", root=0) == b"abc"
    assert alone("Allgather", sequence_number=2, rank=0, send_buffer=b"xy") == b"xy"
    assert alone("AllgatherV", sequence_number=3, rank=0, send_buffer=b"z") == b"z"
    assert alone("Allreduce", sequence_number=4, rank=0, send_buffer=b"",
                 data_type=dtype, reduce_operation=op) == b""


@pytest.mark.prelude_limit(3 * (1024 + service.PRELUDE_ENTRY))
def test_the_prelude_is_kept_within_its_bound_then_dropped(alone, caplog) -> None:  # type: ignore[no-untyped-def]
    endpoint = alone.endpoint
    caplog.set_level(logging.WARNING, logger="rabit2.xgboost")
    for seq in range(3):
        assert alone("Broadcast", sequence_number=seq, rank=0, send_buffer=b"x" * 1024,
                     root=0) == b"x" * 1024
    assert endpoint.keeps_prelude and not endpoint.prelude_outgrown
    for seq in range(3, 6):  # (the fourth outgrows it; the calls go on)
        assert alone("Broadcast", sequence_number=seq, rank=0, send_buffer=b"y",
                     root=0) == b"y"
    assert endpoint.prelude_outgrown and not endpoint.keeps_prelude
    assert endpoint.end_prelude() is None
    said = [r for r in caplog.records if "outgrew rabit2_replay_mb at call 4" in r.getMessage()]
    assert len(said) == 1, caplog.text


def test_without_recovery_no_prelude_is_kept(alone) -> None:  # type: ignore[no-untyped-def]
    assert alone("Broadcast", sequence_number=0, rank=0, send_buffer=b"abc", root=0) == b"abc"
    assert not alone.endpoint.keeps_prelude and not alone.endpoint.prelude_outgrown
    assert alone.endpoint.end_prelude() is None


@pytest.mark.parametrize(("fields", "message"), [
    ({"rank": 1}, "request from rank 1 reached rank 0"),
    ({"sequence_number": 7}, "sequence number 7 out of order (expected 0)"),
    ({"data_type": 3}, "data type LONG_DOUBLE is not supported"),
    ({"data_type": 40}, "data type #40 is not supported"),
    ({"reduce_operation": 9}, "reduce operation #9 is not supported"),
    ({"send_buffer": b"\0" * 5}, "5 B is not a whole number of DOUBLE elements"),
])
def test_bad_request_is_refused_with_rabit2s_reason(alone, fields, message) -> None:  # type: ignore[no-untyped-def]
    request = {"sequence_number": 0, "rank": 0, "send_buffer": _double([1.0]),
               "data_type": 2, "reduce_operation": 2, **fields}
    with pytest.raises(grpc.RpcError) as info:
        alone("Allreduce", **request)
    assert message in info.value.details()
    assert info.value.details().startswith("rabit2: ")
    # the endpoint stays failed: no later call runs on a job in an unknown state
    with pytest.raises(grpc.RpcError, match="an earlier call failed"):
        alone("Allreduce", sequence_number=0, rank=0, send_buffer=_double([1.0]),
              data_type=2, reduce_operation=2)


def test_broadcast_root_outside_the_job_is_refused(alone) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError, match="root 3 is not a rank"):
        alone("Broadcast", sequence_number=0, rank=0, send_buffer=b"", root=3)


def test_stranger_on_the_endpoint_is_refused_and_the_worker_goes_on(alone) -> None:  # type: ignore[no-untyped-def]
    port = alone.endpoint.port
    code = (
        "import grpc, sys\n"
        "from rabit2.xgboost import _proto\n"
        f"ch = grpc.insecure_channel('127.0.0.1:{port}')\n"
        "stub = ch.unary_unary(f'/{_proto.SERVICE}/Broadcast',"
        " request_serializer=_proto.MESSAGES['BroadcastRequest'].SerializeToString,"
        " response_deserializer=_proto.MESSAGES['BroadcastReply'].FromString)\n"
        "try:\n"
        "    stub(_proto.MESSAGES['BroadcastRequest'](sequence_number=0, rank=0,"
        " send_buffer=b'evil', root=0), timeout=20)\n"
        "except grpc.RpcError as e:\n"
        "    print(e.code().name, e.details())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False).stdout
    assert "PERMISSION_DENIED" in out and "own worker's XGBoost only" in out
    # the refused stranger took no sequence number: the worker's own call 0 still works
    assert alone("Broadcast", sequence_number=0, rank=0, send_buffer=b"ok", root=0) == b"ok"


# ----------------------------------------------------------------------------- real jobs


def test_same_model_as_xgboosts_own_collectives_at_2_workers() -> None:
    assert clean(2) == xgboost_own(2)


@pytest.mark.slow  # (at 2 workers against XGBoost's own, and at 4 against a clean run, by default)
def test_every_rank_holds_the_same_model_at_4_workers(tmp_path: Path) -> None:
    """Bit-identical on every rank (``models``); against XGBoost's own collectives, whose
    reduction order differs, the predictions agree to 1e-6 (docs/xgboost.md has the figure:
    on this data they are equal)."""
    ours, theirs = tmp_path / "ours.npy", tmp_path / "theirs.npy"
    result = submit(4, env=(f"XGB_PRED_OUT={ours}",))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    models(result.stdout, 4)
    xgboost_own(4, pred_out=str(theirs))
    a, b = np.load(ours), np.load(theirs)
    assert a.shape == b.shape == (2000,)
    assert float(np.max(np.abs(a - b))) <= 1e-6


@pytest.mark.parametrize("args", [
    ("--kill", "1,2,mid"),  # SIGKILL in the middle of boosting round 2
    # after round 2's last call, before its checkpoint (the soak run)
    pytest.param(("--kill", "1,2,before"), marks=pytest.mark.slow),
    ("--kill", "1,2,during"),  # inside round 2's checkpoint
    ("--kill", "0,2,after"),  # right after the checkpoint (rank 0, the broadcasts' root)
    ("--kill", "1,0,mid"),  # before the first checkpoint: replayed from the neighbours
    ("--kill", "1,1,during", "--kill", "0,4,mid"),  # both workers, in different rounds
    # a checkpoint every third round: round 4 replayed from the kept results, and the
    # model the one of a checkpoint every round
    ("--checkpoint-every", "3", "--kill", "1,4,mid"),
], ids=["mid-round", "before-checkpoint", "during-checkpoint", "after-checkpoint-rank0",
        "round0", "both-workers", "every-3-rounds"])
def test_lost_worker_recovers_with_a_bit_identical_model_at_2(args: tuple[str, ...]) -> None:
    result = submit(2, *args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert models(result.stdout, 2) == clean(2)
    summary = result.stdout + result.stderr  # each victim needed a second attempt
    victims = {spec.split(",")[0] for flag, spec in zip(args[::2], args[1::2], strict=True)
               if flag == "--kill"}
    for rank in victims:
        assert re.search(rf"^\d+\s+{rank}\s+2\s+0\s+ok", summary, re.M), summary[-3000:]


@pytest.mark.parametrize(("base", "faults"), [
    ((), ("--kill", "2,1,mid", "--kill", "3,3,before")),  # two workers, different rounds
    pytest.param(("--method", "approx"), ("--kill", "1,2,mid"), marks=pytest.mark.slow),
    # round 3 replayed from results (at 2 workers in the default run)
    pytest.param(("--checkpoint-every", "3"), ("--kill", "2,4,mid"), marks=pytest.mark.slow),
], ids=["two-workers", "approx", "every-3-rounds"])
def test_lost_workers_recover_with_a_bit_identical_model_at_4(
        base: tuple[str, ...], faults: tuple[str, ...]) -> None:
    result = submit(4, *base, *faults)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert models(result.stdout, 4) == clean(4, *base)


@pytest.mark.parametrize("extra", [
    {"objective": "reg:squarederror", "eval_metric": "rmse"},
    # (its default metric has a section of its own, which a booster just made lacks)
    {"objective": "reg:pseudohubererror", "eval_metric": None},
    pytest.param({"objective": "multi:softprob", "num_class": 3, "eval_metric": "mlogloss"},
                 marks=pytest.mark.slow),  # (the soak run)
], ids=["regression", "metric-parameters", "multiclass"])
def test_other_boosters_and_objectives_recover_bit_identically(extra: dict[str, object]) -> None:
    base = ("--extra", json.dumps(extra))
    result = submit(2, *base, "--kill", "1,2,mid")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert models(result.stdout, 2) == clean(2, *base)


def test_parameters_a_callback_changed_come_back_with_a_restarted_worker() -> None:
    """A LearningRateScheduler changes eta after every round; a worker restarted in round 3
    trains on with the eta the others use, not the one its params name."""
    result = submit(2, "--lr-decay", "--kill", "1,3,mid")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert models(result.stdout, 2) == clean(2, "--lr-decay") != clean(2)
    assert models(result.stdout, 2) == xgboost_own(2, "--lr-decay")


@pytest.mark.parametrize(("extra", "reason"), [
    ({"subsample": 0.8}, "subsample below 1 cannot be recovered bit-exactly"),
    pytest.param({"colsample_bynode": 0.5}, "colsample_bynode below 1 cannot be recovered",
                 marks=pytest.mark.slow),  # (the same check as subsample's: the soak run)
    pytest.param({"booster": "dart"}, "booster dart (random dropout) cannot be recovered",
                 marks=pytest.mark.slow),
])
def test_random_training_is_refused_before_training_when_recovery_is_on(
        extra: dict[str, object], reason: str) -> None:
    result = submit(2, "--extra", json.dumps(extra), attempts=2)
    assert result.returncode != 0
    out = result.stdout + result.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] ValueError: {reason}" in out, out[-3000:]


def test_random_training_runs_without_recovery() -> None:
    result = submit(2, "--extra", json.dumps({"subsample": 0.8}), attempts=1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    models(result.stdout, 2)


def test_a_restarted_worker_that_builds_other_data_fails_every_rank_typed() -> None:
    """The restarted rank 1 builds its DMatrix from other data (one more column): its first
    call before training sends other bytes than the original run's, which is refused before
    XGBoost sees the recorded answer, and every rank fails naming it, in seconds."""
    started = time.monotonic()
    result = submit(3, "--kill", "1,2,mid", "--diverge")
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert time.monotonic() - started < 60
    reason = "this rank's input differs from the original run's"
    for rank in (0, 2):
        assert re.search(rf"\[rank {rank}\] rabit2.errors.JobAbortedError: .*{reason}", out), (
            out[-3000:])
    assert "job: rank 1 (task 1) signalled an error: rank 1: call 1 before training" in out


def test_classifier_fit_runs_through_rabit2() -> None:
    pytest.importorskip("sklearn")
    result = submit(2, "--classifier", attempts=1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    models(result.stdout, 2)


def test_beyond_recovery_every_rank_fails_typed_within_the_deadline() -> None:
    """Rank 1 dies on every attempt: the launcher gives up and every other rank raises
    rabit2's JobAbortedError through XGBoost, in seconds."""
    started = time.monotonic()
    result = submit(3, "mock=1,1,1,0", "mock=1,1,1,1", attempts=2)
    elapsed = time.monotonic() - started
    assert result.returncode != 0
    for rank in (0, 2):
        assert re.search(rf"\[rank {rank}\] rabit2.errors.JobAbortedError: .*task 1",
                         result.stdout + result.stderr), result.stdout[-3000:]
    assert "Allreduce RPC failed" in result.stdout + result.stderr
    assert elapsed < 60


@pytest.mark.parametrize(("mode", "reason"), [
    ("wrong-rank", "request from rank 0 reached rank 1's endpoint"),
    ("mismatch", "MismatchError: collective mismatch"),
    ("sequence", "sequence number 1 out of order (expected 0)"),
    ("dtype", "data type LONG_DOUBLE is not supported"),
])
def test_bad_requests_fail_every_rank_with_the_reason(mode: str, reason: str) -> None:
    result = submit(2, mode, attempts=1, script="xgb_bad.py", timeout=90)
    outcomes = re.findall(r"bad rank=(\d) outcome=(\w+) after=([\d.]+)s error=(.*)",
                          result.stdout)
    assert sorted(int(r) for r, *_ in outcomes) == [0, 1], result.stdout + result.stderr
    for _, outcome, after, error in outcomes:
        assert outcome == "error"
        assert reason in error  # on the rank that sent it, and in the abort everyone sees
        assert float(after) < 15


@pytest.mark.parametrize(("mode", "expected"), [
    ("params", "MismatchError: rabit2.xgboost.train: the ranks passed different params"),
    pytest.param("rounds", "MismatchError: rabit2.xgboost.train: the ranks passed different "
                 "params", marks=pytest.mark.slow),  # (the check of "params")
    ("second", "RuntimeError: this worker already took part in this job and left it"),
    ("finalized", "RuntimeError: XGBoost's communicator is no longer the one rabit2 set up"),
    ("unpicklable", "TypeError: callback Holder cannot be checkpointed: its attribute 'log' "
                    "(TextIOWrapper) does not copy or pickle"),
    ("outside", "RuntimeError: rabit2.xgboost.train outside "
                "rabit2.xgboost.CommunicatorContext in a job of several workers"),
    ("unbiased", "ValueError: lambdarank_unbiased cannot be recovered"),
    ("no-replica", "ValueError: rabit2.xgboost.CommunicatorContext with recovery on keeps "
                   "each worker's own training state as a local model"),
])
def test_misuse_fails_every_rank_typed_at_once(mode: str, expected: str) -> None:
    """Ranks that would train different models (XGBoost itself checks only what changes a
    call's size), a second context, and XGBoost's communicator finalized inside the
    context: a clear error on every rank, not a model per rank or a refusal by the tracker."""
    started = time.monotonic()
    result = submit(2, mode, script="xgb_misuse.py", timeout=90)
    out = result.stdout + result.stderr
    assert result.returncode != 0
    assert time.monotonic() - started < 60
    for rank in (0, 1):
        assert f"outcome rank={rank} {expected}" in out, out[-3000:]
    assert "restarting" not in out


def test_params_as_pairs_keep_a_repeated_key() -> None:
    """``[("eval_metric", "auc"), ("eval_metric", "logloss")]``: both metrics, as in
    ``xgboost.train``."""
    result = submit(2, "pairs", script="xgb_misuse.py", timeout=90)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    for rank in (0, 1):  # (a checkpoint every round: recovery is on)
        assert f"metrics rank={rank} ['auc', 'logloss'] checkpoint=3" in out, out[-3000:]


def test_training_before_rx_train_keeps_a_bounded_prelude_and_no_checkpoints() -> None:
    """``xgboost.train`` inside the context before ``rx.train``: its calls count as the
    prelude, which the endpoint keeps for ``rx.train``'s checkpoints only up to
    ``rabit2_replay_mb``; past it none is kept and ``rx.train`` trains on without
    checkpoints, on every rank alike."""
    result = submit(2, "plain-first", script="xgb_misuse.py", timeout=120,
                    env=("RABIT2_REPLAY_MB=1",))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    for rank in (0, 1):
        assert f"metrics rank={rank} ['logloss'] checkpoint=0" in out, out[-3000:]
        assert f"outcome rank={rank} ok" in out, out[-3000:]
        said = re.findall(rf"rank {rank}: the results of XGBoost's calls before "
                          r"rabit2\.xgboost\.train, kept for its checkpoints, outgrew", out)
        assert len(said) == 1, out[-3000:]
        assert f"rank {rank}: rabit2.xgboost.train takes no checkpoints" in out, out[-3000:]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds")
@pytest.mark.parametrize(("args", "raised"), [((), True), (("rabit2_xgboost_heap=0",), False)])
def test_the_context_keeps_payload_sized_buffers_and_puts_dasks_thresholds_back(
        args: tuple[str, ...], raised: bool) -> None:
    """With Dask's trim threshold in the environment every 2 MiB buffer is faulted in afresh
    (about 1024 pages per iteration); inside the context they are reused, and after it the
    environment's threshold holds again.  ``rabit2_xgboost_heap=0`` leaves glibc alone."""
    result = submit(2, "heap", *args, script="xgb_misuse.py", timeout=90,
                    env=("MALLOC_TRIM_THRESHOLD_=65536",))
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    for rank in (0, 1):
        found = re.search(rf"outcome rank={rank} heap inside=(\d+) after=(\d+)", out)
        assert found, out[-3000:]
        inside, after = int(found.group(1)), int(found.group(2))
        assert after > 900, out[-3000:]
        assert (inside < 100) if raised else (inside > 900), out[-3000:]


def test_ranks_of_different_bounds_agree_whether_rx_train_checkpoints() -> None:
    """``rabit2_replay_mb`` is each rank's own: only rank 0's prelude outgrows it (1 MiB),
    and no rank checkpoints (a checkpoint on rank 1 alone would mismatch every later
    call)."""
    result = submit(2, "uneven-bound", script="xgb_misuse.py", timeout=120)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    for rank in (0, 1):
        assert f"metrics rank={rank} ['logloss'] checkpoint=0" in out, out[-3000:]
        assert f"outcome rank={rank} ok" in out, out[-3000:]
    assert ("rank 1: rabit2.xgboost.train takes no checkpoints: the calls before it outgrew "
            "rabit2_replay_mb on another rank") in out, out[-3000:]


@pytest.mark.parametrize("mode", ["schedule", "per-host"])
def test_what_needs_no_checkpoint_or_agreement_trains(mode: str) -> None:
    """A LearningRateScheduler of a list (its schedule is a function: code a restarted
    worker has, not state), and parameters that do not change the model set per rank."""
    result = submit(2, mode, script="xgb_misuse.py", timeout=90)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    for rank in (0, 1):
        assert f"outcome rank={rank} ok" in out, out[-3000:]


def test_checkpoint_every_takes_numpy_integers_and_refuses_the_rest() -> None:
    import rabit2.xgboost as rx  # noqa: PLC0415

    dtrain = xgboost.DMatrix(np.arange(40.0).reshape(20, 2), np.arange(20.0))
    assert rx.train({"max_depth": 1}, dtrain, 2, checkpoint_every=np.int64(2),
                    verbose_eval=False).num_boosted_rounds() == 2
    for bad in (1.5, True, 0, "2"):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            rx.train({"max_depth": 1}, dtrain, 2, checkpoint_every=bad,  # type: ignore[arg-type]
                     verbose_eval=False)


JOBS_IN_A_ROW = """
import json, sys, numpy as np, xgboost, rabit2.xgboost as rx
for line in sys.stdin:
    x = np.random.default_rng(0).normal(size=(200, 4))
    try:
        with rx.CommunicatorContext(**json.loads(line)):
            rx.train({"nthread": 1}, xgboost.DMatrix(x, label=x[:, 0] > 0), 2)
        print("ok", flush=True)
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}", flush=True)
"""


def test_one_process_trains_in_jobs_one_after_another_on_one_port() -> None:
    """A long-lived worker process (a notebook, a service) joins one job after another,
    each with a tracker of its own on the same port: every job is a new one (a process
    refuses only to join a job it left)."""
    from tracker.server import TrackerThread  # noqa: PLC0415

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", JOBS_IN_A_ROW], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, bufsize=1) for _ in range(2)]
    try:
        for _ in range(2):
            tracker = TrackerThread(2, host="127.0.0.1", port=port, print_fn=lambda s: None)
            tracker.start()
            env = tracker.worker_env()
            for task, proc in enumerate(procs):
                assert proc.stdin is not None
                proc.stdin.write(json.dumps({
                    "dmlc_tracker_uri": env["DMLC_TRACKER_URI"],
                    "dmlc_tracker_port": env["DMLC_TRACKER_PORT"],
                    "rabit2_secret": env["RABIT2_SECRET"], "dmlc_task_id": str(task)}) + "\n")
                proc.stdin.flush()
            said = [proc.stdout.readline().strip() for proc in procs if proc.stdout]
            assert said == ["ok", "ok"], said
            assert tracker.join(30).success
            tracker.stop()
    finally:
        for proc in procs:
            proc.kill()
            proc.communicate(timeout=30)
