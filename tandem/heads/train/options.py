"""What one training run is asked to do: one slotted dataclass, validated in one place.

``tandem heads train`` fills it from flags, ``tandem heads prepare`` from ``prepare_options``.
Everything that decides the weights is here (so a checkpoint can refuse to resume a run
asked differently); where the work goes and how it is reported is not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tandem.config import ModelConfig
from tandem.errors import InvalidRequestError
from tandem.heads.config import FINAL_STREAM, KINDS
from tandem.heads.locate import heads_root

TRAIN_DTYPES = ("auto", "float32", "bfloat16")
SMALL_VOCAB = 32768  # up to this many ids the heads score the whole vocabulary by default
LARGE_VOCAB_DRAFT = 32000  # the draft vocabulary of a larger one (Qwen's 151936) by default
# Peak AdamW learning rates. Measured on SmolLM2-135M (28k corpus tokens, 60 steps of 4 x 512, held-back top-1
# of the first head / step): EAGLE 19.6% at 3e-4, 28.1% at 1e-3, 31.0% at 3e-3; Medusa 25.4% at 1e-3, 26.3% at
# 3e-3. Runs that fit a CPU budget are short: the warm-up and the cosine tame the high peak.
DEFAULT_LR = {"medusa": 3e-3, "eagle": 3e-3}


@dataclass(frozen=True, slots=True)
class TrainOptions:
    kind: str  # medusa | eagle
    tokens: int = 110_000  # corpus tokens (train + held back) run through the target
    seq_len: int = 512
    steps: int = 350
    batch_size: int = 4  # sequences per optimizer step
    lr: float | None = None  # None: DEFAULT_LR of the kind
    warmup_steps: int = 20
    draft_vocab: int | None = None  # None: the whole vocabulary if small, else LARGE_VOCAB_DRAFT
    num_heads: int = 4  # medusa
    ttt_steps: int = 3  # eagle: draft steps trained (training-time test)
    eagle_intermediate_size: int | None = None  # None: default_eagle_intermediate_size(target)
    seed: int = 0
    train_dtype: str = "auto"  # auto: bf16 autocast on CUDA; on a CPU, timed (compute_dtype)
    held_back: float = 0.05
    checkpoint_every: int = 50

    def __post_init__(self) -> None:
        def bad(message: str) -> InvalidRequestError:
            return InvalidRequestError(f"heads training: {message}")

        if self.kind not in KINDS:
            raise bad(f"--kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        for name, low in (("tokens", 1), ("seq_len", 16), ("steps", 1), ("batch_size", 1), ("checkpoint_every", 1),
                          ("ttt_steps", 1), ("warmup_steps", 0)):
            if getattr(self, name) < low:
                raise bad(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        if self.tokens < 2 * self.seq_len:
            raise bad(f"--tokens {self.tokens} is under two sequences of --seq-len {self.seq_len}")
        if self.lr is None:
            object.__setattr__(self, "lr", DEFAULT_LR[self.kind])  # resolved once: checkpoints record the value
        if not self.lr > 0:
            raise bad(f"--lr must be positive, got {self.lr}")
        if self.draft_vocab is not None and self.draft_vocab < 2:
            raise bad(f"--draft-vocab must be >= 2, got {self.draft_vocab}")
        if not 1 <= self.num_heads <= 16:
            raise bad(f"--num-heads must be 1..16, got {self.num_heads}")
        if self.eagle_intermediate_size is not None and self.eagle_intermediate_size < 1:
            raise bad(f"--eagle-intermediate-size must be positive, got {self.eagle_intermediate_size}")
        if self.train_dtype not in TRAIN_DTYPES:
            raise bad(f"--train-dtype {self.train_dtype!r}; choose one of {', '.join(TRAIN_DTYPES)}")
        if not 0 < self.held_back < 0.5:
            raise bad(f"held-back fraction {self.held_back} outside (0, 0.5)")

    def draft_vocab_for(self, target: ModelConfig) -> int:
        if self.draft_vocab is None:
            return target.vocab_size if target.vocab_size <= SMALL_VOCAB else LARGE_VOCAB_DRAFT
        if self.draft_vocab > target.vocab_size:
            raise InvalidRequestError(
                f"heads training: --draft-vocab {self.draft_vocab} exceeds the target's vocabulary {target.vocab_size}"
            )
        return self.draft_vocab

    def eagle_intermediate_size_for(self, target: ModelConfig) -> int:
        return self.eagle_intermediate_size or default_eagle_intermediate_size(target)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def default_eagle_intermediate_size(target: ModelConfig) -> int:
    """The EAGLE layer's MLP width: a third wider than the hidden size (2048 for Qwen2.5-1.5B's 1536), at most
    the target's own. Every draft step runs it: at the target's 8960 its MLP alone (41M weights) outweighs
    its attention and a 16000-id lm_head together (33M), and training ran 168 tokens/s against 287 at 2048
    (16000 draft ids, 3 TTT steps, fp32, 2 CPU cores)."""
    width = -(-4 * target.hidden_size // 3 // 256) * 256
    return min(target.intermediate_size, width)


# `tandem heads prepare` on the catalog's target (Qwen2.5-Coder-1.5B, bf16) must fit 90 minutes on a 2-core CPU:
# the target's answers to PREPARE_ANSWERS' prompts first (self-distillation text: on the benchmark's own answers
# a head trained on 121k answer tokens guessed step 1 right 17% of the time on the Spec-Bench mix, one trained
# on 300k tokens of the machine's code and docs 12%; benchmarks/README.md), then the features pass over them
# and the training. Measured on a 2-core AMD EPYC (Zen 5, avx512_bf16), alone: answers at about 65 tokens/s
# (32 in flight), features at about 224 tokens/s, EAGLE training about 2 s a step of 4 conversations: the
# whole prepare took 76 min 33 s there (benchmarks/README.md, "`tandem heads prepare` on the target's own answers").
# Every answer token is learned (the cap on corpus tokens is far above what 1,000 answers hold); 16000 draft
# ids cover every label of such a corpus (label coverage 1.0 on 119k learned tokens).
PREPARE_COMMON: dict[str, Any] = dict(tokens=10_000_000, seq_len=1024, batch_size=4, draft_vocab=16000, seed=0,
                                      warmup_steps=20, checkpoint_every=50)


def prepare_options(kind: str) -> TrainOptions:
    """`tandem heads prepare`'s fixed settings for the catalog's target (see ``PREPARE_COMMON``)."""
    if kind == "medusa":
        return TrainOptions(kind="medusa", steps=900, num_heads=4, **PREPARE_COMMON)
    return TrainOptions(kind="eagle", steps=900, eagle_intermediate_size=2048, ttt_steps=3, **PREPARE_COMMON)


def feature_streams(kind: str, target: ModelConfig) -> tuple[int, ...]:
    """The hidden states the heads read: the final normed state (Medusa), or a low, a middle and a
    high layer's incoming residual stream (EAGLE-3, vLLM's choice: 2, L // 2, L - 3)."""
    if kind == "medusa":
        return (FINAL_STREAM,)
    layers = target.num_layers
    return (min(2, layers), layers // 2, max(0, layers - 3))


def default_out_dir(root: Path, target_name: str, kind: str) -> Path:
    """``$TANDEM_HOME/heads/<target>-<kind>``: where ``prepare`` writes, ``list`` looks and ``--heads NAME`` finds."""
    return heads_root(root) / f"{target_name}-{kind}"


def answers_root(root: Path) -> Path:
    """``$TANDEM_HOME/answers``: the target's answers ``prepare`` trains on (``tandem heads answers`` output)."""
    return root / "answers"


def default_work_dir(out: Path) -> Path:
    """Features and checkpoints beside the heads, hidden: ``<parent>/.<name>.work``."""
    return out.parent / f".{out.name}.work"


@dataclass(frozen=True, slots=True)
class AnswerSettings:
    max_new_tokens: int = 160
    batch_size: int = 32  # answers in flight; a CPU's tokens/s rises with it until compute, not reading, dominates
    max_prompt_tokens: int = 768  # longer prompts are skipped (the features pass cuts at --seq-len anyway)

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "batch_size", "max_prompt_tokens"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"heads answers: --{name.replace('_', '-')} must be >= 1, "
                                          f"got {getattr(self, name)}")

    def kv_tokens(self) -> int:
        """KV pool size for ``batch_size`` answers of the longest prompt, with a block of slack each."""
        return self.batch_size * (self.max_prompt_tokens + self.max_new_tokens + 16)


@dataclass(frozen=True, slots=True)
class PrepareAnswers:
    """The answers `tandem heads prepare` trains on: how many prompts, and how they are answered."""

    prompts: int = 1000
    seed: int = 0
    settings: AnswerSettings = field(default_factory=AnswerSettings)  # 160 new tokens, 32 in flight

    def file_name(self, target_name: str) -> str:
        """Named by what decides its rows, so that other settings never resume it."""
        return f"{target_name}-prepare-{self.prompts}-seed{self.seed}-max{self.settings.max_new_tokens}.jsonl"


PREPARE_ANSWERS = PrepareAnswers()
