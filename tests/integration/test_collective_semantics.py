"""``rabit2.collective`` against ``xgboost.collective`` (XGBoost 3, its own tracker) in the
same test run: the same program gives the same numbers, shapes and dtypes, and leaves its
inputs as XGBoost does."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import rabit2
from rabit2 import collective
from tests.support import WORKERS

WORKER = WORKERS / "collective_semantics.py"


def _reports(out: str) -> dict[int, dict[str, object]]:
    lines = [json.loads(line.split("SEMANTICS ", 1)[1]) for line in out.splitlines()
             if "SEMANTICS " in line]
    return {entry["rank"]: entry["report"] for entry in lines}


@pytest.mark.integration
def test_the_same_program_gives_what_xgboost_collective_gives() -> None:
    xgboost = pytest.importorskip("xgboost")
    from xgboost.tracker import RabitTracker  # noqa: PLC0415

    world = 3
    tracker = RabitTracker(n_workers=world, host_ip="127.0.0.1", timeout=60)
    tracker.start()
    env = dict(os.environ, XGB_TRACKER_ARGS=json.dumps(tracker.worker_args()))
    procs = [subprocess.Popen([sys.executable, str(WORKER), "xgboost"], env=env, text=True,
                              stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
             for _ in range(world)]
    theirs_out = "".join(p.communicate(timeout=60)[0] for p in procs)
    tracker.wait_for(30)
    assert all(p.returncode == 0 for p in procs), theirs_out
    ours = subprocess.run(["rabit2-submit", "--cluster", "local", "-n", str(world), "--",
                           sys.executable, str(WORKER), "rabit2"], capture_output=True,
                          text=True, timeout=90, check=False, stdin=subprocess.DEVNULL)
    assert ours.returncode == 0, ours.stdout + ours.stderr
    theirs, mine = _reports(theirs_out), _reports(ours.stdout)
    assert sorted(theirs) == sorted(mine) == list(range(world))
    for rank in range(world):
        if xgboost.__version__.startswith("3.0."):
            # (XGBoost 3.0's is_distributed returned 1, 3.1's True: rabit2 gives the bool)
            assert theirs[rank]["is_distributed"] == ["int", 1]
            theirs[rank]["is_distributed"] = ["bool", True]
        assert mine[rank] == theirs[rank], (rank, mine[rank], theirs[rank])
    assert xgboost.__version__.startswith("3.")


@pytest.mark.integration
def test_nested_contexts_and_sys_exit_0_end_the_job_as_the_outer_one_began_it() -> None:
    """A context inside another neither joins nor leaves (the inner one's end had finalized
    the job, and the rest of the outer block ran alone); ``sys.exit(0)`` inside a context
    is a normal end (it aborted the job); XGBoost imported: a warning says that this
    context does not connect XGBoost's training, and rabit2.xgboost's context, which joins
    and leaves the job itself, is refused inside it.  A context after a plain init takes the
    job over and ends it."""
    code = (
        "import sys, numpy as np, xgboost, rabit2, rabit2.xgboost as rx\n"
        "from rabit2 import collective as c\n"
        "if 'again' in sys.argv:\n"
        "    rabit2.init()\n"
        "    with rabit2.CommunicatorContext():\n"
        "        z = rabit2.allreduce(np.ones(1), rabit2.Op.SUM)\n"
        "    print('TAKEN OVER', z[0], rabit2.is_distributed(), flush=True)\n"
        "    sys.exit(0)\n"
        "with c.CommunicatorContext():\n"
        "    with c.CommunicatorContext():\n"
        "        x = c.allreduce(np.ones(1), c.Op.SUM)\n"
        "    with c.RabitContext():\n"
        "        pass\n"
        "    try:\n"
        "        with rx.CommunicatorContext():\n"
        "            pass\n"
        "    except RuntimeError as exc:\n"
        "        print('REFUSED', c.get_rank(), exc, flush=True)\n"
        "    y = c.allreduce(np.ones(1), c.Op.SUM)\n"
        "    print('NESTED', c.get_rank(), x[0], y[0], c.is_distributed(), flush=True)\n"
        "    sys.exit(0)\n"
    )
    proc = subprocess.run([sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n",
                           "2", "--", sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=120, check=False, stdin=subprocess.DEVNULL)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for rank in (0, 1):
        assert f"NESTED {rank} 2.0 2.0 True" in out, out
        assert f"REFUSED {rank} rabit2.xgboost.CommunicatorContext inside another" in out, out
    assert "xgboost.train or XGBModel.fit inside it trains alone" in out, out
    again = subprocess.run([sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n",
                            "2", "--", sys.executable, "-c", code, "again"],
                           capture_output=True, text=True, timeout=120, check=False,
                           stdin=subprocess.DEVNULL)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out
    assert out.count("TAKEN OVER 2.0 False") == 2, out


def test_allreduce_returns_a_new_flat_array_and_leaves_the_input() -> None:
    rabit2.init()
    try:
        a = np.arange(6, dtype=np.int64).reshape(2, 3)
        before = a.copy()
        result = collective.allreduce(a, collective.Op.SUM)
        assert result.shape == (6,) and result.dtype == np.int64
        assert not np.shares_memory(result, a)
        assert np.array_equal(a, before)
    finally:
        rabit2.finalize()


def test_config_sets_the_communicators_arguments_as_xgboosts_does() -> None:
    args = collective.Config(retry=2, timeout=60, tracker_port=9091).get_comm_config({"a": 1})
    assert args == {"a": 1, "dmlc_retry": 2, "dmlc_timeout": 60}
    assert collective.Config().get_comm_config({}) == {}
    rabit2.init(**collective.Config(retry=2, timeout=60).get_comm_config({}))
    try:
        config = rabit2.api.current_config()
        assert config is not None and (config.connect_retry, config.timeout_sec) == (2, 60)
    finally:
        rabit2.finalize()


def test_ops_have_xgboost_values_and_rabit_spellings() -> None:
    assert [(op.name, op.value) for op in collective.Op] == [
        ("MAX", 0), ("MIN", 1), ("SUM", 2), ("BITWISE_AND", 3), ("BITWISE_OR", 4),
        ("BITWISE_XOR", 5)]
    assert collective.Op.OR is collective.Op.BITWISE_OR


@pytest.mark.parametrize(("data", "op", "error", "message"), [
    ([1, 2], collective.Op.SUM, TypeError, "only takes in numpy.ndarray"),
    (np.ones(2), 9, ValueError, "9 is not an operator"),
    (np.ones(2, dtype=np.int32), rabit2.Op.BITOR, TypeError, "integers of rabit2.Op"),
    (np.ones(2, dtype=np.int32), True, TypeError, "a flag is no operator, got True"),
    (np.ones(2), np.True_, TypeError, "a flag is no operator"),
    (np.ones(2), None, TypeError, "must be a rabit2.collective.Op, not None"),
    (np.ones(2), "2", TypeError, "must be a rabit2.collective.Op, not '2'"),
    (np.ones(2), collective.Op.BITWISE_OR, TypeError, "^BITWISE_OR is a bitwise op .* float64"),
])
def test_bad_arguments_are_refused_before_anything_is_sent(
        data: object, op: object, error: type[Exception], message: str) -> None:
    rabit2.init()
    try:
        with pytest.raises(error, match=message):
            collective.allreduce(data, op)  # type: ignore[arg-type]
    finally:
        rabit2.finalize()


@pytest.mark.parametrize(("data", "root", "message"), [
    (5, 1, r"root must be a rank in \[0, 1\), got 1"),
    (5, "0", "root must be a rank"),
    (lambda: 1, 0, "cannot pickle function"),
])
def test_a_broadcast_before_init_refuses_what_a_job_would(
        data: object, root: object, message: str) -> None:
    """Before init XGBoost's broadcast acts as one worker's: so does rabit2.collective's, and
    a root that is no rank, or an object that cannot travel, fails here as in a job."""
    error = TypeError if callable(data) else ValueError
    with pytest.raises(error, match=message):
        collective.broadcast(data, root)  # type: ignore[arg-type]
    assert collective.broadcast(5, 0) == 5


@pytest.mark.parametrize("args", ["rabit_foo=1", b"rabit_foo=1", {"rabit_foo": 1}])
def test_rabit_context_refuses_one_string_or_a_dict(args: object) -> None:
    """list() would take the characters of one string as its arguments, and a dict's keys."""
    with pytest.raises(TypeError, match="a list of 'k=v' strings or bytes, got"):
        collective.RabitContext(args)  # type: ignore[arg-type]


def test_print_strips_and_the_context_returns_its_arguments(
        capsys: pytest.CaptureFixture[str]) -> None:
    with collective.CommunicatorContext(dmlc_communicator="rabit") as args:
        assert args == {"dmlc_communicator": "rabit"}
        collective.communicator_print("  progress 3/10 \n")
        assert collective.is_distributed() is False
        assert isinstance(collective.get_processor_name(), str)
    assert capsys.readouterr().out == "progress 3/10\n"
    with collective.RabitContext([b"rabit_timeout_sec=60"]):
        assert collective.get_world_size() == 1
