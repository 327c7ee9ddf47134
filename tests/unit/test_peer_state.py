"""The recovery ``state`` message: what a neighbour keeps, round trip and rejections."""

from __future__ import annotations

from typing import Any

import pytest

from rabit2.core.recovery.peer_state import PeerState
from rabit2.errors import ProtocolError

STATE = PeerState(3, (4, 2), True, 100, True, False, (3, 4), (3, 0), (3,), 5)


def test_a_state_survives_the_wire() -> None:
    assert PeerState.from_msg(STATE.to_msg()) == STATE


def test_a_state_without_boot_keeps_no_calls_before_load() -> None:
    """(``boot`` and ``locals`` are optional: a peer that keeps none may leave them out)"""
    msg = STATE.to_msg()
    del msg["boot"], msg["locals"]
    assert PeerState.from_msg(msg).boot == 0


@pytest.mark.parametrize("call", [(3, 0), (4, 1), (0, 0), (0, 4)])
def test_what_a_neighbour_retains(call: tuple[int, int]) -> None:
    assert STATE.retains(call)


@pytest.mark.parametrize("call", [(2, 9), (0, 5), (1, 0)])
def test_what_a_neighbour_no_longer_retains(call: tuple[int, int]) -> None:
    assert not STATE.retains(call)


@pytest.mark.parametrize("field,value", [
    ("boot", -1), ("boot", 1 << 32), ("boot", True), ("boot", "3"), ("boot", None),
    ("inc", -1), ("need", -2), ("versions", [1, 2, 3, 4]), ("oldest", [1]),
])
def test_a_bad_state_is_a_protocol_error(field: str, value: Any) -> None:
    msg = {**STATE.to_msg(), field: value}
    with pytest.raises(ProtocolError):
        PeerState.from_msg(msg)
