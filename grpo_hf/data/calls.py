"""Calls with a time limit, each run on a thread: the one place the package runs a call it may have
to give up on (tool calls, environments' methods, Hub uploads, NCCL weight transfers to a vLLM server).

- `CallThread`: one long-lived daemon thread that runs the calls handed to it one at a time, in
  order. Each environment instance has one for its whole life (`episodes.environments`): its
  construction, reset, tools and get_reward all run there, as TRL runs them all on one thread (the
  caller's), so an environment holding an object bound to the thread that made it (a `sqlite3`
  connection) works.
- `call_with_timeout`: one call on a thread of its own.

A call's time counts from when it is handed over, its wait behind a `CallThread`'s earlier calls
included. Past it the caller gets a `CallTimeout` naming the call, and the call is abandoned: one
still waiting its turn never runs; one running is not stopped (Python cannot stop a thread) and
runs on in the background, its thread's later calls waiting behind it. What a call raises,
`BaseException`s included, is raised in the caller.
"""

import queue
import threading
import weakref
from collections.abc import Callable


class CallTimeout(TimeoutError):
    """A call that did not return in time (not a TimeoutError the call itself raised)."""


class _Call:
    """One call and, once `done` is set, what it returned or raised; `give_up` before it starts
    and it never runs."""

    def __init__(self, func: Callable[[], object]):
        self.func, self.done = func, threading.Event()
        self.value: object = None
        self.error: BaseException | None = None
        self._lock, self._state = threading.Lock(), "waiting"  # -> "running", or "given up"

    def run(self) -> None:
        with self._lock:
            if self._state == "given up":
                return
            self._state = "running"
        try:
            self.value = self.func()
        except BaseException as err:  # handed to the caller, whatever it is
            self.error = err
        finally:
            self.done.set()

    def give_up(self) -> None:
        """Abandon the call: if it has not started, it never will."""
        with self._lock:
            self._state = "given up"


def _serve(calls: queue.SimpleQueue) -> None:
    """A `CallThread`'s loop: run each call put on the queue, until a None."""
    while (call := calls.get()) is not None:
        call.run()


class CallThread:
    """A daemon thread that runs the calls given to `call` one at a time, in order; it ends once
    this object is garbage (after the call it is running, if any)."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(self._calls,), daemon=True, name=name).start()
        weakref.finalize(self, self._calls.put, None)

    def call(self, func: Callable[[], object], timeout: float | None, what: str) -> object:
        """`func()` on this thread, after its earlier calls: what it returns, or what it raised raised
        here. Past `timeout` seconds (None: no limit) a `CallTimeout` naming `what`."""
        call = _Call(func)
        self._calls.put(call)
        if not call.done.wait(timeout):
            call.give_up()
            raise CallTimeout(f"{what} did not return within {timeout:g} s")
        if call.error is not None:
            raise call.error
        return call.value


def call_with_timeout(func: Callable[[], object], timeout: float, what: str) -> object:
    """`func()` on a thread of its own (`CallThread.call`), abandoned after `timeout` seconds."""
    return CallThread(f"timeout: {what}").call(func, timeout, what)
