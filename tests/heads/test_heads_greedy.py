"""Greedy output with the target's own heads (Medusa, EAGLE-3) is the target's alone; their KV follows the target's."""

from __future__ import annotations

import pytest
import torch

from tandem import inprocess
from tandem.config import EngineConfig
from tandem.engine import FINAL, FeatureSpec, ForwardItem, ModelEngine
from tandem.heads import drafters
from tandem.heads.drafters import EagleDrafter
from tandem.heads.serving import drafter_for
from tandem.inprocess import GenerationRequest, SpeculativeGenerator
from tandem.sampling import SamplingParams
from tandem.spec.heads_payoff import PLAIN
from tandem.spec.options import SpecOptions
from tandem.spec.transport import FittedCost
from target_worker.engine import PrefillCall, Proposed, ReleaseCall, TargetEngine, VerifyCall
from tests.heads.tiny_heads import tiny_heads

PROMPTS = [[5, 17, 33], [9, 9, 9, 9, 9, 9, 9, 9], list(range(10, 40)), [61]]


def load(model_dir, dtype: str) -> ModelEngine:
    return ModelEngine.load(EngineConfig(model_dir, dtype=dtype, kv_cache_tokens=4096, block_size=4))


GREEDY = SamplingParams()


def run(target: ModelEngine, method: str, heads=None, n: int = 40, sampling: SamplingParams = GREEDY,
        **options) -> list:
    if heads is not None:
        options.setdefault("heads_nodes", 6)  # fixed: the cost-chosen budget depends on this machine's timings
    spec = SpecOptions(method, 4 if method != "none" else 0, **options)
    requests = [GenerationRequest(p, max_new_tokens=n, sampling=sampling) for p in PROMPTS]
    return SpeculativeGenerator(target, None, spec, heads=heads).generate(requests)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def target(request, tiny_qwen2_dir):
    return load(tiny_qwen2_dir, request.param)


@pytest.fixture(scope="module")
def plain(target):
    return [r.token_ids for r in run(target, "none")]


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_heads_greedy_output_is_the_targets(target, plain, kind):
    drafter = drafter_for(tiny_heads(target, kind), target)
    results = run(target, kind, drafter)
    assert [r.token_ids for r in results] == plain
    assert all(r.stats.drafted > 0 for r in results)  # the heads proposed every round they could
    assert target.kv_cache.num_free_blocks == target.kv_cache.num_blocks  # every sequence released
    if isinstance(drafter, EagleDrafter):
        assert drafter.cache.num_free_blocks == drafter.cache.num_blocks  # the head's KV too


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_heads_seeded_output_is_the_targets_seeded_output(target, kind):
    """Seeded: the target keeps its own seeded draw at each position (tandem.spec.rejection), heads or not."""
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=77)
    plain = [r.token_ids for r in run(target, "none", sampling=sampling)]
    results = run(target, kind, drafter_for(tiny_heads(target, kind), target), sampling=sampling)
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.drafted for r in results) > 0


def test_auto_with_heads_and_a_draft_model_keeps_output(target, plain, tiny_qwen2_dir, monkeypatch):
    """Random heads beside a draft that is the target itself, priced as a small draft is (a tenth of a
    step: the same tiny model would cost what the target does, and adaptive k would never draft): the
    loop probes hybrid rounds after its first heads rounds, keeps the faster way, and every token is
    still the target's."""
    monkeypatch.setattr(inprocess.LocalDraft, "fitted_cost", lambda self: FittedCost(1e-4, 1e-5))
    # and the target at fixed prices too (a step 1 ms, a row 0.01 ms): the tiny target's own fit, from its wall
    # times, made adaptive k hold the draft at 0 in some runs (four requests share a step, and the draft's catch-up
    # of each prompt, charged to all four, looked dear), and such a request never drafted
    monkeypatch.setattr(inprocess.LocalTarget, "fitted_cost", lambda self: FittedCost(1e-3, 1e-5))
    draft = load(tiny_qwen2_dir, "float32")
    drafter = drafter_for(tiny_heads(target, "eagle"), target)
    spec = SpecOptions("eagle", 4, heads_nodes=6, heads_fallback="hybrid")
    requests = [GenerationRequest(p, max_new_tokens=40, sampling=SamplingParams()) for p in PROMPTS]
    generator = SpeculativeGenerator(target, draft, spec, heads=drafter)
    results = generator.generate(requests)
    assert [r.token_ids for r in results] == plain
    assert any(r.stats.draft_wait_s > 0 for r in results)  # the draft model drafted some rounds
    generator.heads_verdicts.record("hybrid", PLAIN)  # as if the heads had lost: the next requests start hybrid
    results = generator.generate(requests)
    assert [r.token_ids for r in results] == plain
    assert all(r.stats.draft_wait_s > 0 for r in results)
    for cache in (target.kv_cache, draft.kv_cache, drafter.cache):
        assert cache.num_free_blocks == cache.num_blocks  # every sequence released on all three


