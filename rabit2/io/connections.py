"""Connections: how a worker joins the job (tracker, rank, links at init), listens on its peer
port, dials and accepts its neighbours (the handshake of ``rabit2.io.handshake``) and hands
each authenticated socket to a :class:`~rabit2.io.links.PeerLink`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any, TypeVar

from rabit2 import logs
from rabit2.config import Config
from rabit2.core.fsm import State
from rabit2.core.topology import topology
from rabit2.errors import (
    CollectiveTimeoutError,
    JobAbortedError,
    PeerLostError,
    ProtocolError,
    RabitError,
)
from rabit2.io.handshake import (
    RateLimitedLog,
    connect_authenticated,
    is_loopback,
    server_handshake,
    set_congestion,
    tune_socket,
)
from rabit2.io.links import PeerLink
from rabit2.io.tracker_client import TrackerClient
from rabit2.io.tracker_query import query_tracker_status

if TYPE_CHECKING:
    from rabit2.io.engine import Engine

logger = logging.getLogger("rabit2.engine")
T = TypeVar("T")

_MAX_PEER_HANDSHAKES = 64  # unfinished handshakes on the peer port (a worker has <= 4 dialers)
_ACCEPT_ERROR_PAUSE_SEC = 0.1  # e.g. EMFILE: back off instead of spinning on accept
NOT_ISSUED = "was not issued by the tracker"


class Connections:
    """How the engine joins the job and connects its links: bootstrap, peer port, dialing."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._accepted: dict[int, PeerLink] = {}
        self._all_accepted: asyncio.Event | None = None
        self._expect_accept: set[int] = set()
        self.server: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._handshakes: set[asyncio.Task[None]] = set()
        # accepted, not yet authenticated -> when (the oldest is dropped past the cap)
        self._unauthenticated: dict[asyncio.Task[Any], float] = {}
        # handshake tasks that have not run yet -> their socket: one cancelled before it
        # first ran never reaches its own close, so dropping it closes the socket here
        self._unstarted: dict[asyncio.Task[Any], socket.socket] = {}
        self._refusals = RateLimitedLog(logger)

    # ------------------------------------------------------------------ bootstrap

    async def bootstrap(self) -> None:
        cfg = self.engine.config
        self.engine.agent.start()
        loop = asyncio.get_running_loop()
        self._all_accepted = asyncio.Event()
        try:
            self.server = self._listen(cfg)
            self._accept_task = loop.create_task(self._accept_loop(self.server))
            self.engine.tracker = await TrackerClient.connect(cfg, self.server.getsockname()[1])
            self.engine.tracker.on_abort = self.engine.on_abort
            self.engine.tracker.on_peer_lost = self.engine.keeper.on_peer_lost
            self.engine.tracker.on_peer_recovered = self.engine.keeper.on_peer_recovered
            self.engine.tracker.progress = self.engine.progress
            try:
                assignment = await self.engine.tracker.wait_assignment(cfg.timeout_sec)
            except CollectiveTimeoutError as exc:
                raise CollectiveTimeoutError(f"{exc}{await _who_joined(cfg)}") from None
            self.engine.assignment = assignment
            logs.set_rank(assignment.rank)
            logger.info("joined the job at tracker %s:%d: rank %d of %d%s", cfg.tracker_uri,
                        cfg.tracker_port, assignment.rank, assignment.world_size,
                        f", replacing a lost worker (incarnation {assignment.incarnation})"
                        if assignment.incarnation else "")
            for rank, address in self.engine.recovered_at.items():  # (notices that came first)
                if rank in assignment.peers:
                    assignment.peers[rank] = address
            # a restarted worker replays: it learns its neighbours' states first
            self.engine.agent.assigned(assignment.incarnation)
            self._raise_if_failed()  # the tracker may have aborted the job meanwhile
            self.engine.agent.connect_tracker(assignment.rank, assignment.world_size)
            topo = topology(assignment.rank, assignment.world_size)
            if (topo.parent, topo.ring_prev, topo.ring_next) != (
                assignment.parent, assignment.ring_prev, assignment.ring_next
            ):
                raise ProtocolError("the tracker's topology differs from rabit2.core.topology")
            lower = [p for p in topo.neighbors if p < assignment.rank]
            higher = {p for p in topo.neighbors if p > assignment.rank}
            self._expect_accept = higher
            # every wait below also ends at once if the tracker aborts the job
            await self.unless_aborted(
                asyncio.gather(*(self._dial_at_init(p) for p in lower)),
                cfg.connect_timeout_sec + 1)
            self._raise_if_failed()
            self.engine.agent.connect_peers()
            if len(self._accepted) < len(higher):
                await self.unless_aborted(self._all_accepted.wait(), cfg.timeout_sec)
            self._raise_if_failed()
            self.engine.agent.accept_peers(loop.time())
            if self.engine.agent.restarted:
                await self.unless_aborted(self._states_known(), cfg.connect_timeout_sec)
            logger.info("links up to ranks %s (tree parent %s, ring %d -> %d -> %d)%s",
                        ", ".join(map(str, sorted(topo.neighbors))) or "none",
                        topo.parent if topo.parent >= 0 else "none (the root)",
                        topo.ring_prev, assignment.rank, topo.ring_next,
                        "; recovery on" if cfg.recover else "")
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
            agent = self.engine.agent
            if (not (cfg.recover and agent.error is None) or agent.state is State.FAILED
                    or agent.bootstrapping):
                self.stop_listening()
        self.engine.schedule_tick()

    def _raise_if_failed(self) -> None:
        """Stop the bootstrap if the tracker aborted the job.  A failure a neighbour reported
        (e.g. a mismatch in a first call it began already) belongs to that call: it is
        raised by the call, as the state machine records it."""
        if isinstance(self.engine.agent.error, JobAbortedError):
            raise self.engine.agent.error

    async def _states_known(self) -> None:
        while not self.engine.agent.states_known():
            self._raise_if_failed()
            await asyncio.sleep(0.002)

    async def unless_aborted(self, awaitable: Awaitable[T], timeout: float) -> T:
        """Await ``awaitable`` for at most ``timeout`` seconds (``TimeoutError``), or until
        the agent fails (the tracker aborted the job): then raise that failure."""
        task = asyncio.ensure_future(awaitable)
        failed = asyncio.ensure_future(self.engine.failed.wait())
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
        if self.engine.failed.is_set() and self.engine.agent.error is not None:
            # aborted; an agent that had failed already (a neighbour's error reached it
            # during init) keeps that error, the cause, rather than a misleading timeout
            raise self.engine.agent.error
        raise TimeoutError

    def _bootstrap_failed(self, error: RabitError) -> None:
        if self.engine.agent.bootstrapping:
            self.engine.agent.bootstrap_failed(error)

    # ------------------------------------------------------------------ dialing

    async def _dial_at_init(self, peer: int) -> PeerLink:
        """Dial a lower neighbour at init.  A restarted worker whose neighbour died too (two
        adjacent ranks lost at once) finds nobody at the address the tracker knew: it dials
        again, with backoff, at the address ``peer_recovered`` announces once that
        neighbour's replacement registers (bounded by the caller's connect deadline)."""
        assignment = self.engine.assignment
        assert assignment is not None
        delay = 0.02
        while True:
            try:
                address = self.engine.recovered_at.get(peer, assignment.peers[peer])
                return await self.dial(peer, *address)
            except (PeerLostError, ProtocolError) as exc:
                # (a restarted worker may also dial before the neighbour heard from the
                # tracker that its incarnation exists: it asks again)
                again = isinstance(exc, PeerLostError) or NOT_ISSUED in str(exc)
                if not again or not self.engine.agent.restarted or self.engine.failed.is_set():
                    raise  # (aborted: a cancellation of this loop can be lost, see below)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)

    async def dial(self, peer: int, host: str, port: int) -> PeerLink:
        assignment = self.engine.assignment
        assert assignment is not None
        hello = {"rank": assignment.rank, "world": assignment.world_size,
                 "incarnation": assignment.incarnation}
        sock, welcome = await connect_authenticated(
            host, port, self.engine.config.secret, hello, self.engine.config.connect_timeout_sec,
            self.engine.congestion, self.engine.config.link_timeout_sec)
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
            cmds = self.engine.agent.on_link_up(peer, incarnation, loop.time(),
                                         checked=self._checks_payloads(sock))
        except RabitError as exc:  # e.g. an older incarnation: the current link stays
            logger.warning("link to rank %d refused: %s", peer, exc)
            sock.close()
            raise
        link = PeerLink(self.engine, peer)
        link.fd = sock.fileno()
        old = self.engine.links.get(peer)
        self.engine.links[peer] = link
        if old is not None:
            old.current = False  # nothing more is read from it
            if old.transport is not None:
                old.transport.abort()
        await loop.create_connection(lambda: link, sock=sock)
        self.engine.execute(cmds)
        return link

    def _checks_payloads(self, sock: socket.socket) -> bool:
        """Whether the frames sent on this link carry payload checksums: ``checksum=auto``
        checks the links between two hosts, where NICs, switches and cables can damage a
        byte that TCP's sum lets through, and not those within one host, whose bytes never
        leave its memory (there the checks would make 16-64 MiB calls 1.4-2.1x slower:
        docs/performance.md, "Checksums")."""
        mode = self.engine.config.checksum
        if mode != "auto":
            return mode == "on"
        try:
            local, remote = sock.getsockname()[0], sock.getpeername()[0]
        except OSError:
            return True
        return local != remote and not is_loopback(remote)

    # ------------------------------------------------------------------ the peer port

    def _listen(self, cfg: Config) -> socket.socket:
        """Listen on the interface that routes to the tracker, in its address family (IPv4
        or IPv6: the tracker hands the peers the address it sees); no packet is sent to find
        it."""
        assert cfg.tracker_uri is not None
        family, host = socket.AF_INET, "127.0.0.1"
        with contextlib.suppress(OSError):
            # IPv4 where the tracker has an IPv4 address, as the tracker connection prefers
            # it (rabit2.io.handshake.connect): the tracker hands the peers the address that
            # connection came from, which must be the family listened on here
            family, _, _, _, address = min(
                socket.getaddrinfo(cfg.tracker_uri, cfg.tracker_port, type=socket.SOCK_DGRAM),
                key=lambda info: info[0] != socket.AF_INET)
            host = "::1" if family == socket.AF_INET6 else "127.0.0.1"
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(address)
                host = probe.getsockname()[0]
        server = socket.socket(family, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # (accepted links inherit it: docs/design.md, "Congestion control")
        set_congestion(server, self.engine.congestion)
        server.bind((host, 0))
        server.listen(64)
        server.setblocking(False)
        return server

    def tasks(self) -> list[asyncio.Task[Any]]:
        """What is still running here: the accept loop and unfinished handshakes."""
        pending: list[asyncio.Task[Any]] = [*self._handshakes]
        if self._accept_task is not None:
            pending.append(self._accept_task)
        return pending

    def stop_listening(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
            self._accept_task = None
        if self.server is not None:
            self.server.close()
            self.server = None

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
                unstarted = self._unstarted.pop(oldest, None)
                if unstarted is not None:
                    unstarted.close()
                self._refusals.warning("peer port: dropped the oldest of %d unfinished "
                                       "handshakes to admit %s", _MAX_PEER_HANDSHAKES, addr)
            task = loop.create_task(self._accept_one(sock, addr))
            self._handshakes.add(task)  # keep a reference until it finishes
            self._unauthenticated[task] = loop.time()
            self._unstarted[task] = sock
            task.add_done_callback(self._handshakes.discard)
            task.add_done_callback(self._forget_handshake)

    def _forget_handshake(self, task: asyncio.Task[Any]) -> None:
        self._unauthenticated.pop(task, None)
        self._unstarted.pop(task, None)

    async def _accept_one(self, sock: socket.socket, addr: Any) -> None:
        loop = asyncio.get_running_loop()
        me = asyncio.current_task()
        if me is not None:
            self._unstarted.pop(me, None)  # (from here, this task closes its socket)
        tune_socket(sock, self.engine.config.link_timeout_sec)
        claimed: list[tuple[int, int]] = []

        def check(hello: dict[str, Any]) -> dict[str, Any]:
            rank, world = hello.get("rank"), hello.get("world")
            assignment = self.engine.assignment
            if assignment is None:
                raise ProtocolError("not ready: no rank assigned yet")
            if world != assignment.world_size:
                raise ProtocolError(f"world size {world!r} != {assignment.world_size}")
            if not isinstance(rank, int) or rank not in self._expect_accept:
                raise ProtocolError(f"rank {rank!r} is not a neighbour that dials rank "
                                    f"{assignment.rank}")
            incarnation = hello.get("incarnation")
            if not isinstance(incarnation, int) or isinstance(incarnation, bool):
                raise ProtocolError("hello.incarnation is not an int")
            issued = max(assignment.peer_incarnations.get(rank, -1),
                         self.engine.issued.get(rank, -1))
            if incarnation > issued >= 0:
                # only incarnations the tracker issued: a holder of the secret who claims a
                # newer one does not take over a live link
                raise ProtocolError(f"rank {rank} incarnation {incarnation} {NOT_ISSUED} "
                                    f"(latest {issued})")
            if rank in self.engine.links:
                self.engine.agent.fence(rank, incarnation)  # (a zombie of an older one is refused)
            claimed.append((rank, incarnation))
            return {"rank": assignment.rank, "incarnation": assignment.incarnation}

        try:
            # a neighbour can dial before the tracker's assignment reached us: the handshake
            # needs it (to check the dialer's rank), so wait for it, bounded
            waited = loop.time() + self.engine.config.timeout_sec
            while self.engine.assignment is None and loop.time() < waited:
                await asyncio.sleep(0.005)
            deadline = loop.time() + self.engine.config.connect_timeout_sec
            await server_handshake(loop, sock, self.engine.config.secret, deadline, check)
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
        old = self.engine.links.get(peer)
        agent = self.engine.agent
        if agent.link_is_up(peer) and incarnation == agent.link_incarnation(peer) and old:
            # a live process that dials again has lost its end of the old connection (a
            # reset that only it saw): that is the old link's hang-up, here and now, not
            # when keepalive or a retransmission timeout would find it
            logger.info("rank %d dialed again: its end of the old link broke", peer)
            old.current = False
            if old.transport is not None:
                old.transport.abort()
            self.engine.on_hangup(peer, "the same process dialed again (its end of the link broke)")
        self._accepted[peer] = await self._adopt(sock, peer, incarnation)
        if set(self._accepted) >= self._expect_accept and self._all_accepted is not None:
            self._all_accepted.set()


async def _who_joined(cfg: Config) -> str:
    """What the tracker says of a job whose ranks were not assigned in time (which workers
    registered: the missing ones never reached ``init``), or "" when it cannot say."""
    assert cfg.tracker_uri is not None
    try:
        # (within what start() allows beyond the wait: a connect timeout, at least)
        status = await query_tracker_status(cfg.tracker_uri, cfg.tracker_port, cfg.secret,
                                            min(_WHO_JOINED_SEC, cfg.connect_timeout_sec / 2))
    except (RabitError, OSError):
        return ""
    joined = sorted(str(task.get("task_id")) for task in status.get("tasks", ()))
    return (f": {status.get('registered')} of {status.get('world_size')} workers registered "
            f"with the tracker (tasks {', '.join(joined) or 'none'}); the others never "
            "reached init, or could not reach the tracker")


_WHO_JOINED_SEC = 3.0
