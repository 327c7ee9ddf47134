"""The tracker's registry on its own: events in, decisions out; no sockets, no clock.

Connections are plain strings here ("c0", "c1", ...), times plain numbers.
"""

from __future__ import annotations

from typing import Any

import pytest

from rabit2.core.topology import topology
from rabit2.errors import ProtocolError
from tracker.decisions import Decision, Fence, Finish, Grace, Hook, Release, Send
from tracker.registry import SILENCE_REASON, Registry

Decisions = list[Decision[str]]


def register_msg(task_id: str, port: int = 9000, attempt: int = 0,
                 world_size: int = -1) -> dict[str, Any]:
    return {"t": "register", "task_id": task_id, "attempt": attempt, "port": port,
            "world_size": world_size}


def rejoin_msg(task_id: str, rank: int, incarnation: int = 0,
               port: int = 9000, attempt: int = 0) -> dict[str, Any]:
    return {"t": "rejoin", "task_id": task_id, "rank": rank, "incarnation": incarnation,
            "port": port, "attempt": attempt}


def register(registry: Registry[str], conn: str, task_id: str, now: float = 0.0,
             **kwargs: Any) -> Decisions:
    return registry.register(conn, register_msg(task_id, **kwargs), host=f"10.0.0.{conn[1:]}",
                             peer=f"{conn}:1", now=now)


def sends(decisions: Decisions, kind: str) -> dict[str, Send[str]]:
    """The messages of type ``kind`` among ``decisions``, by the task they go to."""
    return {d.task_id: d for d in decisions if isinstance(d, Send) and d.msg["t"] == kind}


def hooks(decisions: Decisions, name: str) -> list[Hook]:
    return [d for d in decisions if isinstance(d, Hook) and d.name == name]


def job(n: int, **kwargs: Any) -> tuple[Registry[str], Decisions]:
    """A registry with tasks "0".."n-1" registered on connections "c0".."c<n-1>"."""
    registry: Registry[str] = Registry(n, **kwargs)
    decisions: Decisions = []
    for i in range(n):
        decisions += register(registry, f"c{i}", str(i), port=9000 + i)
    return registry, decisions


def test_ranks_are_assigned_once_every_task_registered_with_a_reason() -> None:
    registry: Registry[str] = Registry(3)
    assert register(registry, "c0", "task10") == []
    assert register(registry, "c1", "task2") == []
    decisions = register(registry, "c2", "task1")
    assigned = {hook.args[0]: hook.args[1] for hook in hooks(decisions, "on_rank_assigned")}
    assert assigned == {"task1": 0, "task2": 1, "task10": 2}  # natural order of the ids
    assigns = sends(decisions, "assign")
    assert set(assigns) == {"task1", "task2", "task10"}
    assert assigns["task10"].conn == "c0"
    for send in assigns.values():
        assert send.reason == "all 3 workers registered; ranks by task id"
        links = topology(send.msg["rank"], 3)
        assert send.msg["parent"] == links.parent and send.msg["incarnation"] == 0
        assert set(send.msg["peers"]) == {str(r) for r in links.neighbors}
    # each names its neighbours' addresses: the host the registration came from, its port
    assert assigns["task1"].msg["peers"]["2"] == ["10.0.0.0", 9000]
    assert registry.status()["assigned"] and registry.status()["registered"] == 3


def test_ranks_by_arrival() -> None:
    registry: Registry[str] = Registry(2, sortby="arrival")
    register(registry, "c0", "b")
    decisions = register(registry, "c1", "a")
    assert [hook.args for hook in hooks(decisions, "on_rank_assigned")] == [("b", 0), ("a", 1)]
    assert "ranks by arrival" in hooks(decisions, "on_rank_assigned")[0].reason


