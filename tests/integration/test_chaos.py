"""`tandem up` under chaos: workers SIGKILLed one after another while OpenAI clients keep asking.

The long tier (`make test-long`; TANDEM_CHAOS_SECONDS, default 90): `tandem up` on SmolLM2 with two target and
two draft replicas, four clients on the official `openai` client sending greedy chat completions (whole and
streamed, every speculation method), seeded sampled completions with ``n=2``, and streams they close after a
few chunks, while a worker is killed every 4-8 seconds, at most one of a role at a time: one is killed
only when both replicas of its role have run for a while. `tandem up` restarts each.

Asserted: no request fails (a killed replica's requests move, a killed draft's go on without it), every greedy
answer is its prompt's answer before the chaos, every seeded one its seeded answer, and once the clients stop
every worker's KV pool is whole again (the cancelled streams and the killed replicas' requests freed theirs).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import grpc
import openai
import pytest

from tests.integration.faults import assert_kv_whole, worker_info
from tests.integration.test_scale_up import Output, _wait_ready

pytestmark = pytest.mark.long

PROMPTS = ["Name three rivers in Europe.", "def add(a, b):", "Write a haiku about the sea.",
           "What is a prime number?", "List four colours of the rainbow.", "Explain recursion in one sentence."]
METHODS = ["none", "draft", "ngram", "hybrid", "auto"]
CLIENTS = 4
TOKENS = 32
SETTLED_S = 10.0  # a replica is killed only when the other of its role has run this long


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Fleet:
    """The worker processes `tandem up` runs now (its workers file), and when each was first seen."""

    def __init__(self, up: subprocess.Popen, log_dir) -> None:
        self.up = up
        self.workers_file = log_dir / "workers.json"
        self.first_seen: dict[int, float] = {}

    def processes(self, role: str) -> list[int]:
        found = subprocess.run(["pgrep", "-P", str(self.up.pid), "-f", f"tandem serve {role}"], capture_output=True,
                               text=True)
        now = time.monotonic()
        pids = [int(pid) for pid in found.stdout.split()]
        for pid in pids:
            self.first_seen.setdefault(pid, now)
        return pids

    def settled(self, role: str) -> list[int]:
        """The role's processes when both have run ``SETTLED_S`` (else none: killing one could leave none)."""
        pids = self.processes(role)
        now = time.monotonic()
        return pids if len(pids) == 2 and all(now - self.first_seen[p] >= SETTLED_S for p in pids) else []

    def whole(self) -> bool:
        """Two serving replicas of each role, as the workers file lists them."""
        services = self.services()
        if [s.role for s in services].count("target") != 2 or [s.role for s in services].count("draft") != 2:
            return False
        try:
            return all(worker_info(s) is not None for s in services)
        except grpc.RpcError:  # one still starting, or gone
            return False

    def services(self) -> list[SimpleNamespace]:
        """The workers as ``assert_kv_whole`` reads them (a role and an address)."""
        addresses = json.loads(self.workers_file.read_text())
        return [SimpleNamespace(role=role, address=address) for role in ("target", "draft")
                for address in addresses.get(role, [])]


