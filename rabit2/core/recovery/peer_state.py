"""What neighbours tell each other about themselves when a link comes up, and how a
restarted rank decides what to do with each call of its replay (``docs/recovery.md``).

When a link comes up after a failure, both sides send a ``state`` (which call they are in,
how much of this peer's stream of that call they hold, which checkpoint versions and results
they keep).  A restarted rank then replays its program: a call that some neighbour already
finished is *fetched* (its result copied from that neighbour), a call that a neighbour is
still blocked in is *resumed* (each side says with a ``need`` from which offset it wants the
other's stream, and nothing that already arrived is sent again), any later call runs as
usual.

Nothing here touches a socket or a clock.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from rabit2.core.framing import CallDescriptor, CollectiveKind
from rabit2.core.recovery.store import GENERATIONS, CallId
from rabit2.errors import ProtocolError


@dataclasses.dataclass(frozen=True, slots=True)
class PeerState:
    """What a neighbour said about itself when the link came up."""

    incarnation: int
    at: CallId  # the call it is in (``active``) or the next call it will make
    active: bool
    need: int  # bytes of our stream of that call it holds; -1: it takes no stream from us
    seen: bool  # it has seen at least one frame from us in that call
    recovering: bool  # it is itself a restarted rank replaying its program
    versions: tuple[int, ...]  # checkpoint versions it can serve
    oldest: CallId  # every finished call from here up to ``at`` is retained there
    locals: tuple[int, ...] = ()  # versions of the receiver's local model it holds
    boot: int = 0  # calls (0, 0) to (0, boot - 1), made before load_checkpoint, kept for good

    def retains(self, call: CallId) -> bool:
        """Whether the neighbour keeps the result of ``call``, which it finished."""
        return self.oldest <= call or (call[0] == 0 and call[1] < self.boot)

    def to_msg(self) -> dict[str, Any]:
        return {"t": "state", "inc": self.incarnation, "at": list(self.at),
                "active": self.active, "need": self.need, "seen": self.seen,
                "recovering": self.recovering, "versions": list(self.versions),
                "oldest": list(self.oldest), "locals": list(self.locals), "boot": self.boot}

    @classmethod
    def from_msg(cls, msg: dict[str, Any]) -> PeerState:
        """Validate a decoded ``state`` body.  Raises :class:`ProtocolError`."""
        versions, locals_ = msg["versions"], msg.get("locals", [])
        for name, value in (("versions", versions), ("locals", locals_)):
            if (not isinstance(value, list) or len(value) > GENERATIONS + 1
                    or not all(_is_u32(v) for v in value)):
                raise ProtocolError(f"state.{name} {value!r} is not a short list of versions")
        boot = msg.get("boot", 0)
        if not _is_u32(msg["inc"]) or msg["need"] < -1 or not _is_u32(boot):
            raise ProtocolError("state: bad incarnation, need or boot")
        return cls(msg["inc"], call_id(msg["at"], "state.at"), msg["active"], msg["need"],
                   msg["seen"], msg["recovering"], tuple(versions),
                   call_id(msg["oldest"], "state.oldest"), tuple(locals_), boot)


def _is_u32(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 32


def call_id(value: object, what: str) -> CallId:
    """A ``[version, seqno]`` pair from the wire.  Raises :class:`ProtocolError`."""
    if (not isinstance(value, list) or len(value) != 2
            or not all(_is_u32(v) for v in value)):
        raise ProtocolError(f"{what} {value!r} is not a [version, seqno] pair")
    return (value[0], value[1])


def descriptor_to_wire(desc: CallDescriptor) -> list[int]:
    return [int(desc.kind), desc.dtype_code, desc.op_code, desc.root, desc.total_bytes]


def descriptor_from_wire(value: object) -> CallDescriptor:
    """Raises :class:`ProtocolError` for anything but five small ints naming a known kind."""
    if (not isinstance(value, list) or len(value) != 5
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 64
                       for v in value)):
        raise ProtocolError(f"reply.desc {value!r} is not a call descriptor")
    try:
        kind = CollectiveKind(value[0])
    except ValueError:
        raise ProtocolError(f"reply.desc names collective kind {value[0]}") from None
    return CallDescriptor(kind, value[1], value[2], value[3], value[4])


class Role(enum.Enum):
    """How a restarted rank treats a neighbour for one call of its replay."""

    FINISHED = "finished"  # the neighbour completed the call: it can serve the result
    LIVE = "live"  # the neighbour is blocked in the call: resume it at the offsets
    FRESH = "fresh"  # the neighbour has not started the call: it runs as usual


def role_of(state: PeerState, call: CallId) -> Role:
    """How a restarted rank treats a (live, not itself restarted) neighbour for ``call``."""
    if call < state.at:
        return Role.FINISHED
    if call == state.at and state.active:
        return Role.LIVE
    return Role.FRESH


def checkpoint_version(states: dict[int, PeerState]) -> int:
    """The version a restarted rank resumes at: the oldest one a neighbour is still in.

    A neighbour that checkpointed after the failure may be one version ahead; the slower
    ones may still need this rank's bytes of a call in the older version, so the older
    version wins (every rank keeps :data:`GENERATIONS` of them)."""
    live = [s.at[0] for s in states.values() if not s.recovering]
    return min(live) if live else 0
