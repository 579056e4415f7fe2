"""Priority scheduling through real processes: a request of a higher priority that arrives at a full target starts
ahead of running lower ones, which are preempted and finish later with their own output.

A cluster of its own, as the fault tests have (tests/integration/test_faults.py): one target with a pool small
enough to fill, and a coordinator started with ``--scheduling-policy priority``. Two long low-priority streams
grow until the pool's free blocks cannot hold the urgent prompt; under FCFS it would start only when one of them
ends (hundreds of tokens later). With priorities it keeps its place at the target, a low stream is refused as it
grows and preempted, and the urgent answer ends while both low streams still run. Ordering, not timing, is asserted.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from tandem.client import TandemClient, build_request
from tests.integration.faults import assert_kv_whole, local_cluster
from tests.references import target_only

pytestmark = pytest.mark.slow

# 128 blocks of 16 tokens. Each low stream ends at 16 + 900 tokens (58 blocks; the two fit, with their room to
# grow). The urgent prompt is sent once both have written SEND_AT tokens (39 blocks each): its 880 tokens (55
# blocks and its room) do not fit in what is left, and by then each low stream has about 300 tokens to go.
KV_CACHE_TOKENS = 2048
LOW_PROMPTS = [[(7 * i + 3 * j) % 90 + 5 for j in range(16)] for i in range(2)]
LOW_TOKENS, SEND_AT = 900, 600
URGENT_PROMPT = [(11 * j) % 90 + 5 for j in range(880)]
URGENT_TOKENS = 8


def greedy(prompt: list[int], tokens: int, priority: int):
    request = build_request(prompt, max_new_tokens=tokens, ignore_eos=True, method="none")
    request.priority = priority
    return request


def test_an_urgent_request_starts_ahead_of_running_lower_ones_and_every_output_is_exact(tiny_served_dir, tmp_path):
    alone = target_only(tiny_served_dir, LOW_PROMPTS, max_new_tokens=LOW_TOKENS, ignore_eos=True)
    alone |= target_only(tiny_served_dir, [URGENT_PROMPT], max_new_tokens=URGENT_TOKENS, ignore_eos=True)
    finished: list[str] = []  # the order the streams end in
    lock = threading.Lock()
    both_far = threading.Barrier(3)
    with local_cluster(tiny_served_dir, tmp_path, targets=1, drafts=0, kv_cache_tokens=KV_CACHE_TOKENS,
                       coordinator_args=("--scheduling-policy", "priority")) as cluster, \
            TandemClient(cluster.coordinator.address, timeout_s=300) as client:

        def low(i: int):
            tokens, stats, told = [], None, False
            for chunk in client.stream(greedy(LOW_PROMPTS[i], LOW_TOKENS, priority=1)):
                tokens.extend(chunk.token_ids)
                stats = chunk.stats if chunk.HasField("stats") else stats
                if not told and len(tokens) >= SEND_AT:
                    told = True
                    both_far.wait(timeout=120)
            with lock:
                finished.append(f"low{i}")
            return tokens, stats

        def urgent():
            both_far.wait(timeout=120)
            reply = client.generate(greedy(URGENT_PROMPT, URGENT_TOKENS, priority=0))
            with lock:
                finished.append("urgent")
            return reply

        with ThreadPoolExecutor(3) as pool:
            lows = [pool.submit(low, i) for i in range(2)]
            urgent_reply = pool.submit(urgent).result()
            low_replies = [f.result() for f in lows]

        assert finished[0] == "urgent", finished
        assert sum(stats.preemptions for _, stats in low_replies) >= 1  # a low stream made room, and came back
        assert urgent_reply.stats.preemptions == 0
        assert list(urgent_reply.token_ids) == alone[tuple(URGENT_PROMPT)]
        for prompt, (tokens, _) in zip(LOW_PROMPTS, low_replies):
            assert tokens == alone[tuple(prompt)]
        assert_kv_whole(cluster.workers("target"))
