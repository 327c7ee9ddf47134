"""The send side of a rank's peer links: the DATA frames of the call in progress, as its
plan makes them ready, and the CONTROL and ERROR frames.

On a link that checks (``Link.checked``) DATA frames are at most ``CHECKED_FRAME`` bytes and
carry a CRC32C of their payload, so that the receiver can verify each before it uses a byte
of it (``docs/protocol.md``, "Checksums").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from rabit2.core.control import encode_body
from rabit2.core.framing import (
    CHECKED_FRAME,
    MAX_PAYLOAD,
    NONE_U8,
    NONE_U16,
    CallDescriptor,
    CollectiveKind,
    FrameKind,
    checksum,
    encode_error,
    pack_header,
)
from rabit2.core.fsm import Phase
from rabit2.core.records import NO_CALL, ActiveCall, Command, Link, Send


class Owner(Protocol):
    """What the send side reads of the agent that owns it."""

    links: dict[int, Link]
    version: int
    seqno: int
    incarnation: int


class Sender:
    """Every peer link's send side, for one agent (loop thread only)."""

    def __init__(self, agent: Owner) -> None:
        self.agent = agent
        self.bytes_sent = 0  # payload only
        self.frames_sent = 0

    def pump(self, active: ActiveCall, cmds: list[Command]) -> None:
        """Send every out-stream byte that has become ready."""
        if active.fetching or active.resume_wait is not None:
            return  # a restarted rank sends nothing until the result it resumes from is in
        plan = active.plan
        desc = active.desc
        version, seqno = active.call_id
        final = active.has_result
        volatile = plan.volatile_out
        links = self.agent.links
        for peer, stream in plan.out_streams.items():
            link = links[peer]
            if link.phase is not Phase.UP:  # down, or waiting for its state or need
                continue
            sent = active.sent.get(peer, 0)
            if sent == stream.length and sent:
                continue  # (the common case once a call's input went out)
            if stream.length == 0:
                if peer not in active.started_empty:
                    active.started_empty.add(peer)
                    header = pack_header(FrameKind.DATA, desc, version, seqno, 0, 0)
                    cmds.append(Send(peer, [header]))
                    self.frames_sent += 1
                continue
            ready = stream.length if final else plan.out_ready(peer)
            if link.checked:
                # frames the receiver can verify before it uses them: one piece of the
                # stream at most (a broadcast's head on its own) and CHECKED_FRAME bytes
                while ready > sent:
                    view = stream.view(sent, min(ready - sent, CHECKED_FRAME))
                    n = len(view)
                    header = pack_header(FrameKind.DATA, desc, version, seqno, sent, n, 0,
                                         checksum(view))
                    cmds.append(Send(peer, [header, view], volatile))
                    self.bytes_sent += n
                    self.frames_sent += 1
                    sent += n
            while ready > sent:
                end = min(ready, sent + MAX_PAYLOAD)  # a frame's length is a u32
                header = pack_header(FrameKind.DATA, desc, version, seqno, sent, end - sent)
                cmds.append(Send(peer, [header, *stream.views(sent, end)], volatile))
                self.bytes_sent += end - sent
                self.frames_sent += 1
                sent = end
            active.sent[peer] = sent

    def send_control(self, peer: int, msg: dict[str, Any], cmds: list[Command]) -> None:
        """Send a CONTROL frame carrying ``msg`` (checked on a link that checks)."""
        body = encode_body(msg)
        crc = checksum(body) if self.agent.links[peer].checked else None
        header = pack_header(FrameKind.CONTROL, NO_CALL, self.agent.version, self.agent.seqno, 0,
                             len(body), self.agent.incarnation, crc)
        self.send_frame(peer, [header, body], cmds)

    def send_frame(self, peer: int, parts: Sequence[bytes | memoryview],
                   cmds: list[Command]) -> None:
        """Send one frame: a packed header and its payload."""
        cmds.append(Send(peer, list(parts)))
        self.frames_sent += 1

    def flood_error(self, error_type: str, reason: str, origin: int, cmds: list[Command],
                   source: int) -> None:
        """Tell every other neighbour, so that every rank fails with the same error type."""
        payload = encode_error(error_type, reason, origin)
        desc = CallDescriptor(CollectiveKind.BROADCAST, NONE_U8, NONE_U8, NONE_U16, 0)
        crc = checksum(payload)  # (an error frame is small: checked on any link that checks)
        for peer, link in self.agent.links.items():
            if peer != source:
                header = pack_header(FrameKind.ERROR, desc, self.agent.version, self.agent.seqno, 0,
                                     len(payload), 0, crc if link.checked else None)
                cmds.append(Send(peer, [header, payload]))
                self.frames_sent += 1
