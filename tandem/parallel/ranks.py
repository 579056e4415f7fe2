"""Starting the N ranks of a tensor-parallel worker, their process groups, and watching them.

Rank 0 is this process; it spawns ranks 1..N-1 as child processes (multiprocessing,
"spawn") that rendezvous with it over TCP on 127.0.0.1 and a free port. Two process
groups over the same ranks:

* control (the default group): rank 0's step broadcasts (``step.py``) and the barrier
  after loading. Its timeout is practically infinite, because the other ranks wait in it
  for as long as rank 0 has no work;
* compute: the all-reduces and all-gathers inside a forward pass, where every rank is in
  step. Its timeout (``EngineConfig.rank_timeout_s``, ``--rank-timeout``; 30 s by default) is how long
  a hung rank can stall the worker.

Failure: the worker must not hang when a rank dies or stops answering. Rank 0 has a
watchdog thread over its children (a child that exits fails the worker at once) and
a failed collective (the timeout, or a peer's closed connection) fails it too; failing
turns health NOT_SERVING through the handler the server installs, then ends the process
with ``RANK_FAILED_EXIT_CODE`` within ``EXIT_GRACE_S`` even if the model thread is stuck in
a collective. Every child watches its parent and exits when rank 0 is gone: no orphans.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.config import EngineConfig
from tandem.models.tensor_parallel import Shard

log = logging.getLogger(__name__)

# The other ranks wait on the control group between steps, idle for as long as rank 0 is.
CONTROL_TIMEOUT = timedelta(days=365)
WATCH_INTERVAL_S = 0.25
# After a failure: how long the worker gets to say NOT_SERVING and stop its server before it is ended.
EXIT_GRACE_S = 5.0
RANK_FAILED_EXIT_CODE = 75  # EX_TEMPFAIL: the orchestrator should restart the worker


@dataclass(slots=True)
class RankContext:
    """What one rank knows about the group it is in."""

    shard: Shard
    device: torch.device  # this rank's device: the CPU (gloo) or cuda:rank (NCCL)
    control: Any  # ProcessGroup of the step broadcasts
    compute: Any  # ProcessGroup of the collectives inside a forward pass
    # A forward pass keeps every rank in step: a rank this late inside one (or to take rank 0's next step)
    # is taken for dead.
    timeout: timedelta


def rank_device(device: str, rank: int) -> torch.device:
    base = torch.device(device)
    return torch.device("cuda", rank) if base.type == "cuda" else base


def join_group(rank: int, world_size: int, port: int, cfg: EngineConfig) -> RankContext:
    """Rendezvous with the other ranks (blocks until all have joined) and make both groups."""
    local = rank_device(cfg.device, rank)
    timeout = timedelta(seconds=cfg.rank_timeout_s)
    backend = "nccl" if local.type == "cuda" else "gloo"
    if local.type == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=CONTROL_TIMEOUT)
    compute = dist.new_group(list(range(world_size)), timeout=timeout, backend=backend)
    return RankContext(Shard(rank, world_size), local, dist.group.WORLD, compute, timeout)


def threads_per_rank(cfg: EngineConfig) -> int:
    """The ranks share this machine's cores unless told otherwise (on GPUs it hardly matters)."""
    return cfg.num_threads or max(1, (os.cpu_count() or 1) // cfg.tensor_parallel_size)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RankGroup:
    """Rank 0's handle on the whole group: its own context, its children, failure and shutdown."""

    def __init__(self, children: list[multiprocessing.process.BaseProcess]) -> None:
        self.children = children
        self.context: RankContext | None = None  # once every rank has joined
        self.failure: str | None = None
        self.on_failure: Callable[[str], None] | None = None  # set by the server: health NOT_SERVING, stop
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        threading.Thread(target=self._watch, name="rank-watchdog", daemon=True).start()

    @classmethod
    def start(cls, cfg: EngineConfig) -> RankGroup:
        """Spawn ranks 1..N-1 and join the group as rank 0 (returns once all have joined)."""
        from tandem.parallel.follower import run_follower

        world = cfg.tensor_parallel_size
        port = _free_port()
        spawn = multiprocessing.get_context("spawn")
        children = [
            spawn.Process(target=run_follower, args=(rank, world, port, cfg, threads_per_rank(cfg), os.getpid()),
                          name=f"tp-rank-{rank}", daemon=True)
            for rank in range(1, world)
        ]
        for child in children:
            child.start()
            log.info("tensor-parallel rank %d: pid %d", int(child.name.rsplit("-", 1)[1]), child.pid)
        # Print, too: tests and operators find the ranks by it.
        print("TANDEM_RANKS " + " ".join(f"{i + 1}={c.pid}" for i, c in enumerate(children)), flush=True)
        torch.set_num_threads(threads_per_rank(cfg))
        group = cls(children)  # watching from here on: a rank that dies before joining fails the worker too
        try:
            group.context = join_group(0, world, port, cfg)
        except BaseException:
            group._kill_children()
            raise
        return group

    @property
    def failed(self) -> bool:
        return self.failure is not None

    def fail(self, reason: str) -> None:
        """The group is broken: tell the server (NOT_SERVING), and end the process soon whatever happens."""
        with self._lock:
            if self.failure is not None or self._stopping.is_set():
                return
            self.failure = reason
        log.error("tensor-parallel worker failing: %s", reason)
        timer = threading.Timer(EXIT_GRACE_S, self.exit_now)
        timer.daemon = True
        timer.start()
        if self.on_failure is not None:
            self.on_failure(reason)

    def exit_now(self) -> None:
        """End this process at once (its model thread may be stuck in a collective): no clean-up to wait for."""
        self._kill_children()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(RANK_FAILED_EXIT_CODE)

    def stop(self, send_stop: Callable[[], None]) -> None:
        """Clean shutdown, on the model thread: ``send_stop`` tells the ranks to leave, then they are joined."""
        self._stopping.set()
        if not self.failed:
            try:
                send_stop()
            except Exception as exc:  # noqa: BLE001 - a rank already gone: nothing left to stop cleanly
                log.warning("could not tell the tensor-parallel ranks to stop: %s", exc)
        deadline = time.monotonic() + 10.0
        for child in self.children:
            child.join(max(0.1, deadline - time.monotonic()))
        self._kill_children()
        if dist.is_initialized():
            dist.destroy_process_group()

    def abort(self) -> None:
        """Start-up failed on rank 0: end the other ranks without a word."""
        self._stopping.set()
        self._kill_children()
        if dist.is_initialized():
            dist.destroy_process_group()

    def _kill_children(self) -> None:
        for child in self.children:
            if child.is_alive():
                child.kill()
        for child in self.children:
            child.join(2.0)

    def _watch(self) -> None:
        while not self._stopping.wait(WATCH_INTERVAL_S):
            for child in self.children:
                if child.exitcode is not None:
                    self.fail(f"{child.name} (pid {child.pid}) exited with code {child.exitcode}")
                    return
