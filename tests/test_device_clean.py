"""Device mistakes caught on a CPU-only machine (issue 24).

Two tricks stand in for a GPU:

- torch's default device set to "meta" while the workers decide: a tensor made
  without naming its device is then a meta tensor, and mixing it with the
  engine's tensors fails loudly (or, indexing, gives garbage: so every result
  is compared with the same calls run without the trick). The model engine's
  own bookkeeping (``forward``'s host-side index tensors, KV moves) runs with
  the CPU default: those are host tensors by design, moved by the engine.
- logits on the meta device: nothing can be read from them, so a decision
  that syncs with the host (``.tolist()``, ``float()``, ``int()``) fails loudly.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from draft_worker.engine import DraftEngine, ProposeCall
from tandem.config import EngineConfig
from tandem.engine import ModelEngine
from tandem.rpc.distributions import decode_distributions, decode_sparse, encode_distributions
from tandem.sampling import SamplingParams
from tandem.spec.rejection import PendingVerdict, Verdict, fetch, verify, verify_tree
from tandem.spec.tree import POINT_MASS, children_of
from target_worker import engine as target_module
from target_worker.engine import PrefillCall, TargetEngine, VerifyCall

PROMPT = [3, 14, 15, 92, 65, 35, 89]
SAMPLED = SamplingParams(temperature=0.9, top_k=30, seed=11)
HOST_SIDE = ("forward", "keep_path", "rollback", "release")  # ModelEngine's bookkeeping, host tensors by design


def load(model_dir) -> ModelEngine:
    return ModelEngine.load(EngineConfig(model_dir, dtype="bfloat16", kv_cache_tokens=2048, block_size=4))


@contextmanager
def unnamed_tensors_on_meta(engine: ModelEngine) -> Iterator[None]:
    """Within: a tensor made without a device is a meta tensor, except in the engine's bookkeeping."""
    originals = {name: getattr(engine, name) for name in HOST_SIDE}

    def on_cpu(method):
        @functools.wraps(method)
        def run(*args, **kwargs):
            with torch.device("cpu"):
                return method(*args, **kwargs)
        return run

    for name, method in originals.items():
        setattr(engine, name, on_cpu(method))
    try:
        with torch.device("meta"):
            yield
    finally:
        for name in HOST_SIDE:
            delattr(engine, name)  # the instance attributes go; the class's methods show again


def ok(results: list) -> list:
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]
    return results


def q_rows(vocab: int, rows: int, seed: int) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed), device="cpu") * 3, -1)


def target_rounds(target: TargetEngine, penalties: dict | None = None) -> list:
    """Sampled and greedy Prefills in one batch, then a sampled chain, a sampled tree and a greedy tree;
    ``penalties``: SamplingParams fields every request takes too (each row adjusted: tandem.penalties)."""
    vocab = target.vocab_size
    extra = penalties or {}
    first = ok(target.run_batch([PrefillCall("chain", PROMPT, SamplingParams(0.9, top_k=30, seed=11, **extra)),
                                 PrefillCall("tree", PROMPT, SamplingParams(temperature=1.0, seed=5, **extra)),
                                 PrefillCall("greedy", PROMPT, SamplingParams(**extra))]))
    q = q_rows(vocab, 3, seed=2)
    chain = [int(t) for t in q.argmax(-1)]
    q_tree = q_rows(vocab, 2, seed=3)
    tree = [int(q_tree[0].argmax()), (int(q_tree[0].argmax()) + 1) % vocab, int(q_tree[1].argmax())]
    n = len(PROMPT) + 1
    second = ok(target.run_batch([
        VerifyCall("chain", n, chain, encode_distributions(q)),
        VerifyCall("tree", n, tree, [*encode_distributions(q_tree[:1]), POINT_MASS,
                                     *encode_distributions(q_tree[1:])], [-1, -1, 0]),
        VerifyCall("greedy", n, [5, 6, 7], [], [-1, -1, 1]),
    ]))
    return [*first, *second]


PENALTIES = {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.3,
             "logit_bias": ((5, 2.0), (14, -1.0))}


@pytest.mark.parametrize("penalties", [None, PENALTIES], ids=["plain", "penalised"])
def test_the_target_decides_without_a_tensor_off_the_engines_device(tiny_qwen2_dir, penalties):
    expected = target_rounds(TargetEngine(load(tiny_qwen2_dir)), penalties)
    target = TargetEngine(load(tiny_qwen2_dir))
    with unnamed_tensors_on_meta(target.engine):
        got = target_rounds(target, penalties)
    assert got == expected


