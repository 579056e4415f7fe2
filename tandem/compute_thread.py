"""One thread computes: a process's torch work runs on the thread that loaded its model.

Why: PyTorch's CPU build parallelises with OpenMP (libgomp), and every OS thread
that runs a parallel op gets an OpenMP team of its own that lives as long as the
thread. Once a process holds more team threads than it has cores, libgomp stops
letting idle workers spin and puts them to sleep after every parallel region;
each of the hundreds of parallel ops in a forward pass then pays a futex wake-up.
Measured on a 2-core AMD EPYC (Zen 5), Qwen2.5-Coder-1.5B in bf16
(``benchmarks/compute_thread.py``): a 9-row tree verification took 97 ms while one
thread had computed, 151 ms once a second live thread had run a single matmul, and
98 ms again when that thread exited; a one-token decode step 57 ms against 71 ms.
A model loaded on the main thread
(the weight packing and row-padding timings are parallel ops) and then run on a
worker thread is exactly that case.

So: a worker process loads, warms up and computes on its one model thread
(``tandem.rpc.worker_runner``); the in-process generator computes on the thread
that calls it, the one that loaded the engines (``CallingThreadExecutor``); and
an engine warns once (``ComputeThreadWarning``) when it computes on a thread
other than the live one it was built on.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class ComputeThreadWarning(RuntimeWarning):
    """A model computes on a second live thread: on a CPU, each forward pays OpenMP wake-ups (module doc)."""


class CallingThreadExecutor(Executor):
    """An executor that runs each call at once on the thread that submits it (and so blocks that thread)."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - handed to whoever awaits the future, as a thread pool would
            future.set_exception(exc)
        return future


class HomeThread:
    """The thread a model was built on; ``check`` warns once if another thread computes while it lives."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.thread = threading.current_thread()
        self.warned = False

    def check(self) -> None:
        here = threading.current_thread()
        if here is self.thread or self.warned:
            return
        if not self.thread.is_alive():  # its OpenMP team went with it: this thread is home now
            self.thread = here
            return
        self.warned = True
        warnings.warn(
            f"{self.what} computes on thread {here.name!r} but was built on {self.thread.name!r}, which is still "
            "alive: with two OpenMP teams on the cores, every forward pass pays thread wake-ups (up to 1.5x "
            "slower on a 2-core CPU). Build it on the thread that will run it (tandem.compute_thread).",
            ComputeThreadWarning, stacklevel=_outside_stacklevel(),
        )


def _outside_stacklevel() -> int:
    """The ``stacklevel`` (for a ``warnings.warn`` in the caller) of the first frame outside Tandem and
    torch: the code that asked for the compute, not an engine method or torch's inference_mode wrapper.
    (Python 3.12's ``skip_file_prefixes`` does this; Tandem runs on 3.10 too.)"""
    inside = [os.path.dirname(__file__)]
    if (torch := sys.modules.get("torch")) is not None and torch.__file__:
        inside.append(os.path.dirname(torch.__file__))
    prefixes = tuple(os.path.join(path, "") for path in inside)
    frame, level = sys._getframe(1), 1  # the caller: the function that warns
    while frame is not None and frame.f_code.co_filename.startswith(prefixes):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2