def test_registrations_that_do_not_fit_the_job_are_refused() -> None:
    registry, _ = job(2)
    with pytest.raises(ProtocolError, match="already has 2 tasks"):
        register(registry, "c9", "stranger")
    with pytest.raises(ProtocolError, match="world size 3"):
        register(registry, "c9", "0", world_size=3)
    with pytest.raises(ProtocolError, match="not a TCP port"):
        register(registry, "c9", "0", port=0)
    with pytest.raises(ProtocolError, match="characters"):
        register(registry, "c9", "x" * 257)
    with pytest.raises(ProtocolError, match="attempt -5 is negative"):
        register(registry, "c9", "0", attempt=-5)
    msg = {**register_msg("0"), "restarts": 1}  # (optional, but a bool where it is sent)
    with pytest.raises(ProtocolError, match="restarts must be a bool"):
        registry.register("c9", msg, host="10.0.0.9", peer="c9:1", now=0.0)


def test_a_silent_worker_is_lost_at_once_and_its_neighbours_are_told() -> None:
    registry, _ = job(4)
    decisions = registry.connection_ended("c1", f"{SILENCE_REASON} 30s")
    lost = sends(decisions, "peer_lost")
    assert set(lost) == {str(r) for r in topology(1, 4).neighbors}
    for send in lost.values():
        assert send.msg == {"t": "peer_lost", "reason": f"{SILENCE_REASON} 30s", "rank": 1,
                            "incarnation": 0}
        assert send.reason == f"rank 1 (task 1) lost: {SILENCE_REASON} 30s"
    (hook,) = hooks(decisions, "on_worker_lost")
    assert hook.args == ("1", 1, f"{SILENCE_REASON} 30s")
    status = registry.status()
    assert status["failures"] == 1 and not status["tasks"][1]["connected"]


def test_a_rejoin_within_the_grace_is_no_loss() -> None:
    registry, _ = job(2, rejoin_grace=5.0)
    (grace,) = registry.connection_ended("c1", "connection closed by the worker")
    assert isinstance(grace, Grace)
    assert (grace.task_id, grace.delay) == ("1", 5.0)
    assert "may rejoin" in grace.reason
    decisions = registry.rejoin("c7", rejoin_msg("1", rank=1), host="10.0.0.7", peer="c7:1",
                                now=1.0)
    (rejoined,) = decisions
    assert isinstance(rejoined, Send)
    assert (rejoined.conn, rejoined.msg) == ("c7", {"t": "rejoined"})
    assert rejoined.reason == "rank 1 (task 1) rejoined within the grace"
    assert registry.grace_over("1", grace.token) == []  # it came back: nothing happens
    assert registry.status()["failures"] == 0
    assert registry.task_of("c7") is registry.tasks["1"]


def test_a_rejoin_proves_the_process_lives_and_its_next_connection_end_gets_a_grace(
) -> None:
    """The launcher saw a process of the task end while its connection still looked open,
    then the worker rejoined on a new connection: what ended was another process, so the
    end of the new connection gets the grace again, not a loss at once."""
    registry, _ = job(2)
    assert registry.worker_exited("1") == []  # (its connection is still open here)
    decisions = registry.rejoin("c7", rejoin_msg("1", rank=1), host="h", peer="c7:1", now=1.0)
    assert [d.conn for d in decisions if isinstance(d, Fence)] == ["c1"]
    assert sends(decisions, "rejoined")["1"].conn == "c7"
    (grace,) = registry.connection_ended("c7", "connection reset")
    assert isinstance(grace, Grace) and grace.task_id == "1"
    assert registry.status()["failures"] == 0


def test_a_grace_ends_only_by_its_own_token() -> None:
    """The connection ends, the worker rejoins, its new connection ends too: the first
    grace running out does not cut the second one short."""
    registry, _ = job(2)
    (first,) = registry.connection_ended("c1", "connection reset")
    registry.rejoin("c5", rejoin_msg("1", rank=1), host="h", peer="c5:1", now=1.0)
    (second,) = registry.connection_ended("c5", "connection reset")
    assert isinstance(first, Grace) and isinstance(second, Grace)
    assert first.token != second.token
    assert registry.grace_over("1", first.token) == []
    assert hooks(registry.grace_over("1", second.token), "on_worker_lost")