def test_a_prompt_is_scored_without_a_tensor_off_the_engines_device(tiny_qwen2_dir):
    """prompt_logprobs: each step's rows scored where the logits are (tandem/prompt_logprobs.py)."""
    call = PrefillCall("scored", PROMPT, SamplingParams(prompt_logprobs=2))
    expected = ok(TargetEngine(load(tiny_qwen2_dir)).run_batch([call]))[0]
    target = TargetEngine(load(tiny_qwen2_dir))
    with unnamed_tensors_on_meta(target.engine):
        got = ok(target.run_batch([call]))[0]
    assert got == expected and len(got.prompt_logprobs) == len(PROMPT) - 1


def test_penalties_are_adjusted_on_the_device_without_a_read_back():
    """Meta logits: a count sized from the data (bincount) or any host read would fail here."""
    from tandem.penalties import adjust_logits, row_paths_of

    params = SamplingParams(**PENALTIES)
    logits = torch.randn(4, VOCAB, device="meta")
    out = adjust_logits(logits, params, frozenset([1, 2, 7]), [3, 3, 9], row_paths_of([4, 5, 6], [-1, 0, -1]))
    assert out.is_meta and out.shape == (4, VOCAB)


def test_warmups_run_without_a_tensor_off_the_engines_device(tiny_qwen2_dir):
    for worker in (TargetEngine(load(tiny_qwen2_dir)), DraftEngine(load(tiny_qwen2_dir))):
        with unnamed_tensors_on_meta(worker.engine):
            worker.warmup()
        assert worker.num_sequences == 0


def test_target_generators_are_made_on_the_engines_device(tiny_qwen2_dir, monkeypatch):
    made = []
    real = SamplingParams.make_generator

    def spy(self, device):  # the device must be said: a default would be the CPU
        made.append(torch.device(device))
        return real(self, device)

    monkeypatch.setattr(SamplingParams, "make_generator", spy)
    target = TargetEngine(load(tiny_qwen2_dir))
    ok(target.run_batch([PrefillCall("a", PROMPT, SAMPLED), PrefillCall("b", PROMPT, SamplingParams(1.0))]))
    assert made == [target.engine.device] * 2
    assert all(target.sequences[s].generator.device == target.engine.device for s in "ab")


@pytest.mark.parametrize("penalties", [None, PENALTIES], ids=["plain", "penalised"])
def test_draft_generators_live_with_the_rows_they_draw_from(tiny_qwen2_dir, penalties):
    """The draft draws from the decoded wire rows, which are on the host: so is its generator. Its penalised
    rows are adjusted where the logits are."""
    engines = [DraftEngine(load(tiny_qwen2_dir)) for _ in range(2)]
    sampling = SamplingParams(0.9, top_k=30, seed=11, **(penalties or {}))
    call = ProposeCall("a", 0, PROMPT, 4, sampling, alternatives=2, prompt_len=len(PROMPT))
    (expected,) = ok(engines[0].run_batch([call]))
    with unnamed_tensors_on_meta(engines[1].engine):
        (got,) = ok(engines[1].run_batch([ProposeCall("a", 0, PROMPT, 4, sampling, alternatives=2,
                                                      prompt_len=len(PROMPT))]))
    assert got == expected
    assert engines[1].sequences["a"].generator.device == torch.device("cpu")


def test_a_target_batch_decides_on_the_device_and_reads_every_verdict_with_one_fetch(tiny_qwen2_dir, monkeypatch):
    """Logits moved to meta: a read before the batch's one fetch would fail loudly."""
    target = TargetEngine(load(tiny_qwen2_dir))
    ok(target.run_batch([PrefillCall(s, PROMPT, p) for s, p in (("a", SAMPLED), ("b", SamplingParams()))]))
    real_forward = target.engine.forward
    monkeypatch.setattr(target.engine, "forward", lambda items: [rows.to("meta") for rows in real_forward(items)])
    fetched = []

    def one_fetch(verdicts):
        fetched.append(verdicts)
        assert all(isinstance(v, PendingVerdict) and v.packed.is_meta for v in verdicts)
        return [Verdict(0, 4)] * len(verdicts)  # what a device would say: nothing kept, token 4 next

    monkeypatch.setattr(target_module, "fetch", one_fetch)
    q = q_rows(target.vocab_size, 2, seed=1)
    n = len(PROMPT) + 1
    verdicts = ok(target.run_batch([VerifyCall("a", n, [int(t) for t in q.argmax(-1)], encode_distributions(q)),
                                    VerifyCall("b", n, [5, 6], [], [-1, -1])]))
    assert len(fetched) == 1 and len(fetched[0]) == 2
    assert verdicts == [Verdict(0, 4)] * 2
    assert [target.sequences[s].history[-1] for s in "ab"] == [4, 4]