def test_untrained_medusa_heads_are_accepted_on_repetitive_text(target, plain):
    """Zero-initialised blocks repeat the target's next token: right on a run of one token."""
    results = run(target, "medusa", drafter_for(tiny_heads(target, "medusa"), target))
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.accepted for r in results) > 0
    assert all(0 <= a <= 1 for r in results for a in r.stats.depth_acceptance.values())


def test_cost_chosen_budget_and_ngram_branches_keep_output(target, plain):
    drafter = drafter_for(tiny_heads(target, "eagle"), target)
    results = run(target, "eagle", drafter, heads_nodes=0, hybrid_min_match=2)
    assert [r.token_ids for r in results] == plain


def test_kv_after_a_heads_round_is_the_accepted_chains(tiny_qwen2_dir):
    """Target KV and EAGLE KV after Prefill + Verify rounds of head trees equal those of feeding the history."""
    target = load(tiny_qwen2_dir, "float32")
    drafter = drafter_for(tiny_heads(target, "eagle"), target)
    engine = TargetEngine(target, drafter=drafter)
    greedy = SamplingParams()
    result = engine.run_batch([PrefillCall("s", [9] * 8 + [3, 4, 9, 9], greedy, propose=6)])[0]
    assert isinstance(result, Proposed) and len(result.proposal.tokens) == 6
    for _ in range(4):
        seq = engine.sequences["s"]
        proposal = result.proposal
        result = engine.run_batch([VerifyCall("s", len(seq.history), proposal.tokens, [], proposal.parents,
                                              propose=6)])[0]
        assert isinstance(result, Proposed)
    history = engine.sequences["s"].history
    assert target.seq_len("s") == len(history) - 1 == drafter.length("s")

    fresh = load(tiny_qwen2_dir, "float32")
    fresh_drafter = drafter_for(drafter.head, fresh)
    engine2 = TargetEngine(fresh, drafter=fresh_drafter)
    engine2.run_batch([PrefillCall("s", history, greedy, prompt_len=12, propose=1)])  # a rebuild: every row fed
    assert fresh_drafter.length("s") == drafter.length("s")
    positions = list(range(len(history) - 1))
    for ours, theirs in ((target.kv_cache, fresh.kv_cache), (drafter.cache, fresh_drafter.cache)):
        mine, other = ours.slots("s", positions), theirs.slots("s", positions)
        for layer in range(ours.key.shape[0]):
            for pool, pool2 in ((ours.key, theirs.key), (ours.value, theirs.value)):
                torch.testing.assert_close(pool[layer].flatten(0, 1)[mine], pool2[layer].flatten(0, 1)[other],
                                           atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("budget", [2, 6, 12])
def test_eagle_drafting_skips_only_nodes_that_could_not_be_proposed(tiny_qwen2_dir, monkeypatch, budget):
    """Stopping a branch once nothing below it could rank among the budget's best leaves the proposal as is."""
    target = load(tiny_qwen2_dir, "float32")
    heads = tiny_heads(target, "eagle", seed=4)
    with torch.no_grad():
        heads.lm_head.weight.mul_(5.0)  # a surer head: its proposals reach several depths
    drafter = drafter_for(heads, target)
    engine = TargetEngine(target, drafter=drafter)
    fed_rows: list[int] = []
    forward = drafter._forward
    monkeypatch.setattr(drafter, "_forward", lambda items, hidden: fed_rows.append(hidden.shape[0]) or forward(
        items, hidden))

    def propose(prompt: list[int]) -> tuple[list[int], list[int], int]:
        fed_rows.clear()
        result = engine.run_batch([PrefillCall("s", prompt, SamplingParams(), propose=budget)])[0]
        engine.run_batch([ReleaseCall("s")])
        assert isinstance(result, Proposed) and len(result.proposal.tokens) == budget
        return result.proposal.tokens, result.proposal.parents, sum(fed_rows[1:])  # [0]: the prompt's rows

    prompts = [[5, 17, 33], list(range(10, 40)), [9] * 8]
    pruned = [propose(p) for p in prompts]
    monkeypatch.setattr(drafters, "_promising", lambda nodes, frontier, budget: frontier)  # every depth in full
    full = [propose(p) for p in prompts]
    assert [p[:2] for p in pruned] == [f[:2] for f in full]
    assert sum(p[2] for p in pruned) < sum(f[2] for f in full)  # and it did skip rows


def test_heads_for_another_target_are_refused(tiny_qwen2_dir, tiny_qwen2_other_dir):
    target, other = load(tiny_qwen2_dir, "float32"), load(tiny_qwen2_other_dir, "float32")
    with pytest.raises(Exception, match="belong to tiny"):
        drafter_for(tiny_heads(other, "medusa"), target)


def test_proposals_need_heads(tiny_qwen2_dir):
    engine = TargetEngine(load(tiny_qwen2_dir, "float32"))
    result = engine.run_batch([PrefillCall("s", [1, 2, 3], SamplingParams(), propose=4)])[0]
    assert "serves no speculation heads" in str(result)
    with pytest.raises(Exception, match="needs the target's heads"):
        SpeculativeGenerator(engine.engine, None, SpecOptions("medusa", 4))


def test_features_match_the_models_own_hidden_states(tiny_qwen2_dir):
    target = load(tiny_qwen2_dir, "float32")
    logits, features = target.forward_with_features([ForwardItem("a", [1, 2, 3, 4], num_logits=4, features=True),
                                                     ForwardItem("b", [5, 6])], FeatureSpec((FINAL, 0)))
    assert features[1] is None and features[0].shape == (4, 2 * target.config.hidden_size)
    with torch.inference_mode():
        embeds = target.model.embed_tokens(torch.tensor([1, 2, 3, 4]))
        final_logits = target.model.logits(features[0][:, : target.config.hidden_size])
    torch.testing.assert_close(features[0][:, target.config.hidden_size:], embeds)  # stream 0: the embeddings
    torch.testing.assert_close(final_logits, logits[0])  # the final state is what lm_head reads


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_heads_loaded_from_a_file_draft_and_warm_up(tiny_qwen2_dir, tmp_path, kind):
    """What a worker does with --heads: load the file, warm up (which refuses heads that propose nothing), draft."""
    from tandem.heads.serving import load_drafter
    from tandem.heads.store import save_heads

    target = load(tiny_qwen2_dir, "float32")
    save_heads(tiny_heads(target, kind), tmp_path / kind)
    drafter = load_drafter(tmp_path / kind, target)
    TargetEngine(target, drafter=drafter).warmup()
    results = run(target, kind, drafter)
    assert all(r.stats.drafted > 0 for r in results)


@pytest.mark.parametrize("layout", ["medusa", "speculators"])
def test_heads_in_a_public_layout_serve(tiny_qwen2_dir, tmp_path, layout):
    """Heads written as the Medusa project or the speculators library writes them draft; output is the target's."""
    from tandem.heads.serving import load_drafter
    from tests.heads.public_layouts import (
        EagleShape,
        eagle3_public_tensors,
        medusa_head_module,
        write_medusa,
        write_speculators_eagle3,
    )

    target = load(tiny_qwen2_dir, "float32")
    cfg = target.config
    if layout == "medusa":
        module = medusa_head_module(3, 1, cfg.hidden_size, cfg.vocab_size)
        write_medusa(tmp_path, module.state_dict(), num_heads=3, num_layers=1)
    else:
        shape = EagleShape(hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
                           head_dim=cfg.head_dim, vocab=cfg.vocab_size)
        tensors, _ = eagle3_public_tensors(shape)
        write_speculators_eagle3(tmp_path, tensors, shape, aux_layer_ids=None)  # vLLM's default layers
    drafter = load_drafter(tmp_path, target)
    assert drafter.kind == ("medusa" if layout == "medusa" else "eagle")
    TargetEngine(target, drafter=drafter).warmup()
    plain = [r.token_ids for r in run(target, "none")]
    results = run(target, drafter.kind, drafter)
    assert [r.token_ids for r in results] == plain
    assert all(r.stats.drafted > 0 for r in results)
