"""Elastic mode's live sets on the tracker (tracker/elastic.py through the registry): the
barrier, shrink and grow, one outcome for every member.  Pure: connections are strings."""

from __future__ import annotations

from typing import Any

import pytest

from rabit2.errors import ProtocolError
from tracker.decisions import Decision, EndSet, FormSet, Send
from tracker.registry import SILENCE_REASON, Registry

Decisions = list[Decision[str]]


def elastic_job(n: int, **kwargs: Any) -> Registry[str]:
    registry: Registry[str] = Registry(n, elastic=True, **kwargs)
    for i in range(n):
        registry.register(f"c{i}", {"task_id": str(i), "attempt": 0, "port": 9000 + i,
                                    "world_size": -1}, host="h", peer="p", now=0.0)
    return registry


def ask(registry: Registry[str], *conns: str) -> Decisions:
    out: Decisions = []
    for conn in conns:
        out += registry.live_ask(conn, {"t": "live", "epoch": 0})
    return out


def done(registry: Registry[str], conn: str, epoch: int, ok: bool = True,
         reason: str = "") -> Decisions:
    return registry.live_done(conn, {"t": "live_done", "epoch": epoch, "ok": ok,
                                     "reason": reason})


def formed(decisions: Decisions) -> FormSet[str]:
    (form,) = [d for d in decisions if isinstance(d, FormSet)]
    return form


def results(decisions: Decisions) -> dict[str, dict[str, Any]]:
    return {d.conn: d.msg for d in decisions
            if isinstance(d, Send) and d.msg["t"] == "live_result"}


def test_a_set_forms_once_every_live_worker_asked() -> None:
    registry = elastic_job(3)
    assert ask(registry, "c0", "c2") == []
    form = formed(ask(registry, "c1"))
    assert (form.epoch, form.ranks, form.new, form.reuse) == (1, (0, 1, 2), (0, 1, 2), False)
    assert [conn for _, conn in form.members] == ["c0", "c1", "c2"]


def test_every_member_gets_the_same_outcome_and_a_good_set_is_reused() -> None:
    registry = elastic_job(2)
    formed(ask(registry, "c0", "c1"))
    assert done(registry, "c0", 1) == []  # (waits for the other member)
    out = results(done(registry, "c1", 1))
    assert out["c0"] == out["c1"] == {"t": "live_result", "epoch": 1, "ok": True,
                                       "reason": ""}
    again = formed(ask(registry, "c0", "c1"))
    assert (again.epoch, again.new, again.reuse) == (2, (), True)


def test_a_member_lost_in_the_block_fails_it_for_everyone_and_leaves_the_next_set() -> None:
    registry = elastic_job(3)
    formed(ask(registry, "c0", "c1", "c2"))
    assert done(registry, "c0", 1) == []
    lost = registry.connection_ended("c1", "connection closed by the worker")
    assert any(isinstance(d, EndSet) for d in lost)  # the set's collectives are released
    failed = results(lost)["c0"]
    assert not failed["ok"] and "rank 1 lost its tracker connection" in failed["reason"]
    assert results(done(registry, "c2", 1, ok=False, reason="PeerLostError: x"))["c2"] == failed
    nxt = formed(ask(registry, "c0", "c2"))  # rank 1 is no longer waited for
    # (no set succeeded yet, so nobody holds a state the others lack: all are new)
    assert (nxt.ranks, nxt.new, nxt.reuse) == ((0, 2), (0, 2), False)


def test_a_worker_lost_while_asking_is_not_waited_for() -> None:
    registry = elastic_job(3)
    assert ask(registry, "c0", "c2") == []
    form = formed(registry.connection_ended("c1", f"{SILENCE_REASON} 30s"))
    assert form.ranks == (0, 2)


def job_whose_rank_1_was_replaced() -> Registry[str]:
    """Two workers had a good set; rank 1's process was lost and a new one registered."""
    registry = elastic_job(2)
    formed(ask(registry, "c0", "c1"))
    results(done(registry, "c0", 1) + done(registry, "c1", 1))
    registry.connection_ended("c1", f"{SILENCE_REASON} 30s")
    registry.register("c9", {"task_id": "1", "attempt": 1, "port": 9009, "world_size": -1},
                      host="h", peer="p", now=1.0)
    return registry


def test_a_restarted_worker_is_waited_for_and_named_new() -> None:
    registry = job_whose_rank_1_was_replaced()
    assert ask(registry, "c0") == []  # the new process must ask too
    form = formed(ask(registry, "c9"))
    assert (form.ranks, form.new, form.reuse) == ((0, 1), (1,), False)


def test_a_member_that_raised_fails_the_set_at_once() -> None:
    registry = elastic_job(2)
    formed(ask(registry, "c0", "c1"))
    out = results(done(registry, "c1", 1, ok=False, reason="ValueError: bad"))
    assert out["c1"]["reason"] == "job rank 1 failed in it: ValueError: bad"
    assert results(done(registry, "c0", 1))["c0"] == out["c1"]  # ok or not: the same