def test_no_rejoin_within_the_grace_is_a_loss_and_a_late_rejoin_is_refused() -> None:
    registry, _ = job(2)
    (grace,) = registry.connection_ended("c0", "connection reset")
    assert isinstance(grace, Grace)
    decisions = registry.grace_over("0", grace.token)
    assert sends(decisions, "peer_lost")["1"].msg["reason"] == "connection reset"
    assert hooks(decisions, "on_worker_lost")[0].args == ("0", 0, "connection reset")
    with pytest.raises(ProtocolError, match="declared lost"):
        registry.rejoin("c5", rejoin_msg("0", rank=0), host="h", peer="c5:1", now=9.0)
    with pytest.raises(ProtocolError, match="no such worker"):
        registry.rejoin("c5", rejoin_msg("1", rank=1, incarnation=3), host="h", peer="p", now=9)


def test_a_second_process_of_a_running_task_is_refused() -> None:
    """A task launched twice by mistake: a process with the same task id and attempt, while
    the first one is connected and heard from recently, is not its restart."""
    registry, _ = job(2)
    registry.heard("c1", 10.0)
    with pytest.raises(ProtocolError, match="runs already"):
        register(registry, "c9", "1", now=12.0, port=9100, attempt=0)
    task = registry.tasks["1"]
    assert task.conn == "c1" and task.incarnation == 0 and task.port == 9001
    assert registry.task_of("c9") is None
    # once the first has gone quiet, the same attempt is taken for its restart
    decisions = register(registry, "c9", "1", now=20.0, port=9100, attempt=0)
    assert sends(decisions, "assign")["1"].msg["incarnation"] == 1
    assert [d.conn for d in decisions if isinstance(d, Fence)] == ["c1"]
    # a worker back within its grace runs again: another process is refused as well
    (grace,) = registry.connection_ended("c9", "connection reset")
    registry.rejoin("c5", rejoin_msg("1", rank=1, incarnation=1), host="h", peer="c5:1",
                    now=21.0)
    with pytest.raises(ProtocolError, match="runs already"):
        register(registry, "c6", "1", now=22.0, attempt=0)
    assert registry.tasks["1"].conn == "c5" and registry.grace_over("1", grace.token) == []


def test_the_launcher_seeing_the_process_exit_ends_the_grace() -> None:
    registry, _ = job(2)
    registry.connection_ended("c0", "connection reset")
    decisions = registry.worker_exited("0")
    assert hooks(decisions, "on_worker_lost")
    assert registry.worker_exited("0") == []  # (once)


def test_an_exit_reported_for_another_run_changes_nothing() -> None:
    """A supervisor's report names the run that ended: one about an earlier run (late, its
    replacement already registered) or a later one leaves the registered run's place alone;
    the right run's report ends the grace; a task id out of bounds is a protocol error."""
    registry, _ = job(2)
    registry.connection_ended("c0", "connection reset")
    assert registry.worker_exited("0", attempt=1) == []
    assert registry.tasks["0"].pending_loss is not None  # (still in its grace)
    assert hooks(registry.worker_exited("0", attempt=0), "on_worker_lost")
    register(registry, "c5", "0", port=9100, attempt=1)
    assert registry.worker_exited("0", attempt=0) == []
    assert not registry.tasks["0"].exited  # (the new run's end still gets its grace)
    (grace,) = registry.connection_ended("c5", "connection reset")
    assert isinstance(grace, Grace)
    with pytest.raises(ProtocolError, match="task_id"):
        registry.exit_reported("x" * 300, attempt=0)
    assert registry.exit_reported("9", attempt=0) == []  # (no such task: nothing to do)


def test_the_process_exit_heard_before_its_connection_ended_leaves_no_grace() -> None:
    """The launcher reaps the process before the tracker's thread reads the end of its
    connection: the end is then a loss at once (a grace would hold the survivors that wait
    for the notice until the restart comes), and a restart starts with a clean slate."""
    registry, _ = job(3)
    assert registry.worker_exited("1") == []
    decisions = registry.connection_ended("c1", "connection closed by the worker")
    assert not [d for d in decisions if isinstance(d, Grace)]
    assert hooks(decisions, "on_worker_lost")[0].args == ("1", 1,
                                                           "connection closed by the worker")
    told = sends(decisions, "peer_lost")
    assert told and "1" not in told
    assert all(d.msg["reason"] == "connection closed by the worker" for d in told.values())
    register(registry, "c9", "1", port=9100, attempt=1)
    (grace,) = registry.connection_ended("c9", "connection reset")
    assert isinstance(grace, Grace)  # (the new process may still rejoin)


