"""The authenticated connection preamble, for tracker connections and worker<->worker links.

Socket-level on purpose: every read asks for exactly the bytes the protocol expects next, so
not one byte past the handshake is consumed.  The caller can then hand the raw socket to
``loop.create_connection(protocol_factory, sock=sock)`` and the first byte its protocol sees is
the first byte the peer sent after the handshake.

Handshake (``docs/protocol.md``, "Connection preamble and authentication")::

    client -> server  MAGIC (8 bytes)
    server -> client  challenge{nonce: sn}
    client -> server  auth{nonce: cn, mac: HMAC(secret, "client" + sn + cn), hello}
    server -> client  ok{mac: HMAC(secret, "server" + cn + sn), welcome}
                      or refuse{reason, code}, then close

Every read has an absolute deadline on ``loop.time()``.  On any failure the helpers close the
socket before the typed error propagates, so a caller never holds a half-authenticated socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rabit2.config import DEFAULT_LINK_TIMEOUT_SEC
from rabit2.core.control import (
    LENGTH_PREFIX_SIZE,
    MAGIC,
    NONCE_SIZE,
    REFUSE_AUTH,
    REFUSE_HELLO,
    auth_mac,
    check_mac,
    decode_body,
    decode_length,
    encode_frame,
    new_nonce,
)
from rabit2.errors import (
    AuthenticationError,
    CollectiveTimeoutError,
    PeerLostError,
    ProtocolError,
    RabitError,
)

_CLIENT = b"client"
_SERVER = b"server"
# Keepalive catches a peer host that vanished (power loss, cable) within ~KEEPIDLE +
# KEEPINTVL * KEEPCNT seconds; a paused process is not caught by it, heartbeats and progress
# deadlines do that.
_KEEPIDLE_SEC = 10
_KEEPINTVL_SEC = 5
_KEEPCNT = 3


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address as sockets report it) is a loopback address, IPv4 ones
    mapped into IPv6 included."""
    try:
        address = ipaddress.ip_address(host.split("%", maxsplit=1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def tune_socket(sock: socket.socket, user_timeout_sec: float = DEFAULT_LINK_TIMEOUT_SEC) -> None:
    """Set TCP_NODELAY and SO_KEEPALIVE, plus keepalive timing and TCP_USER_TIMEOUT where
    the OS has the knobs.

    Sent bytes unacknowledged for ``user_timeout_sec`` end the connection: a path that drops
    every packet while data is in flight (a partition) is otherwise found only after the
    kernel's retransmissions give up, about 15 minutes, and keepalive probes idle
    connections only.  Peer links pass the worker's ``link_timeout_sec``; tracker
    connections keep the default."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (
        ("TCP_KEEPIDLE", _KEEPIDLE_SEC),
        ("TCP_KEEPINTVL", _KEEPINTVL_SEC),
        ("TCP_KEEPCNT", _KEEPCNT),
        ("TCP_USER_TIMEOUT", min(max(1, round(user_timeout_sec * 1000)), 2**31 - 1)),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


DEFAULT_CONGESTION = "reno"


def _allowed_congestion() -> str:
    try:
        return Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control").read_text().strip()
    except OSError:
        return "unknown"


def resolve_congestion(name: str | None) -> str | None:
    """The TCP congestion control to set on peer links, or None to keep the kernel's.

    ``None`` (the default) asks for :data:`DEFAULT_CONGESTION` where this process may set
    it, and quietly keeps the kernel's otherwise; ``"system"`` keeps the kernel's; any other
    name must be settable here, else ``ValueError`` says what is allowed.  Probed on a
    throwaway socket, so a bad setting fails at ``init`` before anything connects."""
    if name == "system":
        return None
    option = getattr(socket, "TCP_CONGESTION", None)
    if option is None:
        if name is None:
            return None
        raise ValueError(f"rabit2_tcp_congestion={name!r}: this platform has no "
                         "TCP_CONGESTION socket option; use 'system'")
    wanted = DEFAULT_CONGESTION if name is None else name
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.IPPROTO_TCP, option, wanted.encode())
    except OSError as exc:
        if name is None:
            return None
        raise ValueError(
            f"rabit2_tcp_congestion={name!r} cannot be set here ({exc.strerror}); allowed "
            f"without privileges: {_allowed_congestion()}; or 'system'") from None
    finally:
        probe.close()
    return wanted


def set_congestion(sock: socket.socket, name: str | None) -> None:
    """Set the congestion control chosen by :func:`resolve_congestion` (None: leave it).

    Set before the connection is made (on a dialing socket before ``connect``, on the
    listening socket before ``listen``: accepted connections inherit it).  Set after, the
    kernel's default has already been started on the connection, and where that is BBR it
    leaves the kernel pacing the connection's sends from then on: a 400 KB write then
    leaves in pieces over hundreds of microseconds (``docs/performance.md``, "Pacing left
    by BBR")."""
    if name is not None:
        with contextlib.suppress(OSError):  # probed already; a socket gone since is no matter
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())


def _is_our_timeout(exc: OSError) -> bool:
    """True for asyncio's deadline expiry, False for a kernel ETIMEDOUT (a dead peer host).

    Both surface as ``TimeoutError``; only the kernel's carries an errno.
    """
    return isinstance(exc, TimeoutError) and exc.errno is None


def _remaining(loop: asyncio.AbstractEventLoop, deadline: float, what: str) -> float:
    left = deadline - loop.time()
    if left <= 0:
        raise CollectiveTimeoutError(f"deadline passed while waiting for {what}")
    return left


async def sock_read_exact(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int, deadline: float
) -> bytes:
    """Read exactly ``n`` bytes from a non-blocking socket before ``deadline`` (loop.time()).

    Raises :class:`CollectiveTimeoutError` at the deadline and :class:`PeerLostError` on EOF
    or a socket error (a truncated read is an error, never a short result).
    """
    buffer = bytearray(n)
    view = memoryview(buffer)
    got = 0
    while got < n:
        left = _remaining(loop, deadline, f"{n - got} more bytes")
        try:
            count = await asyncio.wait_for(loop.sock_recv_into(sock, view[got:]), left)
        except OSError as exc:
            if _is_our_timeout(exc):
                raise CollectiveTimeoutError(
                    f"no data within the deadline ({got} of {n} bytes received)"
                ) from None
            raise PeerLostError(f"connection failed while reading: {exc}") from None
        if count == 0:
            raise PeerLostError(f"connection closed by peer ({got} of {n} bytes received)")
        got += count
    return bytes(buffer)


MAX_AUTH_FRAME = 64 * 1024
"""The largest ``auth`` frame a server reads (its nonce, MAC and hello take a few hundred
bytes): before the peer proved it knows the secret, no more memory is set aside for it."""

_TEXT_LIMIT = 200  # characters of a peer's value that a refusal or a log line quotes


async def sock_read_frame(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, deadline: float,
    limit: int | None = None,
) -> dict[str, Any]:
    """Read one control frame (prefix, then exactly its body) before ``deadline``; a body
    longer than ``limit`` bytes (default ``MAX_FRAME``) is refused before it is read.

    Raises :class:`ProtocolError` for an oversized or invalid frame, otherwise as
    :func:`sock_read_exact`.
    """
    length = decode_length(await sock_read_exact(loop, sock, LENGTH_PREFIX_SIZE, deadline))
    if limit is not None and length > limit:
        raise ProtocolError(f"frame of {length} bytes where at most {limit} are expected")
    return decode_body(await sock_read_exact(loop, sock, length, deadline))


def bounded(text: object) -> str:
    """``text`` as a refusal or a log line may quote a peer's value: at most
    ``_TEXT_LIMIT`` characters, control characters escaped (no forged log lines).  Applied
    where such text leaves: :func:`_refuse` and :class:`RateLimitedLog`."""
    shown = str(text)
    if len(shown) > _TEXT_LIMIT:
        shown = f"{shown[:_TEXT_LIMIT]}... ({len(shown)} characters)"
    return shown.encode("unicode_escape").decode("ascii") if not shown.isprintable() else shown


async def sock_write_frame(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, msg: dict[str, Any]
) -> None:
    """Send one control frame.  Raises :class:`PeerLostError` if the socket fails."""
    data = encode_frame(msg)
    try:
        await loop.sock_sendall(sock, data)
    except OSError as exc:
        raise PeerLostError(f"connection failed while writing: {exc}") from None


async def _refuse(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, reason: str, code: str
) -> None:
    # Best effort: the peer may already be gone, and the refusal is only a courtesy that
    # turns a silent close into a readable error on the other side.
    with contextlib.suppress(RabitError, OSError, ValueError):
        await asyncio.wait_for(
            sock_write_frame(loop, sock, {"t": "refuse", "reason": bounded(reason),
                                          "code": code}), 1.0
        )


async def server_handshake(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    secret: bytes,
    deadline: float,
    check_hello: Callable[[dict[str, Any]], dict[str, Any]],
    prefix: bytes = b"",
) -> dict[str, Any]:
    """Run the accepting side of the handshake on a non-blocking socket; return the hello.
    ``prefix``: the first bytes of the magic, where the caller read them already.

    ``check_hello(hello)`` returns the welcome map sent back in ``ok``; it may raise
    :class:`ProtocolError` to refuse the peer (its message becomes the refusal reason).
    Raises :class:`AuthenticationError` for a wrong MAC, :class:`ProtocolError` for a wrong
    magic or a malformed/unexpected frame, :class:`CollectiveTimeoutError` at the deadline and
    :class:`PeerLostError` on EOF.  On any error the socket is closed before raising; the
    caller logs the reason.
    """
    try:
        magic = prefix + await sock_read_exact(loop, sock, len(MAGIC) - len(prefix), deadline)
        if magic != MAGIC:
            raise ProtocolError(f"wrong magic {magic!r} (not a rabit2 peer, or another version)")
        server_nonce = new_nonce()
        await sock_write_frame(loop, sock, {"t": "challenge", "nonce": server_nonce})
        auth = await sock_read_frame(loop, sock, deadline, limit=MAX_AUTH_FRAME)
        if auth["t"] != "auth":
            raise ProtocolError(f"expected auth, got {auth['t']}")
        client_nonce = auth["nonce"]
        if len(client_nonce) != NONCE_SIZE:
            raise ProtocolError(f"auth nonce of {len(client_nonce)} bytes, expected {NONCE_SIZE}")
        if not check_mac(auth_mac(secret, _CLIENT, server_nonce, client_nonce), auth["mac"]):
            await _refuse(loop, sock, "authentication failed", REFUSE_AUTH)
            raise AuthenticationError("peer failed authentication (wrong job secret)")
        try:
            welcome = check_hello(auth["hello"])
        except ProtocolError as exc:
            await _refuse(loop, sock, str(exc), REFUSE_HELLO)
            raise
        await sock_write_frame(
            loop,
            sock,
            {
                "t": "ok",
                "mac": auth_mac(secret, _SERVER, client_nonce, server_nonce),
                "welcome": welcome,
            },
        )
        hello: dict[str, Any] = auth["hello"]
        return hello
    except BaseException:
        sock.close()
        raise


async def client_handshake(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    secret: bytes,
    hello: dict[str, Any],
    deadline: float,
) -> dict[str, Any]:
    """Run the connecting side of the handshake on a connected non-blocking socket.

    Returns the server's welcome map.  Raises :class:`AuthenticationError` if the server
    refused our MAC or could not prove it knows the secret, :class:`ProtocolError` if it
    refused our hello (the reason is in the message) or sent a malformed frame,
    :class:`CollectiveTimeoutError` at the deadline and :class:`PeerLostError` on EOF.  On any
    error the socket is closed before raising.
    """
    try:
        try:
            await loop.sock_sendall(sock, MAGIC)
        except OSError as exc:
            raise PeerLostError(f"connection failed while writing: {exc}") from None
        challenge = await sock_read_frame(loop, sock, deadline)
        if challenge["t"] != "challenge":
            raise ProtocolError(f"expected challenge, got {challenge['t']}")
        server_nonce = challenge["nonce"]
        if len(server_nonce) != NONCE_SIZE:
            raise ProtocolError(f"challenge nonce of {len(server_nonce)} bytes")
        client_nonce = new_nonce()
        await sock_write_frame(
            loop,
            sock,
            {
                "t": "auth",
                "nonce": client_nonce,
                "mac": auth_mac(secret, _CLIENT, server_nonce, client_nonce),
                "hello": hello,
            },
        )
        reply = await sock_read_frame(loop, sock, deadline)
        if reply["t"] == "refuse":
            if reply["code"] == REFUSE_AUTH:
                raise AuthenticationError(f"refused: {reply['reason']} (check RABIT2_SECRET)")
            raise ProtocolError(f"refused: {reply['reason']}")
        if reply["t"] != "ok":
            raise ProtocolError(f"expected ok or refuse, got {reply['t']}")
        if not check_mac(auth_mac(secret, _SERVER, client_nonce, server_nonce), reply["mac"]):
            raise AuthenticationError("server failed authentication (it does not know the secret)")
        welcome: dict[str, Any] = reply["welcome"]
        return welcome
    except BaseException:
        sock.close()
        raise


async def connect_authenticated(
    host: str, port: int, secret: bytes, hello: dict[str, Any], timeout: float,
    congestion: str | None = None, user_timeout_sec: float = DEFAULT_LINK_TIMEOUT_SEC,
) -> tuple[socket.socket, dict[str, Any]]:
    """Connect to ``host:port``, tune the socket (``congestion``: that congestion control,
    set before the connection is made: :func:`set_congestion`; ``user_timeout_sec``: its
    TCP_USER_TIMEOUT) and run :func:`client_handshake`.

    Returns the non-blocking socket (TCP_NODELAY and SO_KEEPALIVE set) and the welcome.
    ``timeout`` bounds name resolution, connect and handshake together.  Raises
    :class:`PeerLostError` if no address accepts the connection, otherwise as
    :func:`client_handshake`.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        infos = await asyncio.wait_for(
            loop.getaddrinfo(host, port, type=socket.SOCK_STREAM),
            _remaining(loop, deadline, f"resolving {host}"),
        )
    except OSError as exc:
        if _is_our_timeout(exc):
            raise CollectiveTimeoutError(
                f"resolving {host!r} took longer than {timeout}s"
            ) from None
        raise PeerLostError(f"cannot resolve {host!r}: {exc}") from None
    errors: list[str] = []
    # (IPv4 first: a worker listens for its peers in the family it reaches the tracker by,
    # and prefers IPv4 there too: rabit2.io.connections)
    for family, kind, proto, _, address in sorted(infos, key=lambda i: i[0] != socket.AF_INET):
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        try:
            tune_socket(sock, user_timeout_sec)
            set_congestion(sock, congestion)
            left = _remaining(loop, deadline, f"connecting to {host}:{port}")
            await asyncio.wait_for(loop.sock_connect(sock, address), left)
        except OSError as exc:
            sock.close()
            if _is_our_timeout(exc):
                raise CollectiveTimeoutError(
                    f"connecting to {host}:{port} took longer than {timeout}s"
                ) from None
            errors.append(f"{address}: {exc}")
            continue
        except BaseException:
            sock.close()
            raise
        welcome = await client_handshake(loop, sock, secret, hello, deadline)
        return sock, welcome
    raise PeerLostError(f"cannot connect to {host}:{port}: {'; '.join(errors) or 'no address'}")


class RateLimitedLog:
    """Warnings about refused connections, at most ``burst`` per ``period`` seconds; the
    rest are counted and said in one line when the next period starts.  A flood of bad
    connections must not become a flood of log lines."""

    def __init__(self, log: logging.Logger, burst: int = 10, period: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log, self._burst, self._period, self._clock = log, burst, period, clock
        self._start = -period
        self._count = self._suppressed = 0

    def warning(self, message: str, *args: Any) -> None:
        now = self._clock()
        if now - self._start >= self._period:
            if self._suppressed:
                self._log.warning("%d more refused connections like the above in %.0f s",
                                  self._suppressed, self._period)
            self._start, self._count, self._suppressed = now, 0, 0
        self._count += 1
        if self._count <= self._burst:  # (each value bounded: a peer may have written it)
            self._log.warning(message, *(bounded(arg) if isinstance(arg, (str, Exception))
                                         else arg for arg in args))
        else:
            self._suppressed += 1


__all__ = [
    "MAX_AUTH_FRAME",
    "RateLimitedLog",
    "bounded",
    "client_handshake",
    "connect_authenticated",
    "is_loopback",
    "resolve_congestion",
    "server_handshake",
    "set_congestion",
    "sock_read_exact",
    "sock_read_frame",
    "sock_write_frame",
    "tune_socket",
]

