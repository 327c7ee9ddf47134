"""Real XGBoost training on a GPU (``device="cuda"``) through rabit2.

XGBoost's federated communicator, the one ``rabit2.xgboost`` serves, copies each device
buffer to the host around a collective, so rabit2 sees the same calls as on a CPU.  These
tests prove it on a GPU: the model of two workers training on one device through rabit2 is
bit-identical to the one XGBoost's own federated server gives (at two workers any reduction
order sums the same), and a worker lost mid-training comes back with that model.

Each test also runs with ``device="cpu"``, everywhere, so that the harness is proved on every
change; the ``cuda`` runs skip where the XGBoost wheel has no CUDA or no GPU is visible (the
workers report the device their booster used: XGBoost falls back to the CPU with a warning).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest

from tests.support import ROOT, WORKERS

xgboost = pytest.importorskip("xgboost")
if not xgboost.build_info().get("USE_FEDERATED"):
    pytest.skip("this XGBoost build has no federated communicator (xgboost-cpu?)",
                allow_module_level=True)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("no_job")]

WORKER = WORKERS / "xgb_worker.py"
LINE = re.compile(r"xgb rank=(\d+) world=(\d+) model=([0-9a-f]{64}) pred=([0-9a-f]{64}) "
                  r"device=(\S+)")
#: bigger than the CPU tests' data: enough rows for every tree to split on the device
ROWS = ("--rows", "20000", "--rounds", "8", "--depth", "6")


def _gpu_visible() -> bool:
    if not xgboost.build_info().get("USE_CUDA") or shutil.which("nvidia-smi") is None:
        return False
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                            timeout=30, check=False)
    return listed.returncode == 0 and "GPU " in listed.stdout


@pytest.fixture(params=["cpu", "cuda"])
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda" and not _gpu_visible():
        pytest.skip("no CUDA device (or an XGBoost built without CUDA)")
    return str(request.param)


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    env.pop("RABIT2_RECOVER", None)
    return env


def _models(out: str, world: int, device: str) -> tuple[str, str]:
    """Every rank printed its digests, all equal, from a booster on ``device``."""
    found = {int(r): (m, p, d) for r, w, m, p, d in LINE.findall(out) if int(w) == world}
    assert sorted(found) == list(range(world)), out[-3000:]
    assert len(set(found.values())) == 1, found
    model, pred, used = found[0]
    assert used.split(":")[0] == device, f"the booster ran on {used}, not {device}"
    return model, pred


def _through_rabit2(world: int, device: str, *args: str) -> tuple[str, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "tracker.submit", "--cluster", "local", "-n", str(world),
         "--max-attempts", "3", "--timeout", "150", "--", sys.executable, str(WORKER),
         *ROWS, "--extra", json.dumps({"device": device}), *args],
        capture_output=True, text=True, timeout=240, env=_env(), cwd=ROOT, check=False,
        stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if any(a == "--kill" for a in args):  # (the victim needed a second attempt)
        assert re.search(r"^\d+\s+\d+\s+2\s+0\s+ok", proc.stdout + proc.stderr, re.M), \
            proc.stdout[-3000:] + proc.stderr[-3000:]
    return _models(proc.stdout, world, device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _through_xgboosts_federated_server(world: int, device: str) -> tuple[str, str]:
    """The same training through XGBoost's own federated server and communicator."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys, xgboost.federated as f; "
         "f.run_federated_server(int(sys.argv[1]), int(sys.argv[2]), timeout=150)",
         str(world), str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        stdin=subprocess.DEVNULL)
    procs: list[subprocess.Popen[str]] = []
    try:
        for rank in range(world):
            args = {"dmlc_communicator": "federated",
                    "federated_server_address": f"127.0.0.1:{port}",
                    "federated_world_size": world, "federated_rank": rank}
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), "--backend", "xgboost", *ROWS,
                 "--extra", json.dumps({"device": device})],
                env={**_env(), "XGB_TRACKER_ARGS": json.dumps(args)}, stdout=subprocess.PIPE,
                text=True, stdin=subprocess.DEVNULL))
        out = "".join(p.communicate(timeout=200)[0] for p in procs)
        assert all(p.returncode == 0 for p in procs), out[-3000:]
        return _models(out, world, device)
    finally:  # (the server waits out its timeout after the job: stopped here)
        for p in (server, *procs):
            if p.poll() is None:
                p.kill()
                p.communicate()


def test_two_workers_train_xgboosts_own_model_through_rabit2(device: str) -> None:
    assert _through_rabit2(2, device) == _through_xgboosts_federated_server(2, device)


@pytest.mark.parametrize("kill", ["1,3,mid", "0,3,after"], ids=["mid-round", "after-checkpoint"])
def test_a_lost_worker_comes_back_with_the_same_model(device: str, kill: str) -> None:
    assert _through_rabit2(2, device, "--kill", kill) == _through_rabit2(2, device)
