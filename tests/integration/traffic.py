"""Requests that keep coming while a test changes the fleet under them."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import grpc

from tandem.client import TandemClient, build_request

MAX_ERRORS = 100  # past this many failed requests the traffic stops: the test has seen what the fleet does
ERROR_PAUSE_S = 0.05


class Traffic:
    """Greedy requests one after another on a thread, until stopped; every reply (or error) recorded.

    The requests cycle through ``prompts``. With prefix-aware placement (the coordinator's default) one
    prompt whose first block is full always goes to the replica its key prefers while that one has room, as
    it should; prompts with different first blocks spread over the replicas, as a real mix does.

    Use it as a context manager: it stops when the block ends, a failed assertion included. (A thread left
    running after its test sent requests to a stopped coordinator forever, each error kept: CI stop 33's
    pytest grew until it was killed.)
    """

    def __init__(self, address: str, prompts: Sequence[str | list[int]]) -> None:
        if not prompts:
            raise ValueError("traffic needs at least one prompt")
        self.client = TandemClient(address, timeout_s=120)
        self.prompts = list(prompts)
        self.expected: list[list[int]] = []  # each prompt's greedy tokens (``take_references``)
        self.replies: list[tuple[int, object]] = []  # (prompt index, reply), in the order answered
        self.errors: list[grpc.RpcError] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def request(self, index: int = 0):
        return self.client.generate(build_request(self.prompts[index], max_new_tokens=12, ignore_eos=True,
                                                  method="none"))

    def take_references(self) -> list:
        """One reply per prompt, before the traffic starts: the tokens every later reply must repeat."""
        replies = [self.request(i) for i in range(len(self.prompts))]
        self.expected = [list(r.token_ids) for r in replies]
        return replies

    def __enter__(self) -> Traffic:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        sent = 0
        while not self.stopped.is_set() and len(self.errors) < MAX_ERRORS:
            index = sent % len(self.prompts)
            sent += 1
            try:
                self.replies.append((index, self.request(index)))
            except grpc.RpcError as exc:
                self.errors.append(exc)
                self.stopped.wait(ERROR_PAUSE_S)  # a fleet that refuses at once is not asked in a tight loop

    def stop(self) -> None:
        """Stop sending (the request in flight finishes) and close the channel; a second call does nothing."""
        if self.client is None:
            return
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join(timeout=300)
        self.client.close()
        self.client = None

    def wrong_replies(self) -> list[int]:
        """Positions of the replies whose tokens differ from their prompt's reference."""
        return [n for n, (index, reply) in enumerate(self.replies) if list(reply.token_ids) != self.expected[index]]

    def workers(self, start: int = 0) -> set[str]:
        """The target workers that answered the replies from position ``start`` on."""
        return {reply.stats.target_worker for _, reply in self.replies[start:]}


def until(predicate, timeout_s: float = 300.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def until_used(traffic: Traffic, address: str, timeout_s: float = 120.0) -> bool:
    return until(lambda: address in traffic.workers(), timeout_s)
