"""The public API in single-process mode (no tracker configured)."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from typing import Any

import numpy as np
import pytest

import rabit2
from rabit2.core.ops import SUPPORTED_DTYPES
from rabit2.errors import NotInitializedError, RabitError

pytestmark = pytest.mark.usefixtures("no_job")  # (tests/conftest.py)


@pytest.fixture
def single() -> None:
    rabit2.init()


# ----------------------------------------------------------------------------- lifecycle


def test_init_finalize_single_process() -> None:
    rabit2.init()
    assert rabit2.get_rank() == 0
    assert rabit2.get_world_size() == 1
    assert not rabit2.is_distributed()
    assert isinstance(rabit2.get_processor_name(), str) and rabit2.get_processor_name()
    rabit2.finalize()
    with pytest.raises(NotInitializedError):
        rabit2.allreduce(np.zeros(1), rabit2.SUM)
    rabit2.finalize()  # twice is harmless


def test_init_ignores_non_pair_args_like_argv(single: None) -> None:
    rabit2.finalize()
    rabit2.init(["train.py", "--epochs", "eta=0.1", b"rabit_task_id=3"])
    assert rabit2.get_world_size() == 1


def test_rank_and_world_before_init() -> None:
    assert rabit2.get_rank() == 0
    assert rabit2.get_world_size() == 1
    assert rabit2.version_number() == 0


def test_second_init_warns_and_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    rabit2.init()
    rabit2.checkpoint("m")
    with caplog.at_level(logging.WARNING, logger="rabit2"):
        rabit2.init(["rabit_foo=1"])  # would raise if it were not ignored
    assert any("twice" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    assert rabit2.version_number() == 1  # the state of the first init is kept


def test_communicator_context() -> None:
    with rabit2.CommunicatorContext(rabit2_log_level="warning") as ctx:
        assert isinstance(ctx, rabit2.CommunicatorContext)
        assert rabit2.get_world_size() == 1
        arr = np.arange(3, dtype=np.int32)
        assert rabit2.allreduce(arr, rabit2.SUM) is arr
    with pytest.raises(NotInitializedError):
        rabit2.broadcast(1, 0)


def test_communicator_context_finalizes_on_error() -> None:
    with pytest.raises(KeyError), rabit2.CommunicatorContext():
        raise KeyError("boom")
    with pytest.raises(NotInitializedError):
        rabit2.checkpoint(None)


def test_tracker_print_is_local(single: None, capsys: pytest.CaptureFixture[str]) -> None:
    rabit2.tracker_print("hello")
    rabit2.communicator_print(42)
    assert capsys.readouterr().out == "hello\n42\n"
    rabit2.signal_error("no tracker: nothing happens")


# ----------------------------------------------------------------------------- constants


def test_rabit_op_constants() -> None:
    assert (rabit2.MAX, rabit2.MIN, rabit2.SUM, rabit2.BITOR) == (0, 1, 2, 3)
    assert rabit2.MAX is rabit2.Op.MAX and rabit2.BITOR is rabit2.Op.BITOR
    assert {"PROD", "BITAND", "BITXOR"} <= set(rabit2.Op.__members__)


def test_error_types_are_rabit_errors() -> None:
    assert issubclass(NotInitializedError, RabitError)
    assert rabit2.RabitError is RabitError


# ----------------------------------------------------------------------------- collectives


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_allreduce_returns_the_same_array(single: None, dtype: np.dtype) -> None:
    arr = np.arange(12).reshape(3, 4).astype(dtype)
    before = arr.copy()
    for op in (rabit2.SUM, rabit2.MAX, rabit2.MIN, rabit2.Op.PROD, "sum"):
        assert rabit2.allreduce(arr, op) is arr
    np.testing.assert_array_equal(arr, before)
    assert arr.dtype == dtype


def test_allreduce_bitwise_on_integers(single: None) -> None:
    arr = np.array([1, 2, 3], dtype=np.uint16)
    for op in (rabit2.BITOR, rabit2.Op.BITAND, rabit2.Op.BITXOR):
        assert rabit2.allreduce(arr, op) is arr
    np.testing.assert_array_equal(arr, [1, 2, 3])


def test_allreduce_empty_and_scalar_arrays(single: None) -> None:
    empty = np.zeros(0, dtype=np.float32)
    assert rabit2.allreduce(empty, rabit2.SUM) is empty
    scalar = np.array(5, dtype=np.int64)
    assert rabit2.allreduce(scalar, rabit2.MAX) is scalar and int(scalar) == 5


def test_allreduce_calls_prepare_fun(single: None) -> None:
    seen: list[np.ndarray] = []

    def prepare(data: np.ndarray) -> None:
        seen.append(data)
        data[:] = 7

    arr = np.zeros(4, dtype=np.float64)
    assert rabit2.allreduce(arr, rabit2.SUM, prepare_fun=prepare) is arr
    assert len(seen) == 1 and seen[0] is arr
    np.testing.assert_array_equal(arr, 7)


def test_agree_single_process(single: None) -> None:
    assert rabit2.agree(True) is True
    assert rabit2.agree(False) is False
    assert rabit2.agree(np.bool_(True)) is True and rabit2.agree(0) is False


@pytest.mark.parametrize("flag", ["x", None, 1.0, [True]])
def test_agree_takes_a_bool(single: None, flag: object) -> None:
    with pytest.raises(TypeError, match="agree takes a bool"):
        rabit2.agree(flag)  # type: ignore[arg-type]


@pytest.mark.parametrize("with_local", ["no", [], None, 2, 1.0])
def test_load_checkpoint_takes_a_bool(single: None, with_local: object) -> None:
    with pytest.raises(TypeError, match="with_local must be a bool"):
        rabit2.load_checkpoint(with_local)  # type: ignore[arg-type]


def test_load_checkpoint_takes_0_and_1_as_rabit_does(single: None) -> None:
    assert rabit2.load_checkpoint(1) == (0, None, None)  # type: ignore[arg-type]
    assert rabit2.load_checkpoint(0) == (0, None)  # type: ignore[arg-type]


def test_a_live_set_alone_is_this_worker(single: None) -> None:
    """Single-process mode: a set of this one worker, new in the first set only, so an
    elastic program runs alone as any other rabit2 program does."""
    import rabit2.live  # noqa: PLC0415

    first = rabit2.live.live_set()
    with first as live:
        assert tuple(live) == (0,) and live.new == (0,) and live.source is None
        assert rabit2.allreduce(np.ones(2), rabit2.SUM).tolist() == [1.0, 1.0]
        with pytest.raises(RuntimeError, match="do not nest"), rabit2.live_set():
            pass
    with rabit2.live_set() as again:
        assert again.epoch == live.epoch + 1 and again.new == () and again.source == 0
    with pytest.raises(ValueError, match="raised inside"), rabit2.live_set():
        raise ValueError("raised inside")


def test_elastic_mode_alone_keeps_the_rules_of_a_job() -> None:
    """``init(elastic=True)`` alone: collectives outside a block, checkpoints, and finalize
    inside a block are refused as under ``rabit2-submit --elastic``, so a program checked
    alone does not first fail in the job."""
    rabit2.init(elastic=True)
    with pytest.raises(RuntimeError, match="collectives run inside"):
        rabit2.allreduce(np.ones(2), rabit2.SUM)
    with pytest.raises(RuntimeError, match="elastic mode has no checkpoints"):
        rabit2.checkpoint(1)
    with pytest.raises(RuntimeError, match="elastic mode has no checkpoints"):
        rabit2.load_checkpoint()
    with rabit2.live_set():
        assert rabit2.allreduce(np.ones(2), rabit2.SUM).tolist() == [1.0, 1.0]
        assert rabit2.broadcast("x", root=0) == "x"
        with pytest.raises(RuntimeError, match="inside a live set's block"):
            rabit2.finalize()
    rabit2.finalize()


@pytest.mark.parametrize("obj", [None, 3, "text", {"a": [1, 2]}, np.arange(5.0)])
def test_broadcast_returns_the_object(single: None, obj: object) -> None:
    assert rabit2.broadcast(obj, 0) is obj
    assert rabit2.broadcast(obj, np.int64(0)) is obj


def test_allgather_returns_a_copy(single: None) -> None:
    arr = np.arange(6, dtype=np.int32).reshape(3, 2)
    out = rabit2.allgather(arr)
    assert out is not arr and not np.shares_memory(out, arr)
    np.testing.assert_array_equal(out, arr)
    assert out.dtype == arr.dtype
    out[0, 0] = 99
    assert arr[0, 0] == 0
    # a 0-d array gathers into one row
    np.testing.assert_array_equal(rabit2.allgather(np.array(4.5)), [4.5])


# ----------------------------------------------------------------------------- checkpoints


def test_fresh_start_has_no_checkpoint(single: None) -> None:
    assert rabit2.version_number() == 0
    assert rabit2.load_checkpoint() == (0, None)
    assert rabit2.load_checkpoint(with_local=True) == (0, None, None)


def test_checkpoint_versions_count_and_models_are_copied(single: None) -> None:
    model = {"trees": [1, 2]}
    rabit2.checkpoint(model)
    assert rabit2.version_number() == 1
    model["trees"].append(3)  # a checkpoint is a snapshot, not a reference
    assert rabit2.load_checkpoint() == (1, {"trees": [1, 2]})
    rabit2.checkpoint({"trees": [1, 2, 3]}, local_model=["local"])
    assert rabit2.version_number() == 2
    version, global_model, local_model = rabit2.load_checkpoint(with_local=True)
    assert (version, global_model, local_model) == (2, {"trees": [1, 2, 3]}, ["local"])
    rabit2.checkpoint("g")  # no local model this time: the old one is gone
    assert rabit2.load_checkpoint(with_local=True) == (3, "g", None)


def test_lazy_checkpoint_keeps_a_reference(single: None) -> None:
    rabit2.checkpoint("old", local_model="old-local")
    model = [1, 2, 3]
    rabit2.lazy_checkpoint(model)
    assert rabit2.version_number() == 2
    version, loaded = rabit2.load_checkpoint()
    assert version == 2 and loaded is model
    assert rabit2.load_checkpoint(with_local=True) == (2, model, None)
    rabit2.checkpoint("eager")
    assert rabit2.load_checkpoint() == (3, "eager")


@pytest.mark.parametrize("take", [rabit2.checkpoint, rabit2.lazy_checkpoint])
def test_a_checkpoint_that_cannot_be_pickled_changes_nothing(single: None, take: Any) -> None:
    rabit2.checkpoint({"v": 1}, local_model="local 1")
    with pytest.raises(TypeError, match="cannot pickle function"):
        take({"v": 2}, local_model=lambda: 0)
    if take is rabit2.checkpoint:
        with pytest.raises(TypeError, match="checkpoint: cannot pickle function"):
            take(lambda: 0)
    assert rabit2.load_checkpoint(with_local=True) == (1, {"v": 1}, "local 1")


def test_finalize_and_init_start_from_version_zero(single: None) -> None:
    rabit2.checkpoint("m")
    rabit2.finalize()
    assert rabit2.version_number() == 0
    rabit2.init()
    assert rabit2.version_number() == 0
    assert rabit2.load_checkpoint() == (0, None)


# ----------------------------------------------------------------------------- call-site errors


@pytest.mark.parametrize("data", [[1, 2, 3], (1.0,), 3, "abc", None, memoryview(b"ab")])
def test_allreduce_of_non_array_is_type_error(single: None, data: object) -> None:
    with pytest.raises(TypeError):
        rabit2.allreduce(data, rabit2.SUM)


@pytest.mark.parametrize("dtype", [np.bool_, np.complex64, np.complex128, object, "U3", "M8[s]",
                                   np.dtype(">i4"), np.dtype([("a", "i4")])], ids=str)
def test_allreduce_of_unsupported_dtype_is_type_error(single: None, dtype: object) -> None:
    with pytest.raises(TypeError):
        rabit2.allreduce(np.zeros(3, dtype=dtype), rabit2.MAX)


@pytest.mark.parametrize("op", [rabit2.BITOR, rabit2.Op.BITAND, rabit2.Op.BITXOR, "bitwise_or"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_bitwise_op_on_float_is_type_error(single: None, op: object, dtype: type) -> None:
    with pytest.raises(TypeError, match="bitwise"):
        rabit2.allreduce(np.zeros(3, dtype=dtype), op)


@pytest.mark.parametrize("op", [7, -1, "mean", None, True, 2.0])
def test_unknown_op_is_value_error(single: None, op: object) -> None:
    with pytest.raises(ValueError):
        rabit2.allreduce(np.zeros(3, dtype=np.int32), op)


def test_call_site_errors_do_not_touch_data(single: None) -> None:
    calls: list[object] = []
    arr = np.ones(3)
    with pytest.raises(TypeError):
        rabit2.allreduce(arr, rabit2.BITOR, prepare_fun=calls.append)
    assert calls == []  # validation happens before prepare_fun
    np.testing.assert_array_equal(arr, 1)


@pytest.mark.parametrize("root", [-1, 1, 5, 1.0, "0", None, True, False])
def test_broadcast_root_out_of_range_is_value_error(single: None, root: object) -> None:
    with pytest.raises(ValueError, match="root"):
        rabit2.broadcast("x", root)  # type: ignore[arg-type]


@pytest.mark.parametrize("obj", [lambda: 1, threading.Lock()], ids=["lambda", "lock"])
def test_broadcast_of_unpicklable_object_is_type_error(single: None, obj: object) -> None:
    # alone as in a job: the root's object must pickle, or the program fails only in a job
    with pytest.raises(TypeError, match="pickle"):
        rabit2.broadcast(obj, 0)


def test_allgather_of_bad_input_is_type_error(single: None) -> None:
    with pytest.raises(TypeError):
        rabit2.allgather([1, 2])
    with pytest.raises(TypeError):
        rabit2.allgather(np.zeros(2, dtype=np.complex64))


@pytest.mark.parametrize(
    "call",
    [
        lambda: rabit2.allreduce(np.zeros(2), rabit2.SUM),
        lambda: rabit2.broadcast("x", 0),
        lambda: rabit2.allgather(np.zeros(2)),
        lambda: rabit2.agree(True),
        lambda: rabit2.checkpoint("m"),
        lambda: rabit2.lazy_checkpoint("m"),
        rabit2.load_checkpoint,
    ],
    ids=["allreduce", "broadcast", "allgather", "agree", "checkpoint", "lazy_checkpoint",
         "load_checkpoint"],
)
def test_calls_before_init_raise_not_initialized(call: object) -> None:
    with pytest.raises(NotInitializedError, match="init"):
        call()  # type: ignore[operator]


def test_argument_errors_win_over_not_initialized() -> None:
    # the caller's own mistake is reported first, as on an initialised communicator
    with pytest.raises(TypeError):
        rabit2.allreduce([1], rabit2.SUM)
    with pytest.raises(ValueError):
        rabit2.allreduce(np.zeros(1), "nope")


@pytest.mark.parametrize(
    "args",
    [["rabit_reduce_ring_mincount=abc"], ["rabit_foo=1"], ["rabit2_loop=trio"], ["mock=1,2"],
     ["rabit_timeout_sec=0"]],
)
def test_bad_init_args_raise_value_error(args: list[str]) -> None:
    with pytest.raises(ValueError):
        rabit2.init(args)
    assert rabit2.version_number() == 0
    with pytest.raises(NotInitializedError):  # a failed init leaves nothing initialised
        rabit2.checkpoint(None)


def test_bad_init_kwargs_raise_value_error() -> None:
    with pytest.raises(ValueError):
        rabit2.init(dmlc_foo=1)
    with pytest.raises(ValueError):
        rabit2.init(rabit_reduce_ring_mincount="many")
    # XGBoost's federated mode is not what rabit2.init starts: not run alone in silence
    with pytest.raises(ValueError, match="dmlc_communicator='federated'"):
        rabit2.init(dmlc_communicator="federated", federated_world_size=2, federated_rank=1)
    with pytest.raises(ValueError, match="xgboost_communicator='nope': rabit2 is a rabit"):
        rabit2.init(["xgboost_communicator=nope"])  # (as XGBoost refuses one it does not know)
    with pytest.raises(TypeError, match="takes 'k=v' strings, got int 1"):
        rabit2.init([1, 2])  # type: ignore[list-item]
    rabit2.init(dmlc_communicator="Rabit")  # compatibility keys are fine
    assert rabit2.get_world_size() == 1


def test_recovery_statistics_in_single_process_mode() -> None:
    rabit2.init()
    try:
        assert rabit2.recovery_statistics() == dict.fromkeys(
            ("links_up", "fetched_bytes", "resent_bytes", "replayed_calls", "resumed_calls",
             "corrupt_frames"), 0)
    finally:
        rabit2.finalize()
    with pytest.raises(rabit2.errors.NotInitializedError):
        rabit2.recovery_statistics()


def test_a_launcher_world_without_a_tracker_is_warned_about(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # `mpirun -n 2 python w.py` with no tracker: two independent jobs of one process each
    for name in ("DMLC_TRACKER_URI", "RABIT_TRACKER_URI", "SLURM_NTASKS", "PMIX_SIZE",
                 "PMI_SIZE", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with caplog.at_level(logging.WARNING, logger="rabit2"):
        rabit2.init()
    try:
        assert rabit2.get_world_size() == 1
        assert any("OMPI_COMM_WORLD_SIZE=2" in r.getMessage() and "runs alone" in r.getMessage()
                   for r in caplog.records), caplog.records
    finally:
        rabit2.finalize()
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rabit2"):
        rabit2.init()
    rabit2.finalize()
    assert not caplog.records


def test_rabit2_xgboost_without_xgboost_says_which_extra_to_install() -> None:
    code = ("import sys\nsys.modules['xgboost'] = None  # (as if it were not installed)\n"
            "try:\n    import rabit2.xgboost\nexcept ModuleNotFoundError as exc:\n"
            "    print(exc.name, '|', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.startswith("xgboost | rabit2.xgboost needs XGBoost 3.0-3.2: pip install "
                          "'rabit2[xgboost]'"), out


@pytest.mark.asyncio
async def test_an_aio_call_issued_after_a_timed_out_finalize_runs_after_it() -> None:
    """Calls run in the order issued even when an ``await`` gave up: a call issued after a
    finalize whose wait timed out finds the communicator finalized."""
    import asyncio  # noqa: PLC0415
    import time  # noqa: PLC0415

    class Slow:
        def __reduce__(self) -> tuple[Any, ...]:
            time.sleep(0.5)  # (a checkpoint that takes a while to pickle)
            return (int, (1,))

    comm = rabit2.aio.Communicator()
    await comm.init()
    slow = asyncio.ensure_future(comm.checkpoint(Slow()))
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(comm.finalize(), 0.1)
    with pytest.raises(NotInitializedError):
        await comm.allreduce(np.ones(2), rabit2.Op.SUM)
    await slow
    assert rabit2.version_number() == 0  # (finalized: not initialised any more)


def test_aio_methods_refuse_bad_arguments_when_called_not_when_awaited() -> None:
    """A bad argument raises from the method itself, before anything is queued (it would
    otherwise wait behind the calls issued before it)."""
    comm = rabit2.aio.Communicator()
    with pytest.raises(TypeError, match="numpy array"):
        comm.allreduce([1, 2], rabit2.Op.SUM)
    with pytest.raises(ValueError, match="op"):
        comm.allreduce(np.ones(2), "median")
    with pytest.raises(TypeError, match="bitwise"):
        comm.allreduce(np.ones(2), rabit2.Op.BITOR)
    with pytest.raises(TypeError, match="numpy array"):
        comm.allgather("ab")
    with pytest.raises(TypeError, match="unsupported dtype"):
        comm.allgather(np.array(["a"]))
    with pytest.raises(TypeError, match="bool"):
        comm.agree("yes")
    assert comm._worker is None  # (nothing was issued)


def test_aio_calls_in_a_process_forked_after_init_raise_at_once() -> None:
    """The communicator's thread stays with the parent: in the child a call raises the
    blocking API's NotInitializedError instead of waiting for a thread that is not there."""
    code = (
        "import asyncio, os, sys, numpy as np, rabit2, rabit2.aio\n"
        "comm = rabit2.aio.Communicator()\n"
        "asyncio.run(comm.init())\n"
        "asyncio.run(comm.allreduce(np.ones(2), rabit2.Op.SUM))\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n"
        "        asyncio.run(asyncio.wait_for(comm.allreduce(np.ones(2), rabit2.Op.SUM), 10))\n"
        "    except Exception as exc:\n"
        "        print('child', type(exc).__name__, flush=True)\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "asyncio.run(comm.finalize())\n")
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip() == "child NotInitializedError", out


def test_an_aio_communicators_thread_ends_once_the_communicator_is_gone() -> None:
    """A long-lived process running job after job keeps no thread per job."""
    import asyncio  # noqa: PLC0415
    import gc  # noqa: PLC0415
    import time  # noqa: PLC0415

    def aio_threads() -> set[int | None]:
        return {t.ident for t in threading.enumerate() if t.name == "rabit2-aio"}

    async def job() -> None:
        async with rabit2.aio.Communicator() as comm:
            await comm.allreduce(np.ones(2), rabit2.Op.SUM)

    before = aio_threads()
    for _ in range(5):
        asyncio.run(job())
    gc.collect()
    deadline = time.monotonic() + 10
    while aio_threads() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not aio_threads() - before  # (those of earlier tests may end meanwhile)
