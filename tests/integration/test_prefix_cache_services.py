"""Prefix caching through the real services, on the session's shared SmolLM2 cluster (cache on by default).

Every greedy test on the shared cluster compares its output with target-only decoding computed in
process with the cache off (tests/references.py), so each of them checks "cache on equals cache off"
through services for its method (test_services.py covers none, draft, ngram, hybrid, auto and trees).
What is here: a repeated prompt is answered from the cache (its reuse in the reply's stats, the
workers' counters in Info and Prometheus), output still the reference, and every worker's KV pool back
to its baseline (every block free or evictable, none held) once the requests end.
"""

from __future__ import annotations

import time

import pytest

from tandem.client import build_request
from tests.integration.conftest import MAX_NEW_TOKENS, PROMPTS, SHARED_DTYPE
from tests.integration.test_services import metric_samples

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "hybrid"])
def test_a_repeated_prompt_reuses_cached_blocks_and_output_is_unchanged(shared_client, smollm2_reference, method):
    prompt = PROMPTS[1]
    request = build_request(prompt, chat=True, max_new_tokens=MAX_NEW_TOKENS, method=method)
    shared_client.generate(request)  # cached now, on the replica prefix placement sends this prompt to
    reply = shared_client.generate(request)
    assert list(reply.token_ids) == smollm2_reference[prompt]
    assert reply.stats.prompt_tokens_reused >= 16  # at least one full block (SmolLM2's chat template alone fills one)
    assert reply.stats.prompt_tokens_reused < reply.stats.prompt_tokens  # its last token is always computed


def test_workers_report_their_prefix_cache_and_their_kv_returns_to_baseline(shared_cluster, shared_client):
    # A fixed k: adaptive k may choose not to draft such short requests, and the draft must see this prompt.
    request = build_request(PROMPTS[2], chat=True, max_new_tokens=16, method="draft", k=4, fixed_k=True)
    for _ in range(2):
        shared_client.generate(request)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # releases are sent after the reply: wait for them to land
        workers = [*shared_client.info().target_workers, *shared_client.info().draft_workers]
        if all(w.info.free_blocks == w.info.total_blocks and not w.info.active_sequences for w in workers):
            break
        time.sleep(0.3)
    for worker in workers:
        cache = worker.info.prefix_cache
        assert worker.info.free_blocks == worker.info.total_blocks and worker.info.active_sequences == 0
        assert cache.enabled and cache.evictable_blocks == cache.cached_blocks  # nothing held, all kept
    for role in ("target", "draft"):
        caches = [w.info.prefix_cache for w in workers if w.info.role == role]
        assert sum(c.reused_tokens for c in caches) > 0 and sum(c.cached_blocks for c in caches) > 0, role
        assert all(c.reused_tokens <= c.prompt_tokens for c in caches)
    samples = {}
    for service in shared_cluster.workers("target"):
        samples.update({f"{service.address} {k}": v
                        for k, v in metric_samples(service, "tandem_target_prefix_cache").items()})
    reused = [v for k, v in samples.items() if k.endswith("tandem_target_prefix_cache_reused_tokens_total")]
    assert reused and sum(reused) > 0, samples


def test_a_conversation_s_next_turn_reuses_the_answer_and_equals_target_only(shared_cluster, shared_client,
                                                                            smollm2_dir):
    """Through the OpenAI API, as a chat client sends it: turn 2 resends turn 1's answer, and the target that
    generated it finds it cached (its committed blocks), so the reuse reaches past turn 1's prompt; the answer is
    still target-only decoding's with the cache off."""
    import openai

    from tandem.tokenizer import encode_messages, load_tokenizer
    from tests.references import target_only

    if not all(w.info.prefix_cache.generated for w in shared_client.info().target_workers):
        pytest.skip("the shared targets' weights are not packed here: they cache prompt blocks only")
    tokenizer = load_tokenizer(smollm2_dir)
    # Over 4 blocks of 16 tokens, so that both turns have the same placement key (their first 4 blocks) and go to
    # the same target replica.
    first = [{"role": "user", "content": "Here is a list of fruits: apple, banana, cherry, date, elderberry, fig, "
                                         "grape, honeydew, kiwi, lemon, mango, nectarine, orange, papaya, quince, "
                                         "raspberry. Which of them are citrus fruits, and why?"}]
    with openai.OpenAI(base_url=shared_cluster.coordinator.http_url, api_key="unused", max_retries=0,
                       timeout=120) as api:
        [card] = api.models.list().data
        one = api.chat.completions.create(model=card.id, messages=first, max_tokens=48, temperature=0)
        answer = one.choices[0].message.content
        follow_up = {"role": "user", "content": "And which are berries?"}
        second = [*first, {"role": "assistant", "content": answer}, follow_up]
        two = api.chat.completions.create(model=card.id, messages=second, max_tokens=24, temperature=0)
    first_ids, second_ids = encode_messages(tokenizer, first), encode_messages(tokenizer, second)
    assert one.usage.prompt_tokens == len(first_ids) >= 64 and two.usage.prompt_tokens == len(second_ids)
    assert one.choices[0].finish_reason == "length"  # 48 tokens of text, no stop token among them
    generated = target_only(smollm2_dir, [first_ids], dtype=SHARED_DTYPE, max_new_tokens=48)[tuple(first_ids)]
    assert answer == tokenizer.decode(generated, skip_special_tokens=True)
    # What the target holds of turn 1: its prompt and answer but the answer's last token (its KV is never computed),
    # in full blocks; the turn-2 prompt re-renders the answer as text, and shares the tokens up to where they part.
    held = [*first_ids, *generated[:-1]]
    shared = next((i for i, (a, b) in enumerate(zip(held, second_ids)) if a != b), min(len(held), len(second_ids)))
    assert shared > len(first_ids) + 16  # the answer's text re-encodes to the tokens it was generated as
    assert two.usage.prompt_tokens_details.cached_tokens == min(shared, len(second_ids) - 1) // 16 * 16
    expected = target_only(smollm2_dir, [second_ids], dtype=SHARED_DTYPE, max_new_tokens=24)[tuple(second_ids)]
    assert two.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
