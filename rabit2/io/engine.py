"""The I/O driver: one background event loop per worker, TCP links, and the agent on top.

The loop runs in a daemon thread for the life of the worker (:mod:`rabit2.io.loop_thread`).
API threads hand it calls with :meth:`Engine.run_call` and wait for them
(:mod:`rabit2.io.waiting`); the loop feeds the :class:`~rabit2.core.agent.Agent` events and
executes the commands it returns.

Links are :class:`asyncio.BufferedProtocol` s: ``get_buffer`` returns the view the agent
names (the frame header buffer, the user's array or a link's scratch), so received bytes are
never copied in Python.  Sends are ``writelines([header, view, ...])`` of views of the user's
array; a call is reported complete only after every link's write buffer has drained, so the
caller can reuse its array the moment ``run_call`` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from rabit2.config import Config
from rabit2.core.agent import (
    Agent,
    Call,
    CallComplete,
    CallFailed,
    CheckpointLoaded,
    CloseLink,
    Command,
    PauseReading,
    ResumeReading,
    Send,
)
from rabit2.core.fsm import State
from rabit2.core.topology import topology
from rabit2.errors import (
    CollectiveTimeoutError,
    JobAbortedError,
    PeerLostError,
    ProtocolError,
    RabitError,
    TrackerError,
    UnrecoverableError,
)
from rabit2.io.faults import FaultInjector
from rabit2.io.handshake import (
    RateLimitedLog,
    connect_authenticated,
    is_loopback,
    resolve_congestion,
    server_handshake,
    set_congestion,
    tune_socket,
)
from rabit2.io.links import BOOTSTRAP_STATES, LinksMixin, PeerLink
from rabit2.io.loop_thread import LoopThread, bind_to_cpu
from rabit2.io.tracker_client import Assignment, TrackerClient
from rabit2.io.waiting import Poller, Waiter

logger = logging.getLogger("rabit2.engine")
T = TypeVar("T")

_MAX_PEER_HANDSHAKES = 64  # unfinished handshakes on the peer port (a worker has <= 4 dialers)
_ACCEPT_ERROR_PAUSE_SEC = 0.1  # e.g. EMFILE: back off instead of spinning on accept
NOT_ISSUED = "was not issued by the tracker"


class Engine(LinksMixin):
    """A worker's connection to the job: tracker client, peer links, agent, loop thread."""

    def __init__(self, config: Config) -> None:
        self.config = config
        # the peer links' congestion control (a bad explicit setting fails here, at init)
        self._congestion = resolve_congestion(config.tcp_congestion)
        bind_to_cpu(os.environ.get("RABIT2_BIND_CPU"))
        self.agent = Agent(
            ring_mincount=config.reduce_ring_mincount,
            tree_chunk=config.tree_reduce_minsize,
            timeout=config.timeout_sec,
            recover=config.recover,
            recover_timeout=config.recover_timeout_sec,
            retain_bytes=config.replay_mb << 20,
            local_replica=config.local_replica,
            checked=config.checksum != "off",
        )
        # the loop thread defers to a polling caller (both off with rabit2_spin_us=0)
        self.loop_thread = LoopThread(config.loop)
        self.loop_thread.set_batch(config.spin_us > 0)
        self.loop = self.loop_thread.loop
        self._poller = Poller(config.spin_us / 1e6, self.loop_thread)
        self.faults = FaultInjector(self.agent)
        self._init_links()
        self.tracker: TrackerClient | None = None
        self.assignment: Assignment | None = None
        self._pending: Waiter | None = None
        self._completed = False  # the agent finished the call; waiting for writes to drain
        self._accepted: dict[int, PeerLink] = {}
        self._all_accepted: asyncio.Event | None = None
        self._server: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        # accepted, not yet authenticated -> when (the oldest is dropped past the cap)
        self._unauthenticated: dict[asyncio.Task[Any], float] = {}
        self._sent_at = 0.0  # when bytes last left on a link, or a drain wait began
        self._refusals = RateLimitedLog(logger)
        self._tick_handle: asyncio.TimerHandle | None = None
        self._writelines = self.loop_thread.is_uvloop
        self._overflow_told = False  # the replay store's first overflow was logged
        self._expect_accept: set[int] = set()
        self._ckpt_waiter: Waiter | None = None
        self._ckpt_loaded: tuple[int, bytes | None, bytes | None] = (0, None, None)
        self._closing = False
        self._failed = asyncio.Event()  # set when the tracker aborts the job

    # ------------------------------------------------------------------ bootstrap

    def start(self) -> None:
        """Connect to the tracker, get a rank, wire up the links.  Blocks; bounded."""
        budget = self.config.connect_timeout_sec * max(1, self.config.connect_retry) + (
            self.config.timeout_sec
        )
        try:
            self.loop_thread.run(self._bootstrap(), budget)
        except BaseException:
            self.close()
            raise

    async def _bootstrap(self) -> None:
        cfg = self.config
        self.agent.start()
        loop = asyncio.get_running_loop()
        self._all_accepted = asyncio.Event()
        try:
            self._server = self._listen(cfg)
            self._accept_task = loop.create_task(self._accept_loop(self._server))
            self.tracker = await TrackerClient.connect(cfg, self._server.getsockname()[1])
            self.tracker.on_abort = self._on_abort
            self.tracker.on_peer_lost = self._on_peer_lost
            self.tracker.on_peer_recovered = self._on_peer_recovered
            assignment = await self.tracker.wait_assignment(cfg.timeout_sec)
            self.assignment = assignment
            for rank, address in self._recovered_at.items():  # (notices that came first)
                if rank in assignment.peers:
                    assignment.peers[rank] = address
            self.agent.incarnation = assignment.incarnation
            # a restarted worker replays: it learns its neighbours' states first
            self.agent.restarted = cfg.recover and assignment.incarnation > 0
            self._raise_if_failed()  # the tracker may have aborted the job meanwhile
            self.agent.connect_tracker(assignment.rank, assignment.world_size)
            topo = topology(assignment.rank, assignment.world_size)
            if (topo.parent, topo.ring_prev, topo.ring_next) != (
                assignment.parent, assignment.ring_prev, assignment.ring_next
            ):
                raise ProtocolError("the tracker's topology differs from rabit2.core.topology")
            lower = [p for p in topo.neighbors if p < assignment.rank]
            higher = {p for p in topo.neighbors if p > assignment.rank}
            self._expect_accept = higher
            # every wait below also ends at once if the tracker aborts the job
            await self._unless_aborted(
                asyncio.gather(*(self._dial_at_init(p) for p in lower)),
                cfg.connect_timeout_sec + 1)
            self._raise_if_failed()
            self.agent.connect_peers()
            if len(self._accepted) < len(higher):
                await self._unless_aborted(self._all_accepted.wait(), cfg.timeout_sec)
            self._raise_if_failed()
            self.agent.accept_peers(loop.time())
            if self.agent.restarted:
                await self._unless_aborted(self._states_known(), cfg.connect_timeout_sec)
        except TimeoutError:
            error = CollectiveTimeoutError("peers did not connect in time")
            self._bootstrap_failed(error)
            raise error from None
        except RabitError as exc:
            self._bootstrap_failed(exc)
            raise
        finally:
            # with recovery on, the listening socket stays open: a restarted neighbour dials
            # back in, and so does a live one whose link was reset
            state = self.agent.state
            if (not (cfg.recover and self.agent.error is None) or state is State.FAILED
                    or state in BOOTSTRAP_STATES):
                self._stop_listening()
        self._schedule_tick()

    def _raise_if_failed(self) -> None:
        """Stop the bootstrap if the tracker aborted the job.  A failure a neighbour reported
        (e.g. a mismatch in a first call it began already) belongs to that call: it is
        raised by the call, as the state machine records it."""
        if isinstance(self.agent.error, JobAbortedError):
            raise self.agent.error

    async def _states_known(self) -> None:
        while not self.agent.states_known():
            self._raise_if_failed()
            await asyncio.sleep(0.002)

    async def _unless_aborted(self, awaitable: Awaitable[T], timeout: float) -> T:
        """Await ``awaitable`` for at most ``timeout`` seconds (``TimeoutError``), or until
        the agent fails (the tracker aborted the job): then raise that failure."""
        task = asyncio.ensure_future(awaitable)
        failed = asyncio.ensure_future(self._failed.wait())
        try:
            done, _ = await asyncio.wait({task, failed}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            failed.cancel()
        if task in done:
            return task.result()
        # (its outcome is the abort's or the deadline's now: mark it retrieved, whenever)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        task.cancel()
        # bounded: Python 3.11's wait_for swallows a cancellation that arrives as its inner
        # future completes (a dial refused at that moment), and a retry loop would go on
        with contextlib.suppress(BaseException):
            await asyncio.wait({task}, timeout=1.0)
        if self._failed.is_set() and self.agent.error is not None:
            # aborted; an agent that had failed already (a neighbour's error reached it
            # during init) keeps that error, the cause, rather than a misleading timeout
            raise self.agent.error
        raise TimeoutError

    def _stop_listening(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            self._accept_task = None
        if self._server is not None:
            self._server.close()
            self._server = None

    def _bootstrap_failed(self, error: RabitError) -> None:
        if self.agent.state in BOOTSTRAP_STATES:
            self.agent.bootstrap_failed(error)

    def _listen(self, cfg: Config) -> socket.socket:
        """Listen on the interface that routes to the tracker (no packet is sent to find it)."""
        host = "127.0.0.1"
        assert cfg.tracker_uri is not None
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        with contextlib.suppress(OSError), probe:
            probe.connect((cfg.tracker_uri, cfg.tracker_port))
            host = probe.getsockname()[0]
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, 0))
        server.listen(64)
        server.setblocking(False)
        return server

    async def _dial_at_init(self, peer: int) -> PeerLink:
        """Dial a lower neighbour at init.  A restarted worker whose neighbour died too (two
        adjacent ranks lost at once) finds nobody at the address the tracker knew: it dials
        again, with backoff, at the address ``peer_recovered`` announces once that
        neighbour's replacement registers (bounded by the caller's connect deadline)."""
        assignment = self.assignment
        assert assignment is not None
        delay = 0.02
        while True:
            try:
                address = self._recovered_at.get(peer, assignment.peers[peer])
                return await self._dial(peer, *address)
            except (PeerLostError, ProtocolError) as exc:
                # (a restarted worker may also dial before the neighbour heard from the
                # tracker that its incarnation exists: it asks again)
                again = isinstance(exc, PeerLostError) or NOT_ISSUED in str(exc)
                if not again or not self.agent.restarted or self._failed.is_set():
                    raise  # (aborted: a cancellation of this loop can be lost, see below)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def _dial(self, peer: int, host: str, port: int) -> PeerLink:
        assignment = self.assignment
        assert assignment is not None
        hello = {"rank": assignment.rank, "world": assignment.world_size,
                 "incarnation": assignment.incarnation}
        sock, welcome = await connect_authenticated(
            host, port, self.config.secret, hello, self.config.connect_timeout_sec
        )
        incarnation = welcome.get("incarnation", 0)
        if welcome.get("rank") != peer or not isinstance(incarnation, int):
            sock.close()
            raise ProtocolError(f"dialed rank {peer} at {host}:{port} but rank "
                                f"{welcome.get('rank')} answered")
        return await self._adopt(sock, peer, incarnation)

    async def _adopt(self, sock: socket.socket, peer: int, incarnation: int) -> PeerLink:
        """Hand the handshaken socket to a :class:`PeerLink`; frames may flow at once.

        A connection that replaces an older one to the same peer (a restarted neighbour, a
        reset link) closes the old one first: nothing more is read from it.  The agent
        learns about the new link before its first byte can be read."""
        loop = asyncio.get_running_loop()
        try:
            cmds = self.agent.on_link_up(peer, incarnation, loop.time(),
                                         checked=self._checks_payloads(sock))
        except RabitError as exc:  # e.g. an older incarnation: the current link stays
            logger.warning("link to rank %d refused: %s", peer, exc)
            sock.close()
            raise
        set_congestion(sock, self._congestion)  # every peer link, dialed or accepted
        link = PeerLink(self, peer)
        old = self.links.get(peer)
        self.links[peer] = link
        if old is not None:
            old.current = False  # nothing more is read from it
            if old.transport is not None:
                old.transport.abort()
        await loop.create_connection(lambda: link, sock=sock)
        self._execute(cmds)
        return link

    def _checks_payloads(self, sock: socket.socket) -> bool:
        """Whether the frames sent on this link carry payload checksums: ``checksum=auto``
        checks the links between two hosts, where NICs, switches and cables can damage a
        byte that TCP's sum lets through, and not those within one host, whose bytes never
        leave its memory (there the checks would make 16-64 MiB calls 1.4-2.1x slower:
        docs/performance.md, "Checksums")."""
        mode = self.config.checksum
        if mode != "auto":
            return mode == "on"
        try:
            local, remote = sock.getsockname()[0], sock.getpeername()[0]
        except OSError:
            return True
        return local != remote and not is_loopback(remote)

    async def _accept_loop(self, server: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(server)
            except OSError as exc:  # e.g. EMFILE: back off instead of spinning
                self._refusals.warning("peer port: accept failed: %s", exc)
                await asyncio.sleep(_ACCEPT_ERROR_PAUSE_SEC)
                continue
            sock.setblocking(False)
            if len(self._unauthenticated) >= _MAX_PEER_HANDSHAKES:
                # fair admission, as at the tracker: the oldest unfinished handshake makes
                # room (a neighbour finishes its handshake in milliseconds)
                oldest = min(self._unauthenticated, key=self._unauthenticated.__getitem__)
                del self._unauthenticated[oldest]
                oldest.cancel()
                self._refusals.warning("peer port: dropped the oldest of %d unfinished "
                                       "handshakes to admit %s", _MAX_PEER_HANDSHAKES, addr)
            task = loop.create_task(self._accept_one(sock, addr))
            self._handshakes.add(task)  # keep a reference until it finishes
            self._unauthenticated[task] = loop.time()
            task.add_done_callback(self._handshakes.discard)
            task.add_done_callback(self._forget_handshake)

    def _forget_handshake(self, task: asyncio.Task[Any]) -> None:
        self._unauthenticated.pop(task, None)

    async def _accept_one(self, sock: socket.socket, addr: Any) -> None:
        loop = asyncio.get_running_loop()
        tune_socket(sock)
        claimed: list[tuple[int, int]] = []

        def check(hello: dict[str, Any]) -> dict[str, Any]:
            rank, world = hello.get("rank"), hello.get("world")
            assignment = self.assignment
            if assignment is None:
                raise ProtocolError("not ready: no rank assigned yet")
            if world != assignment.world_size:
                raise ProtocolError(f"world size {world} != {assignment.world_size}")
            if not isinstance(rank, int) or rank not in self._expect_accept:
                raise ProtocolError(f"rank {rank} is not a neighbour that dials rank "
                                    f"{assignment.rank}")
            incarnation = hello.get("incarnation")
            if not isinstance(incarnation, int) or isinstance(incarnation, bool):
                raise ProtocolError("hello.incarnation is not an int")
            issued = max(assignment.peer_incarnations.get(rank, -1), self._issued.get(rank, -1))
            if incarnation > issued >= 0:
                # only incarnations the tracker issued: a holder of the secret who claims a
                # newer one does not take over a live link
                raise ProtocolError(f"rank {rank} incarnation {incarnation} {NOT_ISSUED} "
                                    f"(latest {issued})")
            if rank in self.links:
                known = self.agent.links[rank]
                # fencing: only a newer incarnation may replace a link, or the same process
                # dialing again (its end of the link broke, even where ours did not see it);
                # a zombie of an older one is refused
                if incarnation < known.incarnation:
                    raise ProtocolError(f"rank {rank} incarnation {incarnation} is stale "
                                        f"(known: {known.incarnation})")
            claimed.append((rank, incarnation))
            return {"rank": assignment.rank, "incarnation": assignment.incarnation}

        try:
            # a neighbour can dial before the tracker's assignment reached us: the handshake
            # needs it (to check the dialer's rank), so wait for it, bounded
            waited = loop.time() + self.config.timeout_sec
            while self.assignment is None and loop.time() < waited:
                await asyncio.sleep(0.005)
            deadline = loop.time() + self.config.connect_timeout_sec
            await server_handshake(loop, sock, self.config.secret, deadline, check)
        except RabitError as exc:
            self._refusals.warning("refused a peer connection from %s: %s", addr, exc)
            return
        except asyncio.CancelledError:
            sock.close()  # dropped for a newer connection, or the engine closes
            raise
        task = asyncio.current_task()
        if task is not None:
            self._forget_handshake(task)  # authenticated: no longer one to drop
        peer, incarnation = claimed[0]
        known = self.agent.links.get(peer)
        old = self.links.get(peer)
        if known is not None and known.up and incarnation == known.incarnation and old:
            # a live process that dials again has lost its end of the old connection (a
            # reset that only it saw): that is the old link's hang-up, here and now, not
            # when keepalive or a retransmission timeout would find it
            logger.info("rank %d dialed again: its end of the old link broke", peer)
            old.current = False
            if old.transport is not None:
                old.transport.abort()
            self.on_hangup(peer, "the same process dialed again (its end of the link broke)")
        self._accepted[peer] = await self._adopt(sock, peer, incarnation)
        if set(self._accepted) >= self._expect_accept and self._all_accepted is not None:
            self._all_accepted.set()

    # ------------------------------------------------------------------ calls

    def run_call(self, call: Call, kill_after_bytes: int = -1, reset_peer: int = -1,
                 damage: bool = False) -> None:
        """Run one collective; blocks the calling thread until it finished or failed.

        ``kill_after_bytes >= 0`` is failure injection (``mock=...,after_bytes``): the
        process SIGKILLs itself once that many payload bytes of this call have arrived (or,
        with ``reset_peer >= 0``, resets its link to that rank instead, or with ``damage``
        flips the bits of one byte that arrives from that rank).
        """
        waiter = Waiter()
        self.loop.call_soon_threadsafe(self._begin, call, waiter, kill_after_bytes,
                                       reset_peer, damage)
        # the agent's progress deadline fails a stuck call; this outer bound only guards
        # against a dead loop thread
        bound = self.config.timeout_sec * 2 + 60
        if not self._poller.wait(waiter, bound):
            raise CollectiveTimeoutError(f"the loop thread did not answer within {bound:g} s")
        if waiter.error is not None:
            raise waiter.error

    def _begin(self, call: Call, waiter: Waiter, kill_after_bytes: int = -1,
               reset_peer: int = -1, damage: bool = False) -> None:
        self.faults.arm(kill_after_bytes, reset_peer, damage)
        try:
            cmds = self.agent.begin(call, self.loop.time())
        except Exception as exc:  # the caller must see every failure, never wait it out
            waiter.finish(exc)
            return
        self._pending = waiter
        self._completed = False
        self._execute(cmds)

    def _execute(self, cmds: list[Command]) -> None:
        for cmd in cmds:
            if isinstance(cmd, Send):
                link = self.links.get(cmd.peer)
                if link is None or link.transport is None or link.transport.is_closing():
                    continue
                if self._writelines:
                    link.transport.writelines(cmd.buffers)
                else:
                    # asyncio's writelines joins (copies) everything first on Python 3.11
                    for buf in cmd.buffers:
                        link.transport.write(buf)
            elif isinstance(cmd, CallComplete):
                if self.agent.results.overflowed >= 0 and not self._overflow_told:
                    self._tell_overflow()
                if self.faults.kill_at >= 0:  # fewer bytes arrived than asked: fail at the end
                    self.faults.fire(self.links)
                self._completed = True
                self.on_drained()
                if self._pending is not None:
                    # the last bytes are queued on a link whose peer stopped reading: that
                    # wait has the same progress deadline as the call itself
                    waiting = self._pending
                    self._sent_at = max(self._sent_at, self.loop.time())
                    self.loop.call_later(self.config.timeout_sec, self._drain_deadline, waiting)
            elif isinstance(cmd, CallFailed):
                waiter, self._pending = self._pending, None
                if waiter is not None:
                    waiter.finish(cmd.error)
                ckpt = self._ckpt_waiter
                if ckpt is not None and cmd.call_id is None:
                    self._ckpt_waiter = None
                    ckpt.finish(cmd.error)
            elif isinstance(cmd, CheckpointLoaded):
                self._ckpt_loaded = (cmd.version, cmd.blob, cmd.local)
                ckpt = self._ckpt_waiter
                if ckpt is not None:
                    self._ckpt_waiter = None
                    ckpt.finish(None)
            elif isinstance(cmd, PauseReading):
                transport = self.links[cmd.peer].transport
                if transport is not None:
                    transport.pause_reading()
            elif isinstance(cmd, ResumeReading):
                transport = self.links[cmd.peer].transport
                if transport is not None:
                    transport.resume_reading()
            elif isinstance(cmd, CloseLink):
                logger.warning("closing link to rank %d: %s", cmd.peer, cmd.reason)
                transport = self.links[cmd.peer].transport
                if transport is not None:
                    transport.abort()

    def _tell_overflow(self) -> None:
        """Say (once per process) that the replay store lost a result of the version being
        made: until the next checkpoint, a lost worker cannot be recovered
        (docs/recovery.md, "What every rank keeps")."""
        self._overflow_told = True
        logger.warning(
            "rank %d: the results of version %d outgrew rabit2_replay_mb (%d MiB): a worker "
            "lost before the next checkpoint cannot be recovered; checkpoint more often or "
            "raise rabit2_replay_mb (said once)", self.agent.rank,
            self.agent.results.overflowed, self.config.replay_mb)

    def on_bytes(self, peer: int, nbytes: int) -> None:
        self._execute(self.agent.on_bytes(peer, nbytes, self.loop.time()))
        if self.faults.kill_at >= 0:
            self.faults.after_bytes(self.links)

    def on_drained(self) -> None:
        """Resolve the finished call once no link holds unsent bytes of the caller's array."""
        if not self._completed or self._pending is None:
            return
        for link in self.links.values():
            if link.write_blocked:
                return
        waiter, self._pending = self._pending, None
        self._completed = False
        waiter.finish(None)

    def _drain_deadline(self, waiter: Waiter) -> None:
        quiet = self.loop.time() - self._sent_at
        if self._pending is waiter and quiet < self.config.timeout_sec:
            # bytes are still leaving (a slow link): a progress deadline, not a total one
            self.loop.call_later(self.config.timeout_sec - quiet, self._drain_deadline, waiter)
            return
        if self._pending is waiter:
            self._pending, self._completed = None, False
            blocked = [p for p, link in self.links.items() if link.write_blocked]
            waiter.finish(CollectiveTimeoutError(
                f"rank {self.agent.rank}: ranks {blocked} did not read this call's last bytes "
                f"within {self.config.timeout_sec:g} s"
            ))

    def _on_abort(self, reason: str) -> None:
        self._execute(self.agent.abort(reason))
        self._failed.set()

    def _schedule_tick(self) -> None:
        interval = min(1.0, self.config.timeout_sec / 4)
        self._tick_handle = self.loop.call_later(interval, self._tick)

    def _tick(self) -> None:
        now = self.loop.time()
        if self._sending_progressed():
            self._sent_at = now
            self.agent.on_send_progress(now)
        self._execute(self.agent.on_tick(now))
        self._schedule_tick()

    # ------------------------------------------------------------------ tracker services

    def tracker_print(self, msg: str) -> None:
        if self.tracker is None:
            raise TrackerError("not connected to a tracker")
        self.tracker.print(msg)

    def signal_error(self, msg: str) -> None:
        if self.tracker is not None:
            self.tracker.signal_error(msg)

    def checkpoint(self, blob: bytes | Callable[[], bytes] | None = None,
                   local: bytes | None = None) -> int:
        """Bump the version; with recovery on, keep ``blob`` for restarted neighbours and
        hand ``local`` (this rank's local model) on to the next ranks of the ring.  That
        hand-over is not waited for: a rank that dies before its replica arrived resumes
        one version earlier, which every rank keeps too (``docs/recovery.md``)."""
        return self.loop_thread.run(self._checkpoint(blob, local), self.config.timeout_sec)

    async def _checkpoint(self, blob: bytes | Callable[[], bytes] | None,
                          local: bytes | None) -> int:
        version = self.agent.checkpoint(blob)
        if local is not None and self.config.recover:
            self._execute(self.agent.push_local(local))
        return version

    @property
    def restarted(self) -> bool:
        """This worker replaces a lost one and replays (decided at init)."""
        return self.agent.restarted

    def replays_next(self) -> bool:
        """The next call's result comes from a neighbour (``prepare_fun`` is skipped)."""
        return self.agent.replays()

    def load_checkpoint(self, with_local: bool = False) -> tuple[int, bytes | None, bytes | None]:
        """A restarted worker's checkpoint (and local model), fetched from its neighbours.
        Bounded by ``timeout_sec``; raises :class:`UnrecoverableError` if no neighbour
        holds it."""
        waiter = Waiter()
        self.loop.call_soon_threadsafe(self._begin_load, waiter, with_local)
        if not waiter.lock.acquire(True, self.config.timeout_sec):
            raise CollectiveTimeoutError(
                f"no checkpoint from the neighbours within {self.config.timeout_sec:g} s")
        if waiter.error is not None:
            raise waiter.error
        return self._ckpt_loaded

    def _begin_load(self, waiter: Waiter, with_local: bool) -> None:
        self._ckpt_waiter = waiter
        try:
            cmds = self.agent.load_checkpoint(with_local)
        except Exception as exc:
            self._ckpt_waiter = None
            if isinstance(exc, UnrecoverableError):
                # the job cannot go on: the neighbours hear it now, the tracker at finalize
                self._execute(self.agent.fail_load(exc))
            waiter.finish(exc)
            return
        self._execute(cmds)

    def recovery_statistics(self) -> dict[str, int]:
        """The agent's recovery counters (links re-established, bytes fetched, resent...)."""
        return self.loop_thread.run(self._recovery_statistics(), self.config.timeout_sec)

    async def _recovery_statistics(self) -> dict[str, int]:
        return self.agent.recovery_statistics()

    # ------------------------------------------------------------------ shutdown

    def finalize(self) -> None:
        """Tell the tracker we are done, close every link, stop the loop.  Bounded.

        With recovery on (and no failure) the worker first holds, still serving its
        neighbours, until every rank has finalized: a neighbour that dies after its last
        collective is restarted, replays from the results kept here and finalizes too
        (``docs/recovery.md``).  The hold is bounded by ``timeout_sec``; an abort of the job
        meanwhile raises :class:`JobAbortedError`."""
        assignment = self.assignment
        hold = (self.config.recover and assignment is not None and assignment.world_size > 1
                and self.agent.error is None and self.tracker is not None)
        wait = self.config.timeout_sec if hold else self.config.connect_timeout_sec
        try:
            self.loop_thread.run(self._finalize(hold, wait),
                                 wait + self.config.connect_timeout_sec + 5)
        finally:
            self.close()

    async def _finalize(self, hold: bool, wait: float) -> None:
        error = self.agent.error
        if (error is not None and not isinstance(error, JobAbortedError)
                and self.tracker is not None):
            # a typed failure is final (the launcher does not restart a worker that shut
            # down with the tracker): abort the job, so that a replacement still in init,
            # which no peer's error reaches, stops at once instead of at its deadlines
            self.tracker.signal_error(f"{type(error).__name__}: {error}")
        if self.agent.state is not State.TASK_COMPLETE:
            self._execute(self.agent.shutdown())
        try:
            if self.tracker is not None:
                await self.tracker.shutdown(wait, hold=hold,
                                            leave_timeout=self.config.connect_timeout_sec)
        except JobAbortedError:
            if hold:
                raise
        except RabitError as exc:
            logger.warning("tracker shutdown: %s", exc)

    def close(self) -> None:
        """Release every resource; safe to call twice and from any state."""
        if self.loop.is_closed():
            return

        async def _close() -> None:
            self._closing = True
            pending = [*self._redials, *self._handshakes]
            if self._accept_task is not None:
                pending.append(self._accept_task)
            self._stop_listening()
            for task in pending:
                task.cancel()
            # let them unwind here, so that none is destroyed pending with the loop
            await asyncio.gather(*pending, return_exceptions=True)
            if self._tick_handle is not None:
                self._tick_handle.cancel()
            for handle in self._partition_checks.values():
                handle.cancel()
            for link in self.links.values():
                if link.transport is not None:
                    link.transport.close()
            if self.tracker is not None:
                await self.tracker.close()

        with contextlib.suppress(Exception):
            self.loop_thread.run(_close(), 5)
        self.loop_thread.stop()