def test_a_restart_gets_its_rank_back_and_its_neighbours_hear_of_it() -> None:
    registry, _ = job(3)
    registry.connection_ended("c1", "connection closed by the worker")
    decisions = register(registry, "c9", "1", port=9100, attempt=1)
    # within the grace: the old process is lost first, then the new one recovers
    kinds = [d.msg["t"] if isinstance(d, Send) else type(d).__name__ for d in decisions]
    assert (kinds.index("peer_lost") < kinds.index("Hook") < kinds.index("assign")
            < kinds.index("peer_recovered"))
    lost = sends(decisions, "peer_lost")
    assert {send.msg["incarnation"] for send in lost.values()} == {0}
    assign = sends(decisions, "assign")["1"]
    assert (assign.conn, assign.msg["rank"], assign.msg["incarnation"]) == ("c9", 1, 1)
    assert assign.reason == "rank 1 (task 1) registered again as incarnation 1"
    recovered = sends(decisions, "peer_recovered")
    assert set(recovered) == {str(r) for r in topology(1, 3).neighbors}
    assert all(s.msg == {"t": "peer_recovered", "host": "10.0.0.9", "port": 9100, "rank": 1,
                         "incarnation": 1} for s in recovered.values())
    status = registry.status()
    assert (status["failures"], status["restarts"]) == (1, 1)


def test_a_newer_registration_fences_the_old_connection() -> None:
    registry, _ = job(2)
    decisions = register(registry, "c9", "0", attempt=1)
    (fence,) = [d for d in decisions if isinstance(d, Fence)]
    assert (fence.task_id, fence.conn) == ("0", "c0")
    assert fence.reason == "rank 0 (task 0) registered again"
    assert registry.task_of("c0") is None
    assert registry.connection_ended("c0", "connection closed by the worker") == []
    assert sends(decisions, "assign")["0"].msg["incarnation"] == 1


def test_a_new_tracker_adopts_the_workers_that_rejoin_it() -> None:
    """After a tracker restart, workers rejoin with their ranks; a task that died meanwhile
    registers and takes the free rank, as incarnation = its attempt."""
    registry: Registry[str] = Registry(3)
    for rank, task_id in ((2, "c"), (0, "a")):
        (rejoined,) = registry.rejoin(f"c{rank}", rejoin_msg(task_id, rank, incarnation=4),
                                      host="h", peer="p", now=0.0)
        assert isinstance(rejoined, Send) and rejoined.msg == {"t": "rejoined"}
        assert rejoined.reason.endswith("rejoined from a previous tracker")
    assert registry.tasks["c"].rank == 2 and registry.tasks["c"].incarnation == 4
    decisions = register(registry, "c1", "b", attempt=2)
    assigned = {hook.args for hook in hooks(decisions, "on_rank_assigned")}
    assert assigned == {("a", 0), ("b", 1), ("c", 2)}
    assign = sends(decisions, "assign")
    assert assign["b"].msg["rank"] == 1 and assign["b"].msg["incarnation"] == 2
    assert assign["b"].msg["incarnations"] == {"0": 4, "2": 4}
    # a rank already taken is not adopted twice
    with pytest.raises(ProtocolError, match="no such worker"):
        registry.rejoin("c8", rejoin_msg("d", rank=0), host="h", peer="p", now=0.0)


def test_a_new_tracker_adopts_one_worker_per_rank() -> None:
    """Two workers that rejoin a restarted tracker claiming the same rank (ranks are still
    free, so the tracker adopts): the first keeps it, the second is refused."""
    registry: Registry[str] = Registry(3)
    registry.rejoin("c1", rejoin_msg("a", 1), host="h", peer="p", now=0.0)
    first = registry.by_rank[1]
    assert first.task_id == "a"
    with pytest.raises(ProtocolError, match="no such worker"):
        registry.rejoin("c2", rejoin_msg("b", 1), host="h", peer="p", now=0.0)
    assert registry.by_rank[1] is first and registry.task_of("c1") is first
    assert "b" not in registry.tasks and registry.task_of("c2") is None


