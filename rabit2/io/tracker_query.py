"""A monitor connection to a tracker: its status, and a supervisor's word about a task
(``docs/protocol.md``, "Tracker protocol"; ``rabit2-tracker --query``, the launch slots)."""

from __future__ import annotations

import asyncio
from typing import Any

from rabit2.core.control import READ_SIZE, FrameDecoder, encode_frame
from rabit2.errors import PeerLostError, ProtocolError, RabitError, TrackerError
from rabit2.io.handshake import connect_authenticated


async def query_tracker_status(
    host: str, port: int, secret: bytes, timeout: float,
    give_up: tuple[str, str] | None = None, task_id: str | None = None,
    exited: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """Ask a tracker for its :meth:`tracker.server.Tracker.status` over a monitor connection.

    ``task_id``: list that task alone (a job of 1024 tasks answers 100 KB otherwise).
    ``give_up=(task_id, reason)`` first tells it that a supervisor gave up on that task
    (the tracker aborts the job); ``exited=(task_id, attempt)``, that this run of that
    task's process has ended (it is lost at once rather than after the rejoin grace); the
    status returned is then the one after that.
    Raises :class:`TrackerError` if the tracker cannot be reached, refuses us or does not
    answer within ``timeout`` seconds.
    """
    try:
        sock, _ = await connect_authenticated(host, port, secret, {"role": "monitor"}, timeout)
    except RabitError as exc:
        # (a handshake that fails past the connect: something else listens there, or a
        # tracker that does not take this secret)
        hint = ("" if isinstance(exc, PeerLostError) and str(exc).startswith("cannot connect")
                else " (is that a rabit2 tracker, and its secret?)" if secret
                else " (no secret was given: --secret or RABIT2_SECRET)")
        raise TrackerError(f"cannot query the tracker at {host}:{port}: {exc}{hint}") from exc
    reader, writer = await asyncio.open_connection(sock=sock)
    try:
        if exited is not None:
            writer.write(encode_frame({"t": "exited", "task_id": exited[0],
                                       "attempt": exited[1]}))
        if give_up is not None:
            writer.write(encode_frame({"t": "give_up", "task_id": give_up[0],
                                       "reason": give_up[1]}))
        writer.write(encode_frame({"t": "status"} if task_id is None
                                  else {"t": "status", "task_id": task_id}))
        decoder = FrameDecoder()
        async with asyncio.timeout(timeout):
            while True:
                data = await reader.read(READ_SIZE)
                if not data:
                    raise TrackerError("the tracker closed the status connection")
                for msg in decoder.feed(data):
                    if msg["t"] == "status_reply":
                        status: dict[str, Any] = msg["status"]
                        return status
    except TimeoutError:
        raise TrackerError(f"no status reply from the tracker within {timeout}s") from None
    except (ProtocolError, OSError) as exc:
        raise TrackerError(f"status query failed: {exc}") from exc
    finally:
        writer.close()


__all__ = ["query_tracker_status"]
