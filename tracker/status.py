"""A job's status as ``rabit2-tracker --query``, the metrics endpoint and the launch slots
read it (``docs/user-guide.md``, "Status and metrics"): totals over the task rows that the
registry (or the classic protocol's server) lists."""

from __future__ import annotations

from typing import Any

from tracker.decisions import Finish


def job_status(world_size: int, port: int, prints: int, outcome: Finish | None,
               tasks: list[dict[str, Any]], only: str | None, *,
               assigned: bool) -> dict[str, Any]:
    """The status of a job whose ``tasks`` are listed (each as :meth:`Registry.status` lists
    it, for either protocol); ``only``: list that task alone (the totals count every task)."""
    listed = tasks if only is None else [task for task in tasks if task["task_id"] == only]
    return {
        "world_size": world_size,
        "port": port,
        "registered": len(tasks),
        "assigned": assigned,
        "finished": sum(task["finished"] for task in tasks),
        "done": outcome is not None,
        "success": None if outcome is None else outcome.success,
        "reason": None if outcome is None else outcome.reason,
        "prints": prints,
        "failures": sum(task["losses"] for task in tasks),
        "restarts": sum(task["incarnation"] for task in tasks),
        "connected": sum(task["connected"] for task in tasks),
        # ranks lost and not back yet, or back and still replaying what they missed
        "recovering": sorted(task["rank"] for task in tasks if _recovering(task)),
        "tasks": listed,
    }


def _recovering(task: dict[str, Any]) -> bool:
    # (a classic worker's row has no progress: it holds no connection between its commands,
    # so being unconnected says nothing about it)
    if task["rank"] is None or task["finished"] or "progress" not in task:
        return False
    progress = task.get("progress")
    if progress is None and task["incarnation"] > 0:
        return True  # (a restarted worker before its first heartbeat: about to replay)
    return not task["connected"] or bool(progress and progress.get("replaying"))


__all__ = ["job_status"]
