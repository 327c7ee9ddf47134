"""What the tracker's ``assign`` tells a worker (``docs/protocol.md``, "Tracker protocol"):
its rank, its tree and ring links and where its neighbours listen, checked field by field
before any of it is used."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rabit2.errors import ProtocolError


@dataclass(frozen=True, slots=True)
class Assignment:
    """What the tracker told this worker: its rank, its links and where its neighbours listen."""

    rank: int
    world_size: int
    parent: int
    children: tuple[int, ...]
    ring_prev: int
    ring_next: int
    peers: dict[int, tuple[str, int]]
    """(host, listen port) of every neighbour: tree parent/children and ring prev/next."""
    incarnation: int
    """0 on the first start of this rank; the tracker adds 1 per re-registration."""
    peer_incarnations: dict[int, int] = field(default_factory=dict)
    """The incarnation the tracker issued to each neighbour (empty from a tracker that does
    not say): a neighbour may present no newer one when it dials."""


def _bad(what: str) -> ProtocolError:
    return ProtocolError(f"assign: {what}")


def parse_assignment(msg: dict[str, Any]) -> Assignment:
    """Validate the contents of an ``assign`` frame.  Raises :class:`ProtocolError`."""
    world_size = msg["world_size"]
    if world_size < 1:
        raise _bad(f"world_size {world_size}")

    def rank_field(value: object, name: str, allow_none: bool = False) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _bad(f"{name} is not an int")
        if not (-1 if allow_none else 0) <= value < world_size:
            raise _bad(f"{name} {value} out of range for world size {world_size}")
        return value

    rank = rank_field(msg["rank"], "rank")
    children = tuple(rank_field(child, "child") for child in msg["children"])
    peers: dict[int, tuple[str, int]] = {}
    for key, address in msg["peers"].items():
        try:
            peer = rank_field(int(key), "peer rank")
        except ValueError:
            raise _bad(f"peer key {key!r} is not a rank") from None
        if (
            not isinstance(address, list)
            or len(address) != 2
            or not isinstance(address[0], str)
            or not isinstance(address[1], int)
            or isinstance(address[1], bool)
            or not 0 < address[1] < 65536
        ):
            raise _bad(f"peer {peer} address {address!r} is not [host, port]")
        peers[peer] = (address[0], address[1])
    if msg["incarnation"] < 0:
        raise _bad(f"incarnation {msg['incarnation']}")
    incarnations: dict[int, int] = {}
    raw = msg.get("incarnations", {})
    if not isinstance(raw, dict):
        raise _bad("incarnations is not a map")
    for key, value in raw.items():
        try:
            peer = rank_field(int(key), "peer rank")
        except ValueError:
            raise _bad(f"incarnations key {key!r} is not a rank") from None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise _bad(f"incarnation {value!r} of peer {peer}")
        incarnations[peer] = value
    return Assignment(
        rank=rank,
        world_size=world_size,
        parent=rank_field(msg["parent"], "parent", allow_none=True),
        children=children,
        ring_prev=rank_field(msg["ring_prev"], "ring_prev"),
        ring_next=rank_field(msg["ring_next"], "ring_next"),
        peers=peers,
        incarnation=msg["incarnation"],
        peer_incarnations=incarnations,
    )


__all__ = ["Assignment", "parse_assignment"]
