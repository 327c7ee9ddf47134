"""A restarted rank's replay (``docs/recovery.md``, "A restarted rank"): it loads its
checkpoint from its neighbours, then runs its program again; each call that a live
neighbour finished is fetched, the call the live neighbours are blocked in is resumed at the
offsets, and every later call runs as usual.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rabit2.core.framing import CollectiveKind
from rabit2.core.records import ActiveCall, CheckpointLoaded, Command
from rabit2.core.recovery.peer_state import PeerState, Role, checkpoint_version, role_of
from rabit2.core.recovery.port import AgentPort
from rabit2.core.recovery.store import CallId
from rabit2.core.schedule import TreeBroadcast
from rabit2.errors import UnrecoverableError

if TYPE_CHECKING:
    from rabit2.core.recovery.component import Recovery


class Replay:
    """What a restarted rank knows of its neighbours, and how it replays each call."""

    def __init__(self, agent: AgentPort, owner: Recovery) -> None:
        self.agent = agent
        self.owner = owner
        self.restarted = False  # this rank replaces a lost one and has not caught up yet
        # what each neighbour said when its link came up (a new dict when the replay ends:
        # the API thread may be reading the old one)
        self.peer_states: dict[int, PeerState] = {}
        # a rank that chose its checkpoint version with every neighbour restarted too (no
        # live one to learn it from): those neighbours, for the error it may lead to
        self.no_live_at_load: tuple[int, ...] = ()
        # their incarnations then: a later state of the same process can show it was wrong
        self.no_live_incs: dict[int, int] = {}

    def replaying(self) -> bool:
        """A restarted rank before the call its neighbours are in.  Once it is in that call
        (resumed at the offsets), or past it between two calls, it answers a neighbour like
        a survivor: a neighbour still blocked in that call waits for this rank's word on it
        (a result, or ``need -1``), which a rank that says it replays would never give."""
        if not self.restarted:
            return False
        active = self.agent.active
        if active is not None:
            return active.call_id < self.live_frontier()
        return (self.agent.version, self.agent.seqno) <= self.live_frontier()

    def live_frontier(self) -> CallId:
        """The furthest call a surviving neighbour has reached: replay runs up to it."""
        ats = [st.at for st in self.peer_states.values() if not st.recovering]
        return max(ats) if ats else (0, 0)

    def replays_next(self) -> bool:
        """True if the next call's result will be fetched from a neighbour."""
        nxt = (self.agent.version, self.agent.seqno)
        states = list(self.peer_states.values())
        return self.restarted and any(role_of(st, nxt) is Role.FINISHED for st in states)

    def version_zero_cause(self, found: str = "") -> str:
        """Why a rank that took checkpoint version 0 for want of a live neighbour fails;
        ``found``: what showed that version to be wrong."""
        tail = "three or more neighbouring ranks lost together, docs/recovery.md"
        return (f"rank {self.agent.rank} took checkpoint version 0: every neighbour, rank(s) "
                f"{list(self.no_live_at_load)}, was restarted too, and none could say which "
                f"version the job is at; " + (f"{found} ({tail})" if found else tail))

    def version_zero_wrong(self, peer: int, version: int) -> str:
        return self.version_zero_cause(f"rank {peer} resumed from version {version}")

    # ------------------------------------------------------------------ each call

    def begin(self, active: ActiveCall, cmds: list[Command]) -> None:
        """A restarted rank starts a call: fetch it, resume it, or run it as usual."""
        call = active.call_id
        needs = self.owner.needs
        if call > self.live_frontier():
            self.restarted = False  # caught up: from here on this rank is a survivor
            self.peer_states = {}
            needs.from_all(active, cmds, caught_up=True)
            return
        roles, recovering, skipped = self._classify(call)
        plan = active.plan
        if skipped & set(plan.in_streams) and not any(r is Role.FINISHED for r in roles.values()):
            why = f" ({self.version_zero_cause()})" if self.no_live_at_load else ""
            raise UnrecoverableError(
                f"rank {self.agent.rank} replays call {call}, which needs input from rank(s) "
                f"{sorted(skipped & set(plan.in_streams))}, restarted too and resumed from a "
                f"later checkpoint, and no live neighbour finished it{why}")
        active.skip_in.update(skipped)
        finished = [p for p, role in roles.items() if role is Role.FINISHED]
        live = [p for p, role in roles.items() if role is Role.LIVE]
        if not finished and not live:
            needs.from_all(active, cmds)
            return
        stats = self.owner.stats
        if finished and isinstance(plan, TreeBroadcast) and roles.get(plan.in_link) is Role.FRESH:
            # a broadcast that reached the neighbours who finished it by another route:
            # this rank's in-link has not begun it, and will send the whole stream when it
            # does.  Fetching the result as well would end the call under that stream
            stats["resumed_calls"] += 1
            out = {p: -1 for p in live}  # (downstream: their announce frames are not needed)
            active.skip_in.update(p for p, role in roles.items() if role is not Role.FRESH)
            active.skip_in.update(recovering)
            for p in finished:
                needs.apply(active, p, -1)
        elif finished:
            stats["replayed_calls"] += 1
            self._fetch_result(active, finished, cmds)
            out = {p: -1 for p in live}  # their streams of this call are not needed now
            active.skip_in.update(p for p, role in roles.items() if role is not Role.FRESH)
            active.skip_in.update(recovering)
            for q, role in roles.items():
                # a neighbour that finished needs nothing; one that has not started needs
                # the whole stream, which must then be made of result bytes
                if role is not Role.LIVE:
                    needs.apply(active, q, -1 if role is Role.FINISHED else 0)
        else:
            stats["resumed_calls"] += 1
            # a neighbour restarted too whose need decides where our in-streams restart
            # (ring: the previous rank; tree: the parent) is waited for: it computes that
            # need from its own live neighbours first
            links = self.agent.links
            wait = {q: link.pending_needs.get(call) for q in plan.resume_needs()
                    if q in recovering and (link := links[q]).up
                    and link.peer_state is not None and link.peer_state.recovering}
            # (one that has caught up since is a survivor that sends no need: it holds
            # nothing of our stream of this call, which we have not begun until now)
            active.resume_wait = wait
            for q in wait:
                # what we need of its own stream does not depend on the resume (the parent
                # resends the result from 0; the ring's previous rank sends us nothing).
                # Said now: it may be behind, in a call we skipped, waiting to hear from us
                needs.send(q, call, 0 if q in plan.in_streams else -1, cmds)
            self._resume(active, cmds)
            return
        self._settle_live(active, live, out, cmds)

    def _settle_live(self, active: ActiveCall, live: list[int], needs: dict[int, int],
                     cmds: list[Command]) -> None:
        """Send our stream to each live neighbour from its need, tell it where we need its
        own (``needs``), and tell every other neighbour where ours of this call starts."""
        protocol = self.owner.needs
        for q in live:
            st = self.peer_states[q]
            protocol.apply(active, q, st.need, seen=st.seen)
            if q in active.plan.in_streams:
                protocol.send(q, active.call_id, needs[q], cmds)
        protocol.from_all(active, cmds)

    def _classify(self, call: CallId) -> tuple[dict[int, Role], set[int], set[int]]:
        """Each neighbour's role in ``call`` of the replay, and which are restarted too.  A
        neighbour restarted too is not a live neighbour: its state is a snapshot from before
        its replay got here; it says where it needs our stream with a "need" when it gets to
        the call (held for it till then).  Past the call, it is finished (it can serve the
        result) if it replayed it, or it *skipped* the call (it resumed from a later
        checkpoint): then it needs nothing of ours and sends nothing."""
        roles = {p: role_of(st, call) for p, st in self.peer_states.items()}
        recovering = {p for p, st in self.peer_states.items()
                      if st.recovering and roles[p] is not Role.FINISHED}
        skipped = {p for p, st in self.peer_states.items()
                   if st.recovering and roles[p] is Role.FINISHED and not st.retains(call)}
        for p in recovering | skipped:
            del roles[p]
        return roles, recovering, skipped

    def _resume(self, active: ActiveCall, cmds: list[Command]) -> None:
        """Resume the call the live neighbours are blocked in, once every awaited need of
        a neighbour restarted too is in."""
        wait = active.resume_wait
        if wait is not None and any(v is None for v in wait.values()):
            return
        active.resume_wait = None
        call, plan, rank, links = active.call_id, active.plan, self.agent.rank, self.agent.links
        roles, recovering, _ = self._classify(call)
        live = [p for p, role in roles.items() if role is Role.LIVE]
        out_needs = {q: max(0, self.peer_states[q].need) for q in live}
        for q in recovering:
            # its need if it already said it, else the lower bound: all of the stream.  A
            # neighbour that takes none of it (-1: it fetches the result, so the whole
            # result exists and nothing of ours is needed there) counts as holding it all
            told = (wait or {}).get(q)
            if told is None:
                told = links[q].pending_needs.get(call, 0)
            stream = plan.out_streams.get(q)
            out_needs[q] = stream.length if told < 0 and stream is not None else max(0, told)
        resume = plan.resume(out_needs)
        needs = {p: resume.in_from.get(p, -1) for p in live}
        for p, offset in resume.in_from.items():
            links[p].pos = offset
            stream = plan.in_streams[p]
            if offset and p not in live and p not in recovering:
                raise UnrecoverableError(
                    f"rank {rank} must resume call {call} at byte {offset} of rank "
                    f"{p}'s stream, but rank {p} has not started that call")
            if offset >= stream.length > 0:
                active.frames_seen[p] = 1  # nothing is left to come from there
        for peer, lo, hi in resume.fetch:
            if peer in recovering:
                raise UnrecoverableError(
                    f"rank {rank} must resume call {call} with result bytes "
                    f"[{lo}, {hi}) that only rank {peer} held, and it was restarted too "
                    "(two neighbours lost in the same call, docs/recovery.md)")
            self.owner.fetches.request(peer, "result", call, lo, hi, active.call.buf[lo:hi],
                                       cmds, active)
        for q in recovering:
            if q in plan.in_streams:
                self.owner.needs.send(q, call, resume.in_from.get(q, -1), cmds)
        self._settle_live(active, live, needs, cmds)

    def answer_wait(self, active: ActiveCall | None, peer: int, need: int,
                    cmds: list[Command]) -> None:
        """``peer``'s need (or what stands for it) for the call our resume waits on it for."""
        wait = active.resume_wait if active is not None else None
        if active is not None and wait is not None and wait.get(peer, 0) is None:
            wait[peer] = need
            self._resume(active, cmds)

    def _fetch_result(self, active: ActiveCall, finished: list[int], cmds: list[Command]) -> None:
        call = active.call_id
        sources = [p for p in finished
                   if self.agent.links[p].up and self.peer_states[p].retains(call)]
        if not sources:
            held = [v for st in self.peer_states.values() for v in st.versions]
            hint = ("raise rabit2_replay_mb, or checkpoint more often" if max(held, default=0)
                    <= call[0] else
                    f"its neighbours hold checkpoint {max(held)} and no longer the calls "
                    "made before it: the calls before a program's first load_checkpoint() "
                    "are kept for good only where it loads before it checkpoints, and up to "
                    "half of rabit2_replay_mb; otherwise call load_checkpoint() before the "
                    "first collective and go on from the version it returns")
            raise UnrecoverableError(
                f"rank {self.agent.rank} replays call {call}, but no live neighbour retains "
                f"its result any more ({hint})")
        active.has_result = True
        dest = None if active.call.kind is CollectiveKind.BROADCAST else active.call.buf
        self.owner.fetches.request(sources[0], "result", call, 0, -1, dest, cmds, active)

    # ------------------------------------------------------------------ the checkpoint

    def load_checkpoint(self, with_local: bool, cmds: list[Command]) -> None:
        """Ask the neighbours for the checkpoint this rank resumes from (and, with
        ``with_local``, for its own local model, which the ring's next rank holds); the
        answer comes as :class:`CheckpointLoaded`.  Raises :class:`UnrecoverableError` if no
        live neighbour holds what is needed."""
        agent, owner = self.agent, self.owner
        states, links, rank = self.peer_states, agent.links, agent.rank
        version = checkpoint_version(states) if self.restarted else agent.version
        if self.restarted and states and all(st.recovering for st in states.values()):
            self.no_live_at_load = tuple(sorted(states))
            self.no_live_incs = {p: st.incarnation for p, st in states.items()}
            ahead = {p: st.at[0] for p, st in states.items() if st.at[0] > 0}
            if ahead:
                # one of them has already resumed from a later checkpoint: version 0 would
                # replay calls it will never make (docs/recovery.md, "Limitations")
                peer = min(ahead)
                raise UnrecoverableError(self.version_zero_wrong(peer, ahead[peer]))
        wanted = version
        if with_local and version:
            # a rank that died between a call and its next checkpoint never handed on the
            # local model of the version its neighbours are in: resume one version earlier
            held = [v for p, st in states.items() if links[p].up
                    for v in st.locals if v <= version]
            version = max(held, default=0)
        # the calls this worker replayed before loading stay (docs/recovery.md, "What every
        # rank keeps"); at version 0 the program goes on after them
        owner.results.keep_bootstrap(agent.seqno if agent.version == 0 else 0)
        if version:
            agent.version, agent.seqno = version, 0
            owner.results.clear_before((version, 0))  # (what "state" says this rank retains)
        loading = owner.fetches.loading = {"version": version, "checkpoint": None,
                                           "local": None, "pending": 0}
        if version:
            # where this rank resumes: a neighbour restarted too may hold a call of an older
            # version back for it, which it will never make (its state said "at (0, 0)")
            for peer, link in links.items():
                if link.up:
                    agent.send_control(peer, owner.state_for(peer).to_msg(), cmds)
        if version == 0:
            cmds.append(CheckpointLoaded(0, None))
            return
        sources = [p for p, st in states.items() if version in st.versions and links[p].up]
        if not sources and version < wanted:
            restarted = sorted(p for p, st in states.items() if st.recovering)
            raise UnrecoverableError(
                f"rank {rank} cannot resume: its local model of version {wanted} is held "
                f"by no live neighbour (rank(s) {restarted} were restarted too), and none "
                f"holds checkpoint version {version} any more, the latest it has a local "
                "model of (two neighbours lost together, docs/recovery.md)")
        if not sources:
            raise UnrecoverableError(f"no live neighbour of rank {rank} holds "
                                     f"checkpoint version {version}")
        loading["pending"] = 2 if with_local else 1
        owner.fetches.request(sources[0], "checkpoint", (version, 0), 0, -1, None, cmds)
        if with_local:
            holders = [p for p, st in states.items() if version in st.locals and links[p].up]
            if not holders:
                raise UnrecoverableError(f"no live neighbour of rank {rank} holds its "
                                         f"local model of version {version}")
            owner.fetches.request(holders[0], "local", (version, rank), 0, -1, None, cmds)
