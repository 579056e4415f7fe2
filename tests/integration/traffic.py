"""Requests that keep coming while a test changes the fleet under them."""

from __future__ import annotations

import threading
import time

import grpc

from tandem.client import TandemClient, build_request


class Traffic:
    """Greedy requests one after another on a thread, until stopped; every reply (or error) recorded."""

    def __init__(self, address: str, prompt: str | list[int]) -> None:
        self.client = TandemClient(address, timeout_s=120)
        self.prompt = prompt
        self.replies: list = []
        self.errors: list[grpc.RpcError] = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def request(self):
        return self.client.generate(build_request(self.prompt, max_new_tokens=12, ignore_eos=True, method="none"))

    def _run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.replies.append(self.request())
            except grpc.RpcError as exc:
                self.errors.append(exc)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=300)
        self.client.close()


def until(predicate, timeout_s: float = 300.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def until_used(traffic: Traffic, address: str) -> bool:
    return until(lambda: any(r.stats.target_worker == address for r in list(traffic.replies)))
