"""The caller drives its own call (``docs/design.md``, "The caller drives its call").

A call of a training loop is short: the caller's thread can make it on its own, with no
hand-off to the loop thread and back.  It holds the parked loop (:meth:`LoopThread.hold`), so
it may use what the loop owns; it begins the call on the agent, whose first writes go straight
to the kernel (a transport with nothing queued writes at once), and waits for the links'
bytes on an epoll of its own, reading each link's socket into the buffer the agent names
through the link's own protocol methods, exactly as the loop would.

Only the happy path is driven here.  Whatever else happens — a link that hangs up, closes or
breaks, bytes the kernel did not take (the loop must flush them), a call that takes longer
than ``drive_ms`` — and the caller lets go of the loop, which goes on with the same call from
where the caller stopped (the same agent, the same transports), while the caller waits for it
as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import time
from typing import TYPE_CHECKING

from rabit2.core.agent import Call
from rabit2.io.express import ExpressIO
from rabit2.io.waiting import SLICE, Backoff, yield_cpu

if TYPE_CHECKING:
    from rabit2.io.engine import Engine
    from rabit2.io.links import PeerLink
    from rabit2.io.waiting import Waiter

logger = logging.getLogger("rabit2.engine")
LINGER = 0.02
"""How long the loop stays parked after a driven call, waiting for the next one (then it
runs its timers and I/O until a caller parks it again)."""
HOLD_WAIT = 1.0
"""How long a caller waits for the loop thread to park (it is then busy with something long:
the call goes to it instead)."""


class Driver:
    """Drives calls on the caller's thread, for one engine."""

    def __init__(self, engine: Engine, drive: float, spin: float, express: bool = True,
                 general: bool = True) -> None:
        self.engine = engine
        # calls made in one step where nothing else goes on (rabit2.io.express)
        self.express = ExpressIO(self) if express else None
        self.drive = drive  # seconds; 0: off
        # whether a call that is not (or not wholly) made express is driven here too, or
        # goes to the loop thread (workers pinned beside others: docs/design.md)
        self.general = general
        self.spin = spin  # seconds of polling (no sleep) before a wait blocks
        self.driven = self.handed = 0
        self.backoff = Backoff()  # (calls that wait without polling: the CPU was contended)
        self._spin_end = 0.0
        self._end = 0.0  # when the call in progress goes to the loop (0: its wait not begun)
        self._epoll: select.epoll | None = None
        self._watched: dict[int, PeerLink] = {}  # fd -> the link it was registered for
        self._muted: set[int] = set()  # fds of links paused for a later call's frames
        self._tracker_fd = -1  # watched too: what the tracker says is the loop's to hear
        self._tracker_key = (0, -1)  # (tracker client, connection number) registered

    def run(self, call: Call, waiter: Waiter, kill_after_bytes: int, reset_peer: int,
            damage: bool) -> bool:
        """Begin ``call`` on this thread and drive it; False if it was not begun here (the
        loop thread must begin it).  On True the call is begun: finished (``waiter``), or
        handed to the loop thread, which finishes it."""
        engine = self.engine
        if not self.drive or not hasattr(select, "epoll"):
            return False
        express = self.express
        injected = kill_after_bytes >= 0 or reset_peer >= 0 or damage
        if not self.general and (express is None or injected or not express.may_take(call)):
            return False
        loop_thread = engine.loop_thread
        if not loop_thread.hold(HOLD_WAIT):
            return False
        finished = False
        begun = True
        self._end = 0.0
        try:
            if express is None or injected or not express.run(call, waiter):
                if not self.general:
                    begun = False
                    return False
                engine.begin_call(call, waiter, kill_after_bytes, reset_peer, damage)
            finished = waiter.finished or (self.general and self._drive(waiter))
            if not self.backoff.skip:
                self.backoff.calm()
            if finished:
                self.driven += 1
            else:
                self.handed += 1
        finally:
            loop_thread.release(LINGER if finished else 0.0)
        return begun

    def _drive(self, waiter: Waiter) -> bool:
        """Read the links until the call finished (True), or until something only the loop
        can deal with happens or ``drive`` seconds pass (False)."""
        epoll = self.sync()
        if epoll is None:
            return False
        clock = time.monotonic
        now = clock()
        end = self.start_wait(now)
        while now < end:
            try:
                events = self.wait(epoll, now, end)
            except InterruptedError:
                events = []
            for fd, _ in events:
                if not self._read(epoll, fd):
                    return False
                if waiter.finished:
                    return True
            now = clock()
        return False

    def start_wait(self, now: float) -> float:
        """A call's wait for its bytes starts at ``now`` (unless it began already: an express
        start waited first): when it ends (``drive`` later), and until when it polls
        (``spin``; not while the CPU is contended)."""
        if self._end:
            return self._end
        self._spin_end = now + self.spin
        if self.backoff.skip:
            self.backoff.skip -= 1
            self._spin_end = now
        self._end = now + self.drive
        return self._end

    def wait(self, epoll: select.epoll, now: float, end: float) -> list[tuple[int, int]]:
        """The links with bytes to read: polled without sleeping while the bytes are due
        soon (a vCPU that sleeps takes tens of microseconds to wake when they arrive:
        docs/design.md, "Waiting"), then waited for."""
        if now >= self._spin_end:
            return epoll.poll(end - now)
        events = epoll.poll(0)
        if not events:
            yield_cpu()
            if time.monotonic() - now > SLICE:
                # other threads held this CPU for a time slice (the rank we wait for may
                # be one of them): sleep instead, for this call and a few more
                self.backoff.contended()
                self._spin_end = now
        return events

    def _read(self, epoll: select.epoll, fd: int) -> bool:
        """Read what ``fd`` holds into the buffer its link's agent names; False if the loop
        must take over (a link closed, replaced or broken, bytes left for it to flush)."""
        if fd == self._tracker_fd:
            return False  # (an abort or a notice about a neighbour: the loop acts on it)
        link = self._watched.get(fd)
        transport = None if link is None else link.transport
        if link is None or transport is None or not link.current or transport.is_closing():
            return False
        if not transport.is_reading():
            # paused on a frame of a later call: read once that call begins
            epoll.modify(fd, 0)
            self._muted.add(fd)
            return True
        try:
            nbytes = os.readv(fd, [link.get_buffer(-1)])
        except BlockingIOError:
            return True
        except OSError:
            return False  # (the loop reads the error too, and hangs the link up)
        if not nbytes:
            return False  # end of stream: the loop hangs the link up
        link.buffer_updated(nbytes)
        return link.current and not link.write_blocked

    def mute(self, fd: int) -> None:
        """Stop waiting for ``fd`` until the next :meth:`sync` (what it holds is for later)."""
        if self._epoll is not None and fd in self._watched:
            self._epoll.modify(fd, 0)
            self._muted.add(fd)

    def sync(self) -> select.epoll | None:
        """The epoll of the current links' sockets (None: a link is not in a state this
        thread can read)."""
        epoll = self._epoll
        if epoll is None:
            epoll = self._epoll = select.epoll()
        watched = self._watched
        links = self.engine.links
        if len(watched) != len(links) or any(
                watched.get(link.fd) is not link for link in links.values()):
            for fd in list(watched):
                # (one closed with its transport is gone from the epoll already)
                with contextlib.suppress(OSError):
                    epoll.unregister(fd)
            watched.clear()
            self._muted.clear()
            for link in links.values():
                if link.fd < 0 or link.transport is None or link.transport.is_closing():
                    return None
                epoll.register(link.fd, select.EPOLLIN)
                watched[link.fd] = link
        elif self._muted:
            for fd in list(self._muted):
                transport = watched[fd].transport
                if transport is not None and transport.is_reading():
                    epoll.modify(fd, select.EPOLLIN)
                    self._muted.discard(fd)
        tracker = self.engine.tracker
        # (its descriptor, looked up once per connection: a connection that closes leaves
        # the epoll by itself, and the next one has another number)
        key = (id(tracker), 0 if tracker is None else tracker.connections)
        if key != self._tracker_key:
            if self._tracker_fd >= 0:
                with contextlib.suppress(OSError):
                    epoll.unregister(self._tracker_fd)
            self._tracker_fd, self._tracker_key = -1, key
            fd = -1 if tracker is None else tracker.fileno()
            if fd < 0:
                self._tracker_key = (0, -1)  # (none now: looked up again next time)
            elif fd not in watched:
                epoll.register(fd, select.EPOLLIN)
                self._tracker_fd = fd
        for link in links.values():
            if link.write_blocked:
                return None
        return epoll

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
            self._epoll = None
        self._watched.clear()