def test_an_adopted_workers_exit_report_names_its_run() -> None:
    """A worker adopted after a tracker restart keeps the run its launcher counts (the
    ``attempt`` of its ``rejoin``, not its incarnation): a supervisor's report that this run
    ended makes it lost at once when its connection has ended, without waiting out the
    grace; a report about another run changes nothing."""
    registry: Registry[str] = Registry(3, rejoin_grace=5.0)
    registry.rejoin("c2", rejoin_msg("c", 2, incarnation=4, attempt=1), host="h", peer="p",
                    now=0.0)
    assert registry.tasks["c"].attempt == 1
    (grace,) = registry.connection_ended("c2", "connection reset")
    assert isinstance(grace, Grace)
    assert registry.exit_reported("c", 4) == []  # (its incarnation is not its run)
    decisions = registry.exit_reported("c", 1)
    assert [hook.args for hook in hooks(decisions, "on_worker_lost")] == [
        ("c", 2, "connection reset")]


def test_an_adopted_worker_lost_before_its_neighbours_are_back_is_a_loss() -> None:
    """After a tracker restart rank 2 rejoins and is lost before ranks 0 and 1 come back: a
    loss like any other (the launcher hears of it), told to whichever neighbours are back."""
    registry: Registry[str] = Registry(3, rejoin_grace=5.0)
    registry.rejoin("c2", rejoin_msg("c", 2), host="h", peer="p", now=0.0)
    (grace,) = registry.connection_ended("c2", "connection reset")
    assert isinstance(grace, Grace)
    decisions = registry.grace_over("c", grace.token)
    assert [hook.args for hook in hooks(decisions, "on_worker_lost")] == [
        ("c", 2, "connection reset")]
    assert not sends(decisions, "peer_lost")  # (nobody is back to be told)


def test_an_abort_reaches_every_worker_and_keeps_the_first_reason() -> None:
    registry: Registry[str] = Registry(3)
    register(registry, "c0", "0")
    register(registry, "c1", "1")
    decisions = registry.error("c1", "disk full")
    reason = "task 1 signalled an error: disk full"
    assert set(sends(decisions, "abort")) == {"0"}  # not the one that said it
    assert decisions[-1] == Finish(False, reason)
    assert registry.abort("a second reason") == []
    assert registry.mark_failed("0", "gave up") == []
    assert registry.outcome == Finish(False, reason)
    # a worker that registers after the abort hears why at once
    late = register(registry, "c2", "2")
    assert sends(late, "abort")["2"].msg == {"t": "abort", "reason": reason}
    assert registry.status()["reason"] == reason and not registry.status()["success"]


def test_the_task_whose_error_ended_the_job_stays_its_origin() -> None:
    registry, _ = job(3)
    registry.error("c1", "disk full")
    assert registry.origin == "1"
    assert registry.error("c2", "and another error") == []  # (the job had ended)
    assert registry.origin == "1"
    assert registry.outcome == Finish(False, "rank 1 (task 1) signalled an error: disk full")


def test_a_collective_timeout_names_the_ranks_that_were_not_in_a_call() -> None:
    """Who kept the others waiting: a timeout's reason names the ranks whose last heartbeat
    said they were between calls (not those in a call, silent so far, whose heartbeats do
    not say, or shut down)."""
    registry, _ = job(6)
    registry.heartbeat("c1", {"version": 1, "calls": 3, "in_call": False})
    registry.heartbeat("c2", {"version": 1, "calls": 4, "in_call": True})
    registry.heartbeat("c5", {"version": 1, "calls": 4})  # (an older worker: in_call unsaid)
    registry.heartbeat("c3", {"version": 1, "calls": 3, "in_call": False})
    registry.heartbeat("c4", {"version": 1, "calls": 4, "in_call": False})
    registry.shutdown("c4", hold=True)  # (done: it keeps nobody waiting)
    text = "CollectiveTimeoutError: allreduce timed out after 60 s"
    decisions = registry.error("c0", text)
    reason = (f"rank 0 (task 0) signalled an error: {text} (not in a collective call at "
              "their last heartbeat: rank 1, 3)")
    assert decisions[-1] == Finish(False, reason)
    assert sends(decisions, "abort")["2"].msg["reason"] == reason
    # any other error leaves the heartbeats out
    other, _ = job(2)
    other.heartbeat("c1", {"version": 1, "calls": 3, "in_call": False})
    assert other.error("c0", "disk full")[-1] == Finish(
        False, "rank 0 (task 0) signalled an error: disk full")


