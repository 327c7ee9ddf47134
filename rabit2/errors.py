"""Typed errors raised by rabit2.

Contract:

* Bad arguments at a call site raise the builtin ``TypeError`` / ``ValueError`` *before* any
  byte is sent (so a caller's mistake on one rank never half-starts a collective).
* Everything that goes wrong between processes raises a subclass of :class:`RabitError`.
  The same subclass is raised on every rank that observes the same failure.
"""

from __future__ import annotations


class RabitError(RuntimeError):
    """Base class of every error that crosses process boundaries."""


class ProtocolError(RabitError):
    """A peer or the tracker sent bytes that do not follow the wire protocol.

    The connection that carried them is closed; the reason is in the message.
    """


class AuthenticationError(ProtocolError):
    """A connection could not prove it knows the job secret (or we could not)."""


class MismatchError(RabitError):
    """Ranks called the same collective with different kinds, dtypes, ops, roots or sizes."""


class PeerLostError(RabitError):
    """A peer link failed and the operation cannot complete."""


class UnrecoverableError(RabitError):
    """A lost worker cannot be brought back: something its recovery needs is gone from every
    live rank (a checkpoint version or a retained result), or the survivors' states
    contradict each other.  Raised on every rank."""


class CollectiveTimeoutError(RabitError):
    """A wait exceeded its progress deadline (no byte moved for ``timeout`` seconds)."""


class TrackerError(RabitError):
    """The tracker could not be reached, refused us, or went away."""


class JobAbortedError(RabitError):
    """The tracker aborted the job (a worker failed for good, or ``signal_error`` was called)."""


class LiveSetError(RabitError):
    """Elastic mode: a live set's block failed (a member was lost in it, or raised), so it
    failed on every member, with the same message; retry the step with the next set."""


class JobFinishedError(JobAbortedError):
    """Elastic mode: this worker came back after the job's other workers finished it, so
    there is no live set to join; it has nothing left to do and may leave quietly."""


class NotInitializedError(RabitError):
    """A collective was called before :func:`rabit2.init` or after :func:`rabit2.finalize`."""


__all__ = [
    "AuthenticationError",
    "CollectiveTimeoutError",
    "JobAbortedError",
    "JobFinishedError",
    "LiveSetError",
    "MismatchError",
    "NotInitializedError",
    "PeerLostError",
    "ProtocolError",
    "RabitError",
    "TrackerError",
    "UnrecoverableError",
]
