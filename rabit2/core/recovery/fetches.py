"""What a rank asks a neighbour for with ``fetch`` (a result, a checkpoint, a local model, a
range of a neighbour's stream), the answers it serves, and where each answer lands
(``docs/recovery.md``, "Wire additions", "A survivor").

A ``reply`` announces the BLOB frame that follows it; the link lands the blob where the
fetch says (``Link.blob``) and hands it back here whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rabit2.core.framing import MAX_BROADCAST, CallDescriptor, CollectiveKind
from rabit2.core.fsm import LinkEvent, PhaseEvent
from rabit2.core.records import NO_CALL, ActiveCall, CheckpointLoaded, Command, Fetch, Link
from rabit2.core.recovery.peer_state import (
    Role,
    call_id,
    descriptor_from_wire,
    descriptor_to_wire,
    role_of,
)
from rabit2.core.recovery.port import AgentPort, send_blob
from rabit2.core.recovery.store import CallId
from rabit2.core.schedule import RingAllreduce, TreeBroadcast
from rabit2.errors import MismatchError, ProtocolError, UnrecoverableError

if TYPE_CHECKING:
    from rabit2.core.recovery.component import Recovery


class Fetches:
    """The requests this rank has out, and its answers to its neighbours' requests."""

    def __init__(self, agent: AgentPort, owner: Recovery) -> None:
        self.agent = agent
        self.owner = owner
        self.requests: dict[int, Fetch] = {}
        self._next_request = 1
        # a restarted rank's checkpoint and local model, as they arrive
        self.loading: dict[str, Any] = {}

    def of_peer(self, peer: int) -> list[Fetch]:
        return [f for f in self.requests.values() if f.peer == peer]

    # ------------------------------------------------------------------ asking

    def request(self, peer: int, what: str, call: CallId, lo: int, hi: int,
                dest: memoryview | None, cmds: list[Command],
                active: ActiveCall | None = None, tried: frozenset[int] = frozenset()) -> None:
        request = self._next_request
        self._next_request += 1
        fetch = Fetch(request, peer, what, call, lo == 0 and hi < 0, dest, lo=lo, hi=hi)
        fetch.tried = tried
        self.requests[request] = fetch
        if active is not None:
            active.fetching += 1
        self.agent.send_control(peer, {"t": "fetch", "id": request, "what": what,
                                       "call": list(call), "lo": lo, "hi": hi}, cmds)

    def reissue(self, peer: int, cmds: list[Command]) -> None:
        """The link to ``peer`` was reset (the same process is back): what this rank had
        asked it for may be lost with the old connection.  Ask again on the new one (the
        answers land where the old ones would have; an unasked result cut off by the reset
        was dropped at the hang-up)."""
        active = self.agent.active
        for fetch in self.of_peer(peer):
            self.requests.pop(fetch.request, None)
            mine = fetch.of_call and active is not None and active.call_id == fetch.call
            if fetch.of_call and not mine:
                continue  # (a call that is over: nothing waits for it)
            if mine:
                assert active is not None
                active.fetching -= 1
            self.request(peer, fetch.what, fetch.call, fetch.lo, fetch.hi, fetch.dest, cmds,
                         active if mine else None)

    def refetch(self, fetch: Fetch, cmds: list[Command], why: str = "",
                park: bool = False) -> None:
        """The neighbour a fetch went to was lost (or no longer holds what was asked, ``why``:
        its state was older than its store): ask another one that holds the same.  With
        ``park`` (its link just went down, perhaps only reset), a fetch no other neighbour
        can serve waits for that link instead: the same process asks again when it is
        back (:meth:`reissue`), a replacement makes it fail."""
        del self.requests[fetch.request]
        agent = self.agent
        active = agent.active
        if active is not None and active.call_id == fetch.call and fetch.of_call:
            active.fetching -= 1
        tried = fetch.tried | {fetch.peer}
        for peer, st in self.owner.replay.peer_states.items():
            if peer in tried or not agent.links[peer].up:
                continue
            if fetch.what == "checkpoint" and fetch.call[0] in st.versions:
                self.request(peer, "checkpoint", fetch.call, 0, -1, None, cmds, tried=tried)
                return
            if fetch.what == "local" and fetch.call[0] in st.locals:
                self.request(peer, "local", fetch.call, 0, -1, None, cmds, tried=tried)
                return
            if (fetch.what == "result" and fetch.whole and active is not None
                    and role_of(st, fetch.call) is Role.FINISHED and st.retains(fetch.call)):
                self.request(peer, "result", fetch.call, 0, -1, fetch.dest, cmds, active,
                             tried=tried)
                return
        if park:
            self.requests[fetch.request] = fetch
            if active is not None and active.call_id == fetch.call and fetch.of_call:
                active.fetching += 1
            return
        raise UnrecoverableError(
            f"rank {agent.rank} cannot fetch {fetch.what} {fetch.call}: "
            f"{why or f'rank {fetch.peer} was lost while serving it'}, and no other neighbour "
            "holds it")

    def lost(self, peer: int, cmds: list[Command], *, park: bool) -> None:
        """The link to ``peer`` went down (``park``), or a new process replaced it: what was
        asked of it goes to another neighbour."""
        for fetch in self.of_peer(peer):
            self.refetch(fetch, cmds, park=park)

    # ------------------------------------------------------------------ serving

    def on_fetch(self, peer: int, msg: dict[str, Any], cmds: list[Command]) -> None:
        what, call = msg["what"], call_id(msg["call"], "fetch.call")
        request, lo, hi = msg["id"], msg["lo"], msg["hi"]
        owner, rank = self.owner, self.agent.rank
        data: memoryview | None = None
        desc = NO_CALL
        reason = ""
        if what == "checkpoint":
            data, reason = self._checkpoint(call[0])
        elif what == "local":
            local = owner.replicas.get(call[1], call[0])  # call = (version, owner)
            if local is None:
                reason = f"rank {rank} holds no local model of rank {call[1]} version {call[0]}"
            else:
                data = memoryview(local)
        elif what == "stream":
            # bytes of our stream of the current call to the asker, fetched again by a
            # restarted neighbour whose resume skipped them (see Needs.apply)
            active = self.agent.active
            plan = active.plan if active is not None else None
            stream = plan.out_streams.get(peer) if plan is not None else None
            if (active is None or plan is None or stream is None or active.call_id != call
                    or not 0 <= lo < hi <= plan.out_ready(peer)
                    or not plan.serves_from(peer, lo)):
                reason = (f"rank {rank} can no longer send bytes [{lo}, {hi}) of its "
                          f"stream of call {call}")
            else:
                desc, data = active.desc, memoryview(b"".join(stream.views(lo, hi)))
                lo, hi = 0, -1
        elif what == "result":
            active = self.agent.active
            if (active is not None and active.call_id == call
                    and active.call.kind is not CollectiveKind.BROADCAST):
                desc, data = active.desc, active.call.buf  # final bytes, by the asker's reckoning
            elif (got := owner.results.get(call)) is not None:
                desc, data = got
            else:
                reason = f"rank {rank} retains no result of call {call}"
        else:
            raise ProtocolError(f"rank {peer} fetches {what!r}")
        if data is not None:
            end = len(data) if hi < 0 else hi
            if not 0 <= lo <= end <= len(data):
                raise ProtocolError(f"rank {peer} fetches bytes [{lo}, {hi}) of {len(data)}")
            data = data[lo:end]
        self.reply(peer, request, call, desc, data, cmds, reason)

    def _checkpoint(self, version: int) -> tuple[memoryview | None, str]:
        """The checkpoint of ``version`` to serve, or why there is none."""
        rank = self.agent.rank
        try:
            blob = self.owner.checkpoint_blob(version)
        except Exception as exc:  # a lazy checkpoint's model that cannot be pickled
            return None, (f"rank {rank} cannot pickle its lazy checkpoint of version "
                          f"{version}: {type(exc).__name__}: {exc}")
        if blob is None:
            return None, f"rank {rank} holds no checkpoint of version {version}"
        return memoryview(blob), ""

    def reply(self, peer: int, request: int, call: CallId, desc: CallDescriptor,
              data: memoryview | None, cmds: list[Command], reason: str = "") -> None:
        size = 0 if data is None else len(data)
        self.agent.send_control(peer, {"t": "reply", "id": request, "call": list(call),
                                       "found": data is not None, "size": size,
                                       "desc": descriptor_to_wire(desc), "reason": reason},
                                cmds)
        if data is not None and size:
            send_blob(self.agent, peer, call, data, cmds, desc)

    # ------------------------------------------------------------------ answers

    def on_reply(self, peer: int, link: Link, msg: dict[str, Any],
                 cmds: list[Command]) -> None:
        call = call_id(msg["call"], "reply.call")
        size = msg["size"]
        if not 0 <= size <= MAX_BROADCAST:
            raise ProtocolError(f"rank {peer} replies with {size} B")
        request = msg["id"]
        agent = self.agent
        active = agent.active
        current = active.call_id if active is not None else (agent.version, agent.seqno)
        if request == 0 and not msg["found"]:
            # a neighbour that finished our call no longer holds its stream for us
            if active is not None and call == active.call_id and active.needs_input(peer):
                raise UnrecoverableError(f"rank {agent.rank} cannot finish call {call}: "
                                         f"{msg['reason']}")
            return
        if request == 0 and (call < current or (active is not None and active.has_result
                                                 and call == current)):
            # a result sent for a call we meanwhile finished (or already have): read, drop.
            # It stands in for that peer's stream, which will not come any more
            fetch = Fetch(0, peer, "discard", call, True, memoryview(bytearray(size)))
            if active is not None and call == current:
                active.skip_in.add(peer)
        elif request == 0:
            # our need reached a rank that had finished the call: it sent the result
            if active is None or active.call_id != call:
                raise ProtocolError(f"rank {peer} sent an unasked result of call {call}")
            # it lands in a buffer of its own and is copied into the caller's array once
            # whole: if the sender dies (or the link resets) half way, the call goes back
            # to waiting for that peer's stream with its own state untouched
            if (active.call.kind is not CollectiveKind.BROADCAST
                    and size != len(active.call.buf)):
                raise MismatchError(f"sequence mismatch: rank {peer} holds {size} B of call "
                                    f"{call}, rank {agent.rank} has {len(active.call.buf)} B")
            fetch = Fetch(0, peer, "result", call, True, None)
            fetch.replaced = peer not in active.skip_in
            active.has_result = True
            active.skip_in.add(peer)
            active.fetching += 1
        else:
            found = self.requests.get(request)
            if found is None or found.peer != peer or found.call != call:
                raise ProtocolError(f"rank {peer} replies to request {request} nobody made")
            fetch = found
        if not msg["found"]:
            if request and fetch.whole and fetch.what in ("result", "checkpoint", "local"):
                # its store moved on since its state: another neighbour may still hold it
                self.refetch(fetch, cmds, msg["reason"])
                return
            raise UnrecoverableError(f"rank {agent.rank} cannot recover: {msg['reason']}")
        if fetch.what == "result":
            desc = descriptor_from_wire(msg["desc"])
            if active is None or active.call_id != call or not desc.agrees_with(active.desc):
                mine = "no call" if active is None else active.desc.describe()
                raise MismatchError(
                    f"sequence mismatch: restarted rank {agent.rank} replays call {call} as "
                    f"{mine}, but rank {peer} made it as {desc.describe()}")
        dest = fetch.dest
        if dest is None:
            dest = memoryview(bytearray(size))
        elif len(dest) != size:
            raise MismatchError(f"sequence mismatch: rank {peer} holds {size} B of call "
                                f"{call}, restarted rank {agent.rank} asked for {len(dest)} B")
        fetch.dest = dest
        self.expect_blob(link, fetch, cmds)

    def expect_blob(self, link: Link, fetch: Fetch, cmds: list[Command]) -> None:
        """The next frame on ``link`` is the BLOB that ``fetch`` waits for (none, for 0 B)."""
        assert fetch.dest is not None
        link.blob, link.blob_fetch = fetch.dest, fetch
        if not len(fetch.dest):
            self.blob_done(link, cmds)

    def blob_done(self, link: Link, cmds: list[Command]) -> None:
        """The BLOB frame a fetch waited for landed whole."""
        fetch = link.blob_fetch
        assert fetch is not None and fetch.dest is not None
        link.blob_fetch = None
        link.go(LinkEvent.FRAME_DONE)
        link.filled, link.remaining = 0, 0
        self.requests.pop(fetch.request, None)
        owner = self.owner
        if fetch.what == "discard":
            return
        if fetch.what == "replica":
            owner.replicas.stored(fetch, cmds)
            return
        owner.stats["fetched_bytes"] += len(fetch.dest)
        if fetch.what in ("checkpoint", "local"):
            blob = bytes(fetch.dest)
            if fetch.what == "checkpoint":
                owner.checkpoints[fetch.call[0]] = blob
            else:
                owner.replicas.keep(self.agent.rank, fetch.call[0], blob)
            loading = self.loading
            loading[fetch.what] = blob
            loading["pending"] -= 1
            if not loading["pending"]:
                cmds.append(CheckpointLoaded(loading["version"], loading["checkpoint"],
                                             loading["local"]))
            return
        active = self.agent.active
        if active is None or active.call_id != fetch.call:
            return
        if fetch.what == "stream":
            self._refilled(active, fetch, cmds)
            return
        if active.call.kind is CollectiveKind.BROADCAST:
            self._land_broadcast(active, fetch.dest)
        elif fetch.request == 0:
            active.call.buf[:] = fetch.dest  # an unasked result, whole now
        active.fetching -= 1

    def _refilled(self, active: ActiveCall, fetch: Fetch, cmds: list[Command]) -> None:
        """The skipped in-stream bytes are back: reduce them in, then serve the need that
        asked for what they make."""
        plan = active.plan
        assert isinstance(plan, RingAllreduce) and fetch.dest is not None
        plan.refill(fetch.lo, fetch.dest)
        active.fetching -= 1
        assert active.refill is not None
        peer, offset, seen = active.refill
        active.refill = None
        link = self.agent.links[peer]
        if link.up and link.awaiting_need:
            link.phase_go(PhaseEvent.RELEASE)
            self.owner.needs.apply(active, peer, offset, seen=seen)

    def drop_stand_in(self, link: Link, peer: int) -> None:
        """The link that was bringing an unasked result of the current call went down half
        way: the call waits for that peer's stream again."""
        fetch, active = link.blob_fetch, self.agent.active
        if (fetch is None or fetch.request != 0 or fetch.what != "result" or active is None
                or active.call_id != fetch.call):
            return
        link.blob_fetch = None
        active.fetching -= 1
        active.has_result = False
        if fetch.replaced:
            active.skip_in.discard(peer)

    def _land_broadcast(self, active: ActiveCall, data: memoryview) -> None:
        """A fetched broadcast result: the stream as the in-link would have delivered it."""
        plan = active.plan
        assert isinstance(plan, TreeBroadcast)
        if plan.in_link < 0:
            return  # the root replays its own data
        if not plan.sized:
            self.agent.size_to(plan, len(data), active)
        if plan.length != len(data):
            raise MismatchError(f"sequence mismatch: the broadcast of call {active.call_id} "
                                f"has {len(data)} B, this rank expected {plan.length} B")
        pos = 0
        while pos < len(data):
            # the plan lays out the payload once the head is in: look the stream up again
            dest = plan.in_streams[plan.in_link].view(pos, len(data) - pos)
            if not dest:
                raise ProtocolError(f"the broadcast of call {active.call_id} has no place "
                                    f"for byte {pos} of its {len(data)} B result")
            dest[:] = data[pos : pos + len(dest)]
            pos += len(dest)
            self.agent.received(plan, plan.in_link, pos)