def test_a_worker_that_registers_after_a_successful_end_is_not_told_to_abort() -> None:
    registry: Registry[str] = Registry(3)
    register(registry, "c0", "0")
    register(registry, "c1", "1")
    registry.finish(True, "every rank shut down")  # (as a tracker of classic workers does)
    late = register(registry, "c2", "2")
    assert sends(late, "abort") == {}
    assert set(sends(late, "assign")) == {"0", "1", "2"}
    assert registry.outcome == Finish(True, "every rank shut down")


def test_the_first_outcome_stands() -> None:
    """(A job of classic workers reports that every rank shut down through ``finish``: after
    an abort, that must not turn the job into a success.)"""
    registry, _ = job(2)
    registry.abort("the launcher gave up")
    assert registry.finish(True, "every rank shut down") == []
    assert registry.outcome == Finish(False, "the launcher gave up")


def test_an_abort_reason_is_bounded() -> None:
    registry, _ = job(1)
    decisions = registry.abort("x" * 100_000)
    assert sends(decisions, "abort")["0"].msg["reason"].endswith(" ...[truncated]")
    assert len(sends(decisions, "abort")["0"].msg["reason"]) < 70_000


def test_a_supervisor_give_up_names_the_task() -> None:
    registry, _ = job(2)
    decisions = registry.give_up("1", "3 attempts failed")
    assert decisions[-1] == Finish(False, "rank 1 (task 1) failed for good: 3 attempts failed")
    with pytest.raises(ProtocolError):
        registry.give_up("", "why")


def test_an_unreachable_rank_that_is_alive_is_a_partition() -> None:
    registry, _ = job(3)
    registry.heard("c1", 100.0)
    registry.heard("c2", 90.0)
    quiet = registry.unreachable("c0", 2, "link down for 15 s", now=100.0)
    assert quiet == []  # rank 2 quiet for 10 s: left to recovery
    decisions = registry.unreachable("c0", 1, "link down for 15 s", now=100.0)
    (finish,) = [d for d in decisions if isinstance(d, Finish)]
    assert not finish.success
    assert finish.reason.startswith("ranks 0 and 1 cannot reach each other while both reach "
                                    "the tracker: a network partition between their hosts "
                                    "(10.0.0.0 and 10.0.0.1)")
    assert set(sends(decisions, "abort")) == {"0", "1", "2"}


def test_an_unreachable_rank_that_shut_down_is_no_partition() -> None:
    """A rank that finished closes its links: a neighbour that cannot reach it any more is
    no partition, even while the finished worker still reaches the tracker."""
    registry, _ = job(3)
    registry.heard("c1", 100.0)
    registry.shutdown("c1", hold=False)
    assert registry.task_of("c1") is registry.tasks["1"]  # (connected until it closes)
    assert registry.unreachable("c0", 1, "link down for 15 s", now=100.0) == []
    assert registry.outcome is None


def test_shutdown_holds_until_every_rank_finished_then_bye_and_success() -> None:
    registry, _ = job(2)
    held = registry.shutdown("c0", hold=True)
    assert held == []  # keeps serving its neighbour: no bye, not done for good
    assert registry.tasks["0"].held
    decisions = registry.shutdown("c1", hold=True)
    assert [hook.args for hook in hooks(decisions, "on_task_finished")] == []
    assert set(sends(decisions, "bye")) == {"0", "1"}
    assert [d.conn for d in decisions if isinstance(d, Release)] == ["c1"]
    assert decisions[-1] == Finish(True, "every rank shut down")
    assert registry.status()["finished"] == 2 and registry.status()["done"]


def test_a_shutdown_that_does_not_hold_is_final() -> None:
    registry, _ = job(2)
    decisions = registry.shutdown("c0", hold=False)
    assert [hook.args for hook in hooks(decisions, "on_task_finished")] == [("0",)]
    assert set(sends(decisions, "bye")) == {"0"}
    assert registry.connection_ended("c0", "worker shut down") == []  # no loss
    with pytest.raises(ProtocolError, match="already shut down"):
        register(registry, "c9", "0")


