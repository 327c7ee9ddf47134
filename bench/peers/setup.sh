#!/usr/bin/env bash
# Install the peers of the side-by-side benchmark (bench/peers/run.py). Idempotent: a peer that
# is already usable is left alone. Each peer is installed independently; its outcome is written
# to bench/peers/.setup/<peer>.status ("ok" or "failed: <reason>") and its log next to it, so a
# failure of one never stops the others. Exit status is 0 even if some peers failed.
#
#   bash bench/peers/setup.sh            # all peers
#   bash bench/peers/setup.sh gloo xgb17 # some of them: gloo mpi xgb3 xgb17
set -u
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
STATE="$HERE/.setup"
PY="${PYTHON:-python}"
mkdir -p "$STATE"

record() {  # record PEER STATUS
    echo "$2" >"$STATE/$1.status"
    echo "[setup] $1: $2"
}

run_peer() {  # run_peer NAME FUNCTION: run FUNCTION with its output in the peer's log
    local name="$1" fn="$2" log="$STATE/$1.log"
    : >"$log"
    if "$fn" >>"$log" 2>&1; then
        record "$name" ok
    else
        record "$name" "failed: $(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200)"
    fi
}

have_py() {  # have_py PYTHON CODE: true if CODE runs in PYTHON
    "$1" -c "$2" >/dev/null 2>&1
}

setup_gloo() {
    if have_py "$PY" 'import torch, sys; sys.exit(0 if torch.__version__.split("+")[0] == "2.13.0" and torch.distributed.is_gloo_available() else 1)'; then
        echo "torch 2.13.0 with gloo already installed"; return 0
    fi
    # The CPU wheel of exactly this version is on local disk; never pull CUDA packages.
    "$PY" -m pip install --no-input "torch==2.13.0" || return 1
    have_py "$PY" 'import torch; assert torch.distributed.is_gloo_available()' || {
        echo "torch installed but gloo is not available"; return 1; }
}

apt_updated=0
setup_mpi() {
    if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
        if [ "$apt_updated" = 0 ]; then apt-get update || return 1; apt_updated=1; fi
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            openmpi-bin libopenmpi-dev || return 1
    fi
    if ! have_py "$PY" 'import mpi4py.MPI'; then
        "$PY" -m pip install --no-input mpi4py || return 1
    fi
    have_py "$PY" 'from mpi4py import MPI; print(MPI.Get_library_version())' || {
        echo "mpi4py does not import"; return 1; }
}

setup_xgb3() {
    if have_py "$PY" 'import xgboost, sys; sys.exit(0 if int(xgboost.__version__.split(".")[0]) >= 3 else 1)'; then
        echo "xgboost 3.x already installed"; return 0
    fi
    "$PY" -m pip install --no-input "xgboost-cpu>=3,<4" || return 1
    have_py "$PY" 'import xgboost.collective, xgboost.tracker' || {
        echo "xgboost 3 installed but xgboost.collective does not import"; return 1; }
}

setup_xgb17() {
    local venv="$HERE/.venv17"
    local vpy="$venv/bin/python"
    if have_py "$vpy" 'import xgboost, sys; sys.exit(0 if xgboost.__version__ == "1.7.6" else 1)'; then
        echo "xgboost 1.7.6 venv already usable"; return 0
    fi
    [ -x "$vpy" ] || "$PY" -m venv "$venv" || return 1
    "$vpy" -m pip install --no-input "numpy<2" "xgboost==1.7.6" || return 1
    have_py "$vpy" 'import xgboost.rabit, xgboost.tracker' || {
        echo "xgboost 1.7.6 does not import"; return 1; }
}

peers=("$@")
[ ${#peers[@]} -gt 0 ] || peers=(gloo mpi xgb3 xgb17)
for p in "${peers[@]}"; do
    case "$p" in
        gloo) run_peer gloo setup_gloo ;;
        mpi) run_peer mpi setup_mpi ;;
        xgb3) run_peer xgb3 setup_xgb3 ;;
        xgb17) run_peer xgb17 setup_xgb17 ;;
        *) record "$p" "failed: unknown peer" ;;
    esac
done
exit 0
