"""Logging as a library does it: nothing set unless asked; when asked, one handler whose
lines carry the time, the rank and the level."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator

import pytest

import rabit2
from rabit2 import logs
from rabit2.errors import NotInitializedError


@pytest.fixture(autouse=True)
def clean_rabit2_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("rabit2")
    saved = (logger.level, list(logger.handlers), logger.propagate)
    logger.handlers = [h for h in logger.handlers if not isinstance(h, logs._Handler)]
    logger.propagate = True
    logger.setLevel(logging.NOTSET)
    yield logger
    with contextlib.suppress(NotInitializedError):
        rabit2.finalize()
    logger.setLevel(saved[0])
    logger.handlers = saved[1]
    logger.propagate = saved[2]
    logs.set_rank(None)


def test_init_leaves_a_level_the_program_set(clean_rabit2_logger: logging.Logger) -> None:
    clean_rabit2_logger.setLevel(logging.DEBUG)
    rabit2.init()
    assert clean_rabit2_logger.level == logging.DEBUG
    assert not any(isinstance(h, logs._Handler) for h in clean_rabit2_logger.handlers)
    assert clean_rabit2_logger.propagate


def test_a_level_asked_for_gets_one_handler_with_time_rank_and_level(
        clean_rabit2_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # (a program that set up none)
    rabit2.init(rabit2_log_level="info")
    rabit2.finalize()
    rabit2.init(["rabit2_log_level=info"])  # (again: still one handler)
    assert clean_rabit2_logger.level == logging.INFO
    mine = [h for h in clean_rabit2_logger.handlers if isinstance(h, logs._Handler)]
    assert len(mine) == 1 and clean_rabit2_logger.propagate
    logs.set_rank(3)
    logging.getLogger("rabit2.engine").info("joined")
    logging.getLogger("rabit2.engine").debug("not shown")
    line = stream.getvalue().strip().splitlines()[-1]
    assert line.endswith("rabit2[rank 3] INFO joined"), line
    assert line[:4].isdigit()  # (the date and time come first)
    assert "not shown" not in stream.getvalue()


def test_a_bad_level_fails_init_with_a_clear_error() -> None:
    with pytest.raises(ValueError, match="log_level: expected one of DEBUG, INFO"):
        rabit2.init(rabit2_log_level="LOUD")


def test_where_the_program_set_up_logging_its_handlers_show_the_records(
        clean_rabit2_logger: logging.Logger, caplog: pytest.LogCaptureFixture) -> None:
    rabit2.init(rabit2_log_level="debug")  # (pytest's handlers are on the root logger)
    assert clean_rabit2_logger.level == logging.DEBUG
    assert not any(isinstance(h, logs._Handler) for h in clean_rabit2_logger.handlers)
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("rabit2.engine").debug("seen once")
    assert [r.getMessage() for r in caplog.records] == ["seen once"]