def test_killing_workers_one_at_a_time_under_load_loses_no_request_and_changes_no_answer(smollm2_dir, tmp_path):
    seconds = float(os.environ.get("TANDEM_CHAOS_SECONDS", "90"))
    http = free_port()
    log_dir = tmp_path / "logs"
    up = subprocess.Popen([sys.executable, "-m", "tandem", "up", "--target", str(smollm2_dir), "--draft",
                           str(smollm2_dir), "--target-replicas", "2", "--draft-replicas", "2", "--port", "0",
                           "--http-port", str(http), "--kv-cache-tokens", "2048", "--worker-threads", "1",
                           "--max-restarts", "1000", "--log-dir", str(log_dir), "--cache-dir", str(tmp_path / "c")],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output = Output(up)
    try:
        _wait_ready(up, output)
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused", timeout=300, max_retries=0)
        model = api.models.list().data[0].id

        def chat(prompt: str, method: str, stream: bool) -> str:
            body = {"tandem": {"method": method}, "ignore_eos": True}
            messages = [{"role": "user", "content": prompt}]
            if not stream:
                reply = api.chat.completions.create(model=model, messages=messages, max_tokens=TOKENS, temperature=0,
                                                    extra_body=body)
                return reply.choices[0].message.content
            chunks = api.chat.completions.create(model=model, messages=messages, max_tokens=TOKENS, temperature=0,
                                                 stream=True, extra_body=body)
            return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        def seeded(prompt: str, method: str) -> list[str]:
            reply = api.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0.9, seed=7, n=2,
                                           extra_body={"tandem": {"method": method}, "ignore_eos": True})
            return [choice.text for choice in sorted(reply.choices, key=lambda c: c.index)]

        greedy = {p: chat(p, "none", stream=False) for p in PROMPTS}
        sampled = {p: seeded(p, "none") for p in PROMPTS[:2]}
        stop, lock = threading.Event(), threading.Lock()
        seen = {"greedy": 0, "seeded": 0, "closed": 0}
        wrong: list[tuple] = []
        errors: list[str] = []

        def client(i: int) -> None:
            rng = random.Random(i)
            while not stop.is_set():
                prompt, method, kind = rng.choice(PROMPTS), rng.choice(METHODS), rng.random()
                try:
                    if kind < 0.15:  # a client that stops reading: it closes the stream after a few chunks
                        chunks = api.chat.completions.create(
                            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=64,
                            temperature=0, stream=True, extra_body={"tandem": {"method": method}, "ignore_eos": True})
                        for n, _ in enumerate(chunks):
                            if n >= rng.randint(1, 6):
                                break
                        chunks.close()
                        outcome, ok = "closed", True
                    elif kind < 0.3 and prompt in sampled:
                        texts = seeded(prompt, method)
                        outcome, ok = "seeded", texts == sampled[prompt]
                    else:
                        text = chat(prompt, method, stream=rng.random() < 0.5)
                        outcome, ok = "greedy", text == greedy[prompt]
                    with lock:
                        seen[outcome] += 1
                        if not ok:
                            wrong.append((outcome, prompt, method))
                except Exception as exc:  # noqa: BLE001 - every failure is collected and reported
                    with lock:
                        errors.append(f"{time.strftime('%H:%M:%S')} {method}: {type(exc).__name__}: {exc}"[:400])

        fleet = Fleet(up, log_dir)
        clients = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
        for thread in clients:
            thread.start()
        kills: list[str] = []
        rng, end = random.Random(0), time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(rng.uniform(4, 8))
            settled = {role: pids for role in ("target", "draft") if (pids := fleet.settled(role))}
            if settled:
                role = rng.choice(sorted(settled))
                victim = rng.choice(settled[role])
                os.kill(victim, signal.SIGKILL)
                kills.append(f"{time.strftime('%H:%M:%S')} {role} {victim}")
        stop.set()
        for thread in clients:
            thread.join(timeout=600)
        print(f"chaos: {len(kills)} kills ({', '.join(kills)}); answers {seen}")  # (pytest -s shows it)
        assert errors == [], (errors, kills)
        assert wrong == [], (wrong, kills)
        assert {"target", "draft"} <= {k.split()[1] for k in kills}, kills
        assert seen["greedy"] >= 20 and seen["seeded"] >= 2 and seen["closed"] >= 1, seen
        deadline = time.monotonic() + 120  # the last killed replica's restart may still be under way
        while not fleet.whole():
            assert time.monotonic() < deadline, "tandem up did not restart its workers"
            time.sleep(1)
        assert_kv_whole(fleet.services(), wait_s=60)
    finally:
        os.killpg(up.pid, signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
