"""rabit2's logging, as a library does it: nothing is configured unless asked.

By default rabit2 only creates its loggers (``rabit2``, ``rabit2.engine``, ...); the program's
logging configuration decides what is shown (Python shows warnings and errors on stderr when
nothing is configured).  With ``rabit2_log_level`` (``RABIT2_LOG_LEVEL``, ``log_level=``, or
``rabit2-submit --log-level``) rabit2 sets that level on its ``rabit2`` logger and gives it a
handler of its own on stderr whose lines say the time, the rank and the level::

    2026-11-26 09:58:03,112 rabit2[rank 1] INFO joined the job: rank 1 of 4 ...

That handler is installed only where the program configured no logging of its own (the
root logger has no handler); otherwise the program's handlers show rabit2's records at the
level asked, and nothing is printed twice.
"""

from __future__ import annotations

import logging
import sys

FORMAT = "%(asctime)s rabit2[rank %(rank)s] %(levelname)s %(message)s"
"""The format of the handler rabit2 installs when asked to log."""


_rank: int | None = None


def set_rank(rank: int | None) -> None:
    """The rank the tracker assigned this worker (it is on every record from then on)."""
    global _rank  # noqa: PLW0603 - one worker per process, as the API's communicator
    _rank = rank


class _RankFilter(logging.Filter):
    """Puts this worker's rank on every record (``-`` until the tracker assigned it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "rank"):
            record.rank = "-" if _rank is None else _rank
        return True


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler rabit2 installs (one per process; found again by its type)."""


def configure(level: str | None) -> None:
    """Apply ``rabit2_log_level``: None leaves logging alone; a level is set on the
    ``rabit2`` logger, with rabit2's handler (installed once)."""
    if level is None:
        return
    mine = logging.getLogger("rabit2")
    mine.setLevel(level)
    for handler in mine.handlers:
        if isinstance(handler, _Handler):
            handler.setLevel(level)
            return
    if logging.getLogger().handlers:
        return  # the program's logging shows the records
    handler = _Handler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(_RankFilter())
    handler.setLevel(level)
    mine.addHandler(handler)