# ----- the rejection sampler alone -----------------------------------------------------------

VOCAB = 12
CASES = {  # name -> (tokens, parents or None for a chain)
    "chain": ([1, 2, 3], None),
    "tree": ([1, 4, 2, 5, 3], [-1, -1, 0, 0, 2]),
    "empty": ([], None),
}


def decide(logits: torch.Tensor, tokens: list[int], parents: list[int] | None, q: torch.Tensor | None,
           params: SamplingParams, seed: int):
    generator = params.make_generator("cpu") if not params.is_greedy else None
    if generator is not None:
        generator.manual_seed(seed)
    if parents is None:
        return verify(logits, tokens, q, params, generator)
    return verify_tree(logits, tokens, children_of(parents), q, params, generator)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sampled,with_q", [(False, False), (True, False), (True, True)],
                         ids=["greedy", "sampled-point-masses", "sampled-q"])
def test_the_rejection_sampler_makes_every_tensor_on_the_logits_device(case, sampled, with_q):
    tokens, parents = CASES[case]
    logits = torch.randn(len(tokens) + 1, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    q = q_rows(VOCAB, len(tokens), seed=1) if with_q else None
    params = SamplingParams(temperature=1.0, top_p=0.9) if sampled else SamplingParams()
    for seed in range(20):
        expected = decide(logits, tokens, parents, q, params, seed).result()
        with torch.device("meta"):
            got = decide(logits, tokens, parents, q, params, seed)
        assert got.result() == expected


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_deciding_reads_nothing_back_from_the_device(case, sampled):
    """On meta logits every host read fails: a verdict is decided without one, and read by ``fetch``."""
    tokens, parents = CASES[case]
    logits = torch.randn(len(tokens) + 1, VOCAB, device="meta")
    q = torch.rand(len(tokens), VOCAB, device="meta") if sampled else None
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=5) if sampled else SamplingParams()
    verdict = decide(logits, tokens, parents, q, params, seed=0)
    assert isinstance(verdict, PendingVerdict) and verdict.packed.is_meta
    assert verdict.packed.shape == (len(tokens) + 1,)


def test_fetch_reads_a_batch_of_verdicts_with_one_copy_and_leaves_read_ones_alone(monkeypatch):
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    pending = [verify(logits, [1, 2, 3], None, SamplingParams(), None),
               verify_tree(logits, [1, 2, 3], children_of([-1, -1, 1]), None, SamplingParams(), None)]
    done = Verdict(1, 2)
    copies = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: copies.append(t.numel()) or real_tolist(t))
    verdicts = fetch([pending[0], done, pending[1]])
    assert copies == [8]  # both pending verdicts (3 nodes + the next token each), read at once
    assert verdicts[1] is done
    assert fetch(pending) == [verdicts[0], verdicts[2]] and copies == [8]  # already read: no copy again
    assert verdicts[0] == Verdict(verdicts[0].num_accepted, int(logits[verdicts[0].num_accepted].argmax()))


# ----- the draft's distributions on the target's device ---------------------------------------

def test_received_distributions_decode_on_the_host_and_densify_on_the_asked_device():
    q = q_rows(VOCAB, 3, seed=4)
    msgs = [*encode_distributions(q[:2]), POINT_MASS]
    drafted = [int(q[0].argmax()), int(q[1].argmin()), 7]
    rows = decode_sparse(msgs, VOCAB, drafted)
    dense = decode_distributions(msgs, VOCAB, drafted)
    assert rows.prob_of(drafted) == [float(dense[r, t]) for r, t in enumerate(drafted)]
    assert rows.prob_of([7, 7, 8]) == [float(dense[0, 7]), float(dense[1, 7]), 0.0]
    with torch.device("meta"):
        assert torch.equal(rows.dense("cpu"), dense)
    assert rows.dense("meta").is_meta
