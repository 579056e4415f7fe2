"""An asyncio loop whose clock moves only when every task waits: a test of timeouts and deadlines runs in no time and
reads exact seconds, however loaded the machine (a real-time clock scaled down to milliseconds failed CI by 0.4 ms
beside other tests)."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Polls without blocking; where the loop would sleep until its next timer, the clock jumps there instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list:
        if timeout is None:  # no timer: only I/O (a thread's call_soon_threadsafe) can wake the loop; wait for it
            return super().select(None)
        ready = super().select(0)
        if not ready:
            self.now += timeout
        return ready


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """``time()`` starts at 0 and advances only by the waits ``asyncio.sleep`` and timeouts ask for. For tasks that
    wait on timers: sockets and threads still wake the loop, but the time they take is not on its clock."""

    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(self._jumping)

    def time(self) -> float:
        return self._jumping.now


def run_on_virtual_clock(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on a ``VirtualClockLoop``."""
    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(main)
