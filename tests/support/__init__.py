"""What the test folders share: bounded waits for jobs (:mod:`tests.support.jobs`),
throwaway hosts in network namespaces (:mod:`tests.support.netns`) and the worker programs
the jobs run (``workers/``)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "workers"
