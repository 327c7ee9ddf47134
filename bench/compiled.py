"""Would compiling the call path pay?  This checkout, side by side with a copy of it whose
call-path modules are compiled unchanged by Cython (``--kind cython``), or whose express pair
exchange (world size 2) is made by hand-written C (``--kind express``: the C and the
Python that calls it are in ``bench/compiled_express/``, an experiment that is not part of
the package) (docs/performance.md, "Compiled call path").

    python bench/compiled.py                     # N=2 and 4: 4K..1M allreduce, the GBDT example
    python bench/compiled.py --rounds 6 --n 2
    python bench/compiled.py --kind express --n 2 --rounds 3

Needs a C compiler and Python's headers, and for ``--kind cython`` Cython
(``pip install cython``).  The copy goes to a temporary folder
(``--keep`` leaves it); each round runs both variants (in reverse order every other round) with
``bench/run.py``, and a cell is the median over rounds; the ratio is the median of the
per-round ratios source / compiled (> 1: compiled faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from units import fmt_size, fmt_time

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: what one allreduce or broadcast runs through, from the API to the agent and its links
MODULES = [
    "rabit2/calls.py", "rabit2/state.py",
    *(f"rabit2/core/{m}.py" for m in (
        "agent", "failures", "framing", "fsm", "ops", "pair", "peers", "planning", "progress",
        "records", "sending")),
    *(f"rabit2/core/recovery/{m}.py" for m in ("component", "replay", "store")),
    *(f"rabit2/core/schedule/{m}.py" for m in (
        "pair_exchange", "ring", "ring_allgather", "ring_allreduce", "tree_allreduce",
        "tree_broadcast")),
    *(f"rabit2/io/{m}.py" for m in ("driving", "engine", "links", "loop_thread", "waiting")),
]
BUILD = """\
import sys
from setuptools import setup
from Cython.Build import cythonize
setup(name="rabit2-compiled-copy", script_args=["build_ext", "--inplace", "-j", "{jobs}"],
      ext_modules=cythonize(sys.argv[1:], quiet=True, compiler_directives={{
          "language_level": 3, "annotation_typing": False}}))
"""


def make_copy(dest: Path) -> None:
    """Copy the checkout's packages and bench/ to ``dest`` and compile MODULES there."""
    skip = shutil.ignore_patterns("__pycache__", "results", ".venv*", ".setup")
    for part in ("rabit2", "tracker", "bench"):
        shutil.copytree(ROOT / part, dest / part, ignore=skip)
    (dest / "bench" / "results").mkdir()
    script = dest / "build_compiled.py"
    script.write_text(BUILD.format(jobs=os.cpu_count() or 1))
    print(f"compiling {len(MODULES)} modules in {dest} ...", flush=True)
    proc = subprocess.run([sys.executable, str(script), *MODULES], cwd=dest,
                          capture_output=True, text=True, check=False)
    built = list(dest.glob("rabit2/**/*.so"))
    if proc.returncode != 0 or len(built) != len(MODULES):
        raise SystemExit(f"the build failed ({len(built)} of {len(MODULES)} modules):\n"
                         + (proc.stdout + proc.stderr)[-3000:])


def make_express_copy(dest: Path) -> None:
    """Copy the checkout's packages and bench/ to ``dest``, apply the express C experiment's
    Python there and build its module (for this machine's CPU)."""
    skip = shutil.ignore_patterns("__pycache__", "results", ".venv*", ".setup")
    for part in ("rabit2", "tracker", "bench"):
        shutil.copytree(ROOT / part, dest / part, ignore=skip)
    (dest / "bench" / "results").mkdir()
    here = HERE / "compiled_express"
    with (here / "wiring.patch").open() as patch:
        proc = subprocess.run(["patch", "-p1", "-d", str(dest)], stdin=patch,
                              capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the experiment's Python no longer applies to this checkout:\n"
                         f"{proc.stdout}{proc.stderr}")
    source = dest / "rabit2" / "_fastpath.c"
    shutil.copy(here / "fastpath.c", source)
    module = dest / "rabit2" / f"_fastpath{sysconfig.get_config_var('EXT_SUFFIX')}"
    cmd = ["gcc", "-O3", "-march=native", "-Wall", "-shared", "-fPIC",
           f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(module)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"the build failed:\n{proc.stderr[-3000:]}")


def run_variant(tree: Path, args: list[str], out: Path) -> list[dict[str, Any]]:
    """One ``bench/run.py`` job of ``tree``, run in ``tree`` (``python -m`` puts the working
    directory ahead of ``PYTHONPATH``: elsewhere the GBDT workers would import another copy);
    its JSON rows."""
    out.mkdir(parents=True)
    cmd = [sys.executable, str(tree / "bench" / "run.py"), "--results", str(out), *args]
    proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # (the launcher and its workers too)
        proc.communicate()
        raise SystemExit(f"{' '.join(cmd)} did not finish in 900 s") from None
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{text[-3000:]}")
    rows: list[dict[str, Any]] = []
    for raw in out.glob("*.jsonl"):
        if "-collectives-" not in raw.name:
            rows += [json.loads(line) for line in raw.read_text().splitlines() if line.strip()]
    return rows


def key_value(row: dict[str, Any]) -> tuple[str, float] | None:
    if row.get("op") == "gbdt-bench":
        return f"GBDT example N={row['world']}, s in allreduce (rank 0)", row["allreduce_s"]
    if "median_s" in row:
        return f"{row['op']} N={row['world']} {fmt_size(row['size_bytes'])}", row["median_s"]
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="2,4")
    ap.add_argument("--sizes", default="4K,64K,1M")
    ap.add_argument("--ops", default="allreduce")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--kind", choices=("cython", "express"), default="cython")
    ap.add_argument("--keep", action="store_true", help="leave the compiled copy")
    ns = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rabit2-compiled-"))
    try:
        (make_copy if ns.kind == "cython" else make_express_copy)(work / "copy")
        variants = {"source": ROOT, "compiled": work / "copy"}
        jobs = [["--n", ns.n, "--sizes", ns.sizes, "--ops", ns.ops],
                ["--n", ns.n, "--gbdt-only"]]
        seen: dict[str, dict[str, list[float]]] = {}
        for rnd in range(ns.rounds):
            order = list(variants) if rnd % 2 == 0 else list(variants)[::-1]
            for j, args in enumerate(jobs):
                for name in order:
                    rows = run_variant(variants[name], args, work / f"r{rnd}-j{j}-{name}")
                    for row in rows:
                        kv = key_value(row)
                        if kv is not None:
                            seen.setdefault(kv[0], {}).setdefault(name, []).append(kv[1])
            print(f"round {rnd + 1} of {ns.rounds} done", flush=True)
        print(f"\n| what ({ns.rounds} rounds, medians) | source | compiled | source / compiled |")
        print("| --- | --- | --- | --- |")
        for what, by in seen.items():
            src, comp = by.get("source", []), by.get("compiled", [])
            if not src or len(src) != len(comp):
                continue
            ratio = statistics.median(s / c for s, c in zip(src, comp, strict=True))
            won = sum(c < s for s, c in zip(src, comp, strict=True))
            print(f"| {what} | {fmt_time(statistics.median(src))} | "
                  f"{fmt_time(statistics.median(comp))} | {ratio:.2f}x ({won}/{len(src)}) |")
    finally:
        if ns.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