def test_min_workers_bounds_how_far_the_job_shrinks() -> None:
    registry = elastic_job(3, min_workers=2)
    registry.connection_ended("c1", f"{SILENCE_REASON} 30s")
    registry.mark_failed("1", "out of attempts")
    assert registry.outcome is None and registry.tasks["1"].left  # two remain: it goes on
    registry.connection_ended("c2", f"{SILENCE_REASON} 30s")
    registry.mark_failed("2", "out of attempts")
    assert registry.outcome is not None and not registry.outcome.success


def test_live_messages_need_an_elastic_job() -> None:
    registry: Registry[str] = Registry(1)
    registry.register("c0", {"task_id": "0", "attempt": 0, "port": 9000, "world_size": -1},
                      host="h", peer="p", now=0.0)
    with pytest.raises(ProtocolError, match="elastic"):
        ask(registry, "c0")


def test_newcomers_alone_after_the_others_finished_have_nothing_to_join() -> None:
    registry = job_whose_rank_1_was_replaced()
    registry.shutdown("c0", hold=False)  # rank 0 finished the job meanwhile
    (told,) = [d for d in ask(registry, "c9") if isinstance(d, Send)]
    assert told.msg["ranks"] == [] and "finished" in told.msg["reason"]


def test_a_newcomer_whose_first_set_failed_is_still_new_in_the_next() -> None:
    registry = job_whose_rank_1_was_replaced()
    first = formed(ask(registry, "c0", "c9"))
    assert first.new == (1,)
    results(done(registry, "c0", 1 + 1, ok=False, reason="PeerLostError: x"))
    again = formed(ask(registry, "c0", "c9"))
    assert again.new == (1,)  # it never got the state: it must be handed it again


def test_a_restart_that_registers_again_ends_its_predecessor_s_part_in_the_set() -> None:
    registry = elastic_job(2)
    formed(ask(registry, "c0", "c1"))
    assert done(registry, "c0", 1) == []
    # rank 1's host vanished (its connection is still open here) and its restart registers
    out = registry.register("c9", {"task_id": "1", "attempt": 1, "port": 9009,
                                   "world_size": -1}, host="h", peer="p", now=1.0)
    failed = results(out)["c0"]
    assert not failed["ok"] and "rank 1 was replaced by a new process" in failed["reason"]


def test_a_blink_fails_the_set_and_the_worker_asks_again_for_the_next() -> None:
    registry = elastic_job(2)
    formed(ask(registry, "c0", "c1"))
    # rank 1's connection blinked before it reported: the set fails (it may have missed
    # the set itself); it rejoins and asks again, and reports again what it waited for
    registry.connection_ended("c1", "connection reset by peer")
    registry.rejoin("c5", {"task_id": "1", "rank": 1, "incarnation": 0, "port": 9001},
                    host="h", peer="p", now=0.5)
    out = results(done(registry, "c0", 1)) | results(done(registry, "c5", 1))
    assert out["c0"] == out["c5"] and not out["c0"]["ok"]
    assert "rank 1 lost its tracker connection" in out["c0"]["reason"]
    nxt = formed(registry.live_ask("c5", {"t": "live", "epoch": 0})
                 + registry.live_ask("c0", {"t": "live", "epoch": 1}))
    assert nxt.members == (("0", "c0"), ("1", "c5"))  # (its current connection)


def test_a_late_report_of_an_older_set_gets_that_set_s_outcome() -> None:
    registry = elastic_job(2)
    formed(ask(registry, "c0", "c1"))
    results(done(registry, "c0", 1) + done(registry, "c1", 1))
    formed(ask(registry, "c0", "c1"))
    late = results(done(registry, "c1", 1))["c1"]  # (sent again after a blink)
    assert late == {"t": "live_result", "epoch": 1, "ok": True, "reason": ""}


def _left(decisions: Decisions) -> dict[str, dict[str, Any]]:
    return {d.conn: d.msg for d in decisions
            if isinstance(d, Send) and d.msg["t"] == "live_left"}


def test_members_still_in_a_block_hear_the_fewest_calls_a_member_left_it_after() -> None:
    """One message per member still in the block when the count goes down: none when the
    next member left after as many calls (the normal case), so a set costs O(N)."""
    registry = elastic_job(4)
    formed(ask(registry, "c0", "c1", "c2", "c3"))

    def leave(conn: str, calls: int) -> Decisions:
        return registry.live_done(conn, {"t": "live_done", "epoch": 1, "ok": True,
                                         "reason": "", "calls": calls})

    told = _left(leave("c0", 3))
    assert sorted(told) == ["c1", "c2", "c3"]
    assert told["c1"] == {"t": "live_left", "epoch": 1, "rank": 0, "calls": 3}
    assert _left(leave("c1", 3)) == {}  # (the same count: nothing new)
    # fewer calls than another made: the set fails on every member
    out = results(leave("c2", 2))
    assert {msg["ok"] for msg in out.values()} == {False}
    assert ("different numbers of collective calls in the block (job rank 0 3, job rank 1 3, "
            "job rank 2 2)") in out["c2"]["reason"]


def test_a_bad_call_count_is_refused() -> None:
    registry = elastic_job(2)
    formed(ask(registry, "c0", "c1"))
    with pytest.raises(ProtocolError, match="calls"):
        registry.live_done("c0", {"t": "live_done", "epoch": 1, "ok": True, "reason": "",
                                  "calls": -1})
