"""Failure injection for tests: ``mock=rank,version,seqno,trial,after_bytes[,peer[,damage]]``
(``rabit2.api``).

Armed per call by :meth:`~rabit2.io.engine.Engine.run_call`: once ``after_bytes`` payload
bytes of the call have arrived, the process SIGKILLs itself, or resets its link to ``peer``,
or flips the bits of one byte that arrives from ``peer`` before the agent looks at it.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from rabit2.core.agent import Agent

if TYPE_CHECKING:
    from rabit2.io.links import PeerLink

logger = logging.getLogger("rabit2.engine")


class FaultInjector:
    """The failure armed for the current call, if any."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.kill_at = -1  # SIGKILL once bytes_received reaches it
        self.reset_peer = -1  # ... or reset the link to this rank instead
        self.damaging = False  # ... or damage a byte that arrives from it

    def arm(self, kill_after_bytes: int, reset_peer: int, damage: bool) -> None:
        """Arm (or, with ``kill_after_bytes < 0``, disarm) the failure for the call that
        begins now."""
        self.kill_at = (
            -1 if kill_after_bytes < 0
            else self.agent.bytes_received + kill_after_bytes
        )
        self.reset_peer = reset_peer
        self.damaging = damage

    def damage(self, peer: int, nbytes: int, landed: memoryview) -> None:
        """``mock=...,after_bytes,peer,1``: flip the bits of the last byte that just landed
        from ``peer`` once the call has received that many bytes, before the agent looks."""
        if (self.kill_at >= 0 and peer == self.reset_peer
                and self.agent.bytes_received + nbytes >= self.kill_at):
            self.kill_at = -1
            self.damaging = False
            landed[nbytes - 1] ^= 0x10
            logger.error("mock: rank %d damages a byte from rank %d", self.agent.rank, peer)

    def after_bytes(self, links: Mapping[int, PeerLink]) -> None:
        """Bytes arrived while a reset or a kill is armed: fire it once enough did."""
        if not self.damaging and self.agent.bytes_received >= self.kill_at:
            self.fire(links)

    def fire(self, links: Mapping[int, PeerLink]) -> None:
        """``mock=...,after_bytes[,reset_peer]`` is due: reset that link, or die."""
        link = links.get(self.reset_peer)
        self.kill_at = -1
        if self.damaging:
            self.damaging = False
            logger.error("mock: rank %d damaged nothing: too few bytes came from rank %d",
                         self.agent.rank, self.reset_peer)
            return
        if link is not None and link.transport is not None:
            logger.error("mock: rank %d resets its link to rank %d mid-call",
                         self.agent.rank, self.reset_peer)
            link.transport.abort()
            return
        logger.error("mock: killing rank %d mid-call at %.6f", self.agent.rank, time.time())
        os.kill(os.getpid(), signal.SIGKILL)
