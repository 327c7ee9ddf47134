"""The tracker's front door: it listens, accepts, and authenticates every connection before
the tracker (``tracker/service.py``) sees it.

The first 4 bytes of a connection tell the protocols apart: rabit2's magic starts the
authenticated handshake (``rabit2.io.handshake``), classic rabit's is a worker of the classic
protocol (``tracker/classic.py``, not authenticated).  Handshakes in flight are bounded, and a
flood of silent or slow connections is dropped oldest first, so that a registration still
gets in; a connection that fails its handshake is closed, with a rate-limited warning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from rabit2.errors import RabitError
from rabit2.io.handshake import RateLimitedLog, server_handshake, sock_read_exact, tune_socket
from tracker.classic import CLASSIC_MAGIC

logger = logging.getLogger("rabit2.tracker")

_ACCEPT_ERROR_PAUSE_SEC = 0.1  # e.g. EMFILE: back off instead of spinning on accept

Serve = Callable[[socket.socket, dict[str, Any], str, str], Awaitable[None]]
ServeClassic = Callable[[socket.socket, str, str], Awaitable[None]]


class Listener:
    """Accepts connections and runs each one on its own task: the handshake, then
    ``serve(sock, hello, host, peer)`` (rabit2) or ``serve_classic(sock, host, peer)``, which
    own the socket from then on (``host``: the source IP, ``peer``: host:port for logs)."""

    def __init__(self, *, secret: bytes, handshake_timeout: float, max_handshakes: int,
                 check_hello: Callable[[dict[str, Any]], dict[str, Any]], serve: Serve,
                 serve_classic: ServeClassic, refusals: RateLimitedLog) -> None:
        """``check_hello``: validates a hello and returns the reply (raises to refuse);
        ``refusals``: where refused connections are told of."""
        self._secret = secret
        self._handshake_timeout = handshake_timeout
        self._check_hello = check_hello
        self._serve = serve
        self._serve_classic = serve_classic
        self._refusals = refusals
        self._handlers: set[asyncio.Task[None]] = set()
        # Handshakes in flight are bounded so that a flood of silent connections cannot
        # exhaust file descriptors; each one also ends at handshake_timeout.
        self._max_handshakes = max_handshakes
        self._in_handshake: dict[asyncio.Task[Any], float] = {}  # -> when it was accepted
        # a handler cancelled before it ran never closes its own socket: closed when it ends
        self._unstarted: dict[asyncio.Task[Any], socket.socket] = {}
        self._listener: socket.socket | None = None
        self._accept_task: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, backlog: int) -> int:
        """Bind and start accepting; returns the bound port.

        Raises ``OSError`` if the address cannot be bound.
        """
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _, address = infos[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(address)
            listener.listen(backlog)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._accept_task = asyncio.create_task(
            self._accept_loop(listener), name="rabit2-tracker-accept"
        )
        bound: int = listener.getsockname()[1]
        return bound

    async def stop_accepting(self) -> None:
        """Stop accepting and close the listening socket.  Idempotent."""
        if self._accept_task is not None:
            self._accept_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accept_task
            self._accept_task = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    async def cancel_handlers(self) -> None:
        """Cancel every connection's task and wait for them."""
        for handler in list(self._handlers):
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _accept_loop(self, listener: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, address = await loop.sock_accept(listener)
            except OSError as exc:
                logger.warning("accept failed: %s", exc)
                await asyncio.sleep(_ACCEPT_ERROR_PAUSE_SEC)
                continue
            peer = f"{address[0]}:{address[1]}"
            if len(self._in_handshake) >= self._max_handshakes:
                # fair admission: the oldest unfinished handshake makes room.  A worker
                # finishes its handshake in milliseconds, so under a flood of idle or slow
                # connections it is the flood that is dropped, and a registration gets in.
                # (Counted by the handlers not yet through: a burst of accepts runs before
                # any of them starts, and one cancelled then leaves the count at once.)
                oldest = min(self._in_handshake, key=self._in_handshake.__getitem__)
                del self._in_handshake[oldest]
                oldest.cancel()
                self._refusals.warning(
                    "dropped the oldest of %d unfinished handshakes to admit %s",
                    len(self._in_handshake) + 1, peer)
            handler = asyncio.create_task(self._handle(sock, str(address[0]), peer))
            self._handlers.add(handler)
            self._in_handshake[handler] = loop.time()
            self._unstarted[handler] = sock
            handler.add_done_callback(self._ended)

    def _ended(self, handler: asyncio.Task[None]) -> None:
        self._handlers.discard(handler)
        self._in_handshake.pop(handler, None)
        sock = self._unstarted.pop(handler, None)
        if sock is not None:  # (cancelled before it ran)
            sock.close()

    async def _handle(self, sock: socket.socket, host: str, peer: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._handshake_timeout
        classic = False
        task = asyncio.current_task()
        self._unstarted.pop(task, None)  # type: ignore[arg-type]  # (from here it closes sock)
        try:
            sock.setblocking(False)
            tune_socket(sock)
            # the first 4 bytes tell the protocols apart: rabit2's magic, or classic rabit's
            first = await sock_read_exact(loop, sock, len(CLASSIC_MAGIC), deadline)
            classic = first == CLASSIC_MAGIC
            if not classic:
                hello = await server_handshake(loop, sock, self._secret, deadline,
                                               self._check_hello, prefix=first)
        except (RabitError, OSError) as exc:
            sock.close()
            self._refusals.warning("connection from %s closed during handshake: %s", peer, exc)
            return
        except asyncio.CancelledError:
            sock.close()  # dropped to admit a newer connection, or the tracker closes
            raise
        finally:
            self._in_handshake.pop(task, None)  # type: ignore[arg-type]
        if classic:
            await self._serve_classic(sock, host, peer)
        else:
            await self._serve(sock, hello, host, peer)


__all__ = ["Listener"]
