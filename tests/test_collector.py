"""``autopar.ir.collector.paused``: the cyclic collector off inside, back as it was after,
nesting across threads."""

from __future__ import annotations

import gc
import threading

import pytest

from autopar.ir.collector import paused


@pytest.fixture(autouse=True)
def _collector_restored():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_turns_the_collector_off_and_back_on_even_on_error():
    gc.enable()
    with pytest.raises(ValueError), paused():
        assert not gc.isenabled()
        raise ValueError
    assert gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off():
    gc.disable()
    with paused():
        pass
    assert not gc.isenabled()


def test_blocks_in_two_threads_nest_and_the_last_one_turns_it_back_on():
    gc.enable()
    inside, leave = threading.Event(), threading.Event()

    def other() -> None:
        with paused():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    with paused():
        t.start()
        inside.wait(10)
    assert not gc.isenabled()  # the other thread's block is still open
    leave.set()
    t.join(10)
    assert gc.isenabled()


def test_paused_decorates_a_function():
    gc.enable()

    @paused()
    def planned() -> bool:
        return gc.isenabled()

    assert planned() is False and planned() is False and gc.isenabled()
