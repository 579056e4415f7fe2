"""How long each forward pass took on its device: what the engine's cost fit learns from.

On a CPU a forward returns when its work is done, so the wall time around the call is its cost.
On CUDA a forward returns once its kernels are queued: the wall time around it prices the launches,
not the work (and the blocking host-to-device copies of the next step would wait out this one's
kernels, billing them there). Synchronising after each forward would price it right, but would also
stall the launches queued behind it (the verdict's sampling kernels) until the device is idle.
So on CUDA two events bracket the forward's kernels, and their elapsed time is read once they have
run: polled, never waited on, at the next forward, or waited for by ``settle`` (the engine's
warm-up, which reads the fit at once).

An observation thus reaches the fit one step late on CUDA; the fit is a smoothed mean over many
steps, and its readers (adaptive k, prompt chunking, a worker's Info) plan ahead with it anyway.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import torch

Observe = Callable[[float], None]  # takes a forward's seconds


class DeviceEvent(Protocol):
    """What the clock uses of ``torch.cuda.Event`` (timing enabled)."""

    def record(self, stream: Any = None) -> None: ...

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Any) -> float: ...  # milliseconds from this event to ``end``


class StepClock:
    """``start()`` before a forward, ``stop(mark, observe)`` after it: ``observe`` gets the forward's seconds,
    at once on a CPU, once its kernels have run on CUDA (see the module docstring). ``new_event`` makes the
    events where the device is not a CUDA one's to hand (tests)."""

    def __init__(self, device: torch.device, new_event: Callable[[], DeviceEvent] | None = None) -> None:
        self.on_device = device.type == "cuda" or new_event is not None
        # An event records on the stream it is given, else on the current device's: the engine's device may not
        # be its thread's current one (cuda:1, on a model thread).
        self._stream: Callable[[], Any] = lambda: None
        if new_event is None and self.on_device:
            def new_event() -> DeviceEvent:
                return torch.cuda.Event(enable_timing=True)

            self._stream = lambda: torch.cuda.current_stream(device)
        self._new_event = new_event
        self._pending: deque[tuple[DeviceEvent, DeviceEvent, Observe]] = deque()  # oldest first

    def start(self) -> float | DeviceEvent:
        """A mark to hand to ``stop``; first, the forwards before whose kernels have run are observed."""
        self._poll()
        if not self.on_device:
            return time.perf_counter()
        begin = self._new_event()
        begin.record(self._stream())
        return begin

    def stop(self, mark: float | DeviceEvent, observe: Observe) -> None:
        if not self.on_device:
            observe(time.perf_counter() - mark)
            return
        end = self._new_event()
        end.record(self._stream())
        self._pending.append((mark, end, observe))

    def settle(self) -> None:
        """Wait for the forwards timed so far, and observe each."""
        if self._pending:
            self._pending[-1][1].synchronize()  # one stream: the last has run, so have the ones before it
        self._poll()

    def _poll(self) -> None:
        while self._pending and self._pending[0][1].query():
            begin, end, observe = self._pending.popleft()
            observe(begin.elapsed_time(end) / 1000.0)
