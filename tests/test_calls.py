"""Calls with a time limit (`data.calls`): one thread per `CallThread`, calls in order, a call given up on
while it waits never runs, what a call raises reaches the caller."""

import gc
import threading
import time

import pytest

from grpo_hf.data.calls import CallThread, CallTimeout, call_with_timeout


def test_a_call_thread_runs_every_call_on_one_thread_in_order():
    thread, seen = CallThread("test"), []
    for i in range(3):
        thread.call(lambda i=i: seen.append((i, threading.get_ident())), 5.0, f"call {i}")
    assert [i for i, _ in seen] == [0, 1, 2]
    assert len({ident for _, ident in seen}) == 1 and seen[0][1] != threading.get_ident()


def test_a_call_past_its_time_is_abandoned_and_one_waiting_behind_it_never_runs():
    """The first call blocks; the second, queued behind it, times out while waiting and never runs;
    the third waits for the first to end and runs."""
    thread, release, ran = CallThread("test"), threading.Event(), []
    with pytest.raises(CallTimeout, match=r"^blocking did not return within 0.1 s$"):
        thread.call(lambda: release.wait(10), 0.1, "blocking")
    with pytest.raises(CallTimeout, match=r"^queued did not return within 0.1 s$"):
        thread.call(lambda: ran.append("queued"), 0.1, "queued")
    threading.Timer(0.2, release.set).start()
    assert thread.call(lambda: ran.append("after") or "done", 5.0, "after") == "done"
    assert ran == ["after"]


class Interrupted(BaseException):
    """Not an Exception, as KeyboardInterrupt or asyncio.CancelledError."""


def test_what_a_call_raises_is_raised_in_the_caller():
    with pytest.raises(KeyError, match="missing"):
        call_with_timeout(lambda: {}["missing"], 5.0, "a lookup")

    def interrupted() -> None:
        raise Interrupted("stop")

    with pytest.raises(Interrupted, match="stop"):
        call_with_timeout(interrupted, 5.0, "a call")
    assert call_with_timeout(lambda: 42, 5.0, "a call") == 42


def test_the_thread_ends_with_its_call_thread():
    CallThread("grpo-hf-test-ending")
    gc.collect()
    deadline = time.monotonic() + 5
    while any(t.name == "grpo-hf-test-ending" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "grpo-hf-test-ending" for t in threading.enumerate())
