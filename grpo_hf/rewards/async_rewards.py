"""`async def` reward functions, run concurrently (as TRL runs them).

A reward function that awaits something (a judge model behind an HTTP API, a sandbox) is written
`async def name(completions, **kwargs) -> list[float | None]`, with the same contract as a plain
one. For each scoring call `AsyncRewardCalls` starts one event loop on a helper thread and awaits
every async function on the whole batch (each with its own keyword arguments: its own `log_extra`
and `log_metric`) with `asyncio.gather`, while the caller runs the plain
functions and reward models as usual; `outcome(func)` then waits for that function's result (or
its exception). The caller checks the output and handles errors exactly as for a plain function;
its retry one completion at a time calls `blocking(func)`, which runs each call in its own loop.
"""

import asyncio
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


def is_async_reward(func: object) -> bool:
    """True for an `async def` function, or an object whose `__call__` is one."""
    return inspect.iscoroutinefunction(func) or (
        callable(func) and inspect.iscoroutinefunction(type(func).__call__)
    )


class AsyncRewardCalls:
    """The async reward functions of one scoring call, awaited together on a helper thread.

    Use as a context manager: the calls start on entry; leaving waits for them to end, so no call
    outlives the scoring call, even when a plain reward function raised in the meantime.
    """

    def __init__(self, calls: list[tuple[Callable, dict]]) -> None:
        """`calls`: each async reward function with the keyword arguments to call it with."""
        self._funcs = [func for func, _ in calls]
        self._kwargs = [kwargs for _, kwargs in calls]
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future | None = None

    def __enter__(self) -> "AsyncRewardCalls":
        if self._funcs:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="async-rewards")
            self._future = self._executor.submit(asyncio.run, self._gather())
        return self

    def __exit__(self, *exc_info) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    async def _gather(self) -> list:
        calls = [func(**kwargs) for func, kwargs in zip(self._funcs, self._kwargs, strict=True)]
        return await asyncio.gather(*calls, return_exceptions=True)

    def outcome(self, func: Callable) -> object:
        """What `func` returned on the whole batch; raises what it raised."""
        outcomes = self._future.result()
        result = next(out for f, out in zip(self._funcs, outcomes, strict=True) if f is func)
        if isinstance(result, BaseException):
            raise result
        return result


def blocking(func: Callable, name: str) -> Callable:
    """A plain-function stand-in for an async reward function (one event loop per call), named `name`."""

    @functools.wraps(func)
    def call(**kwargs):
        return asyncio.run(func(**kwargs))

    call.__name__ = name
    return call