def test_a_neighbour_that_shut_down_for_good_hears_of_no_loss_or_recovery() -> None:
    """peer_lost and peer_recovered go to the neighbours that still run or still serve
    (held), not to one that finished for good, even while its connection is open."""
    registry, _ = job(3)  # rank 1's neighbours: 0 and 2
    registry.shutdown("c0", hold=False)
    registry.shutdown("c2", hold=True)
    assert registry.task_of("c0") is not None and registry.tasks["0"].finished
    lost = registry.connection_ended("c1", f"{SILENCE_REASON} 30s")
    assert set(sends(lost, "peer_lost")) == {"2"}
    recovered = register(registry, "c9", "1", port=9100, attempt=1)
    assert set(sends(recovered, "peer_recovered")) == {"2"}


def test_a_worker_that_shut_down_for_good_cannot_rejoin_but_a_held_one_can() -> None:
    registry, _ = job(3)
    registry.shutdown("c0", hold=False)
    with pytest.raises(ProtocolError, match="already shut down"):
        registry.rejoin("c7", rejoin_msg("0", rank=0), host="h", peer="c7:1", now=1.0)
    assert registry.connection_ended("c0", "connection reset") == []
    with pytest.raises(ProtocolError, match="already shut down"):
        registry.rejoin("c7", rejoin_msg("0", rank=0), host="h", peer="c7:1", now=1.0)
    assert registry.task_of("c7") is None
    # a held worker whose connection ended still serves its neighbours: it may rejoin
    registry.shutdown("c1", hold=True)
    (grace,) = registry.connection_ended("c1", "connection reset")
    assert isinstance(grace, Grace)
    decisions = registry.rejoin("c8", rejoin_msg("1", rank=1), host="h", peer="c8:1", now=2.0)
    assert sends(decisions, "rejoined")["1"].conn == "c8"
    assert registry.tasks["1"].held


def test_a_held_worker_that_dies_is_lost() -> None:
    registry, _ = job(2)
    registry.shutdown("c0", hold=True)
    decisions = registry.connection_ended("c0", f"{SILENCE_REASON} 30s")
    assert hooks(decisions, "on_worker_lost")
    assert not registry.tasks["0"].finished and not registry.tasks["0"].held


def test_status_lists_one_task_and_counts_all() -> None:
    registry, _ = job(3)
    status = registry.status("1", port=1234, prints=7)
    assert (status["port"], status["prints"], status["registered"]) == (1234, 7, 3)
    assert [task["task_id"] for task in status["tasks"]] == ["1"]
    assert status["tasks"][0] == {"task_id": "1", "rank": 1, "incarnation": 0, "attempt": 0,
                                  "host": "10.0.0.1", "port": 9001, "connected": True,
                                  "finished": False, "losses": 0, "progress": None,
                                  "heartbeat_age": None}


def test_status_shows_progress_heartbeat_age_and_who_is_recovering() -> None:
    registry, _ = job(3)
    registry.heard("c1", 4.0)
    registry.heartbeat("c1", {"version": 3, "calls": 12, "replaying": False})
    registry.heartbeat("c2", {"version": 2, "calls": 5, "replaying": True})
    status = registry.status(now=5.5)
    rows = {task["task_id"]: task for task in status["tasks"]}
    assert rows["1"]["progress"] == {"version": 3, "calls": 12, "replaying": False}
    assert rows["1"]["heartbeat_age"] == 1.5
    assert rows["0"]["progress"] is None
    # rank 2 replays; rank 0's worker is gone and not back
    registry.connection_ended("c0", f"{SILENCE_REASON} 30s")
    status = registry.status(now=6.0)
    assert status["recovering"] == [0, 2]
    assert status["connected"] == 2
    assert {t["task_id"]: t["heartbeat_age"] for t in status["tasks"]}["0"] is None
    # a restarted process reports afresh: what the lost one said is gone
    register(registry, "c3", "0", now=7.0, attempt=1)
    restarted = registry.status("0", now=7.0)["tasks"][0]
    assert restarted["progress"] is None and restarted["incarnation"] == 1
