"""What a set of speculation heads is: one slotted dataclass, validated in one place, stored as JSON.

Two kinds read the target's own hidden states:

- ``medusa``: ``num_heads`` heads on the final (normed) hidden state of the row
  whose logits gave the target's next token ``b``; head ``k`` (0-based) predicts
  the token ``k + 1`` places after ``b``. Each head is ``num_res_layers``
  residual blocks then an lm_head, over the draft vocabulary: one lm_head
  shared by every head (Tandem's own: memory), or one per head (the layout
  the Medusa project publishes).
- ``eagle``: one decoder layer of its own (EAGLE-3): from the target's
  feature at a position (the concatenated residual streams ``feature_streams``,
  projected by ``fc``) and the embedding of the token after it, it predicts
  the next feature and token, and drafts autoregressively from its own
  output. It keeps a paged KV of its own beside the target's.

``draft_vocab_size`` < ``vocab_size``: the heads score only that many target ids
(``d2t`` in the weights maps a draft id to its target id), which makes an lm_head
several times cheaper where it dominates a draft step, as on a CPU.

``target_fingerprint`` (``tandem.heads.fingerprint``) ties heads to the target they
were trained for; ``target_name`` only says, in messages, which target that was.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tandem.config import ModelConfig
from tandem.errors import InvalidRequestError

KINDS = ("medusa", "eagle")
LAYOUTS = ("tandem", "medusa", "speculators")  # where a set of heads came from (tandem.heads.formats)
FINAL_STREAM = -1  # tandem.engine.FINAL: the final normed hidden state


class HeadsConfigError(InvalidRequestError):
    """A heads file that does not describe a usable set of heads (the message says what is wrong)."""


@dataclass(frozen=True, slots=True)
class HeadsConfig:
    kind: str
    hidden_size: int  # the target's hidden size (heads read its states)
    vocab_size: int  # the target's vocabulary
    draft_vocab_size: int  # ids the heads score; == vocab_size: all of them
    feature_streams: tuple[int, ...]  # tandem.engine.FeatureSpec: which hidden states make a feature
    target_fingerprint: str = ""  # "": unknown (a published layout without one); checked when present
    target_name: str = ""
    layout: str = "tandem"
    # medusa
    num_heads: int = 0
    num_res_layers: int = 1
    shared_lm_head: bool = True
    # eagle: the decoder layer's shape (attention over 2 * hidden_size inputs, MLP of intermediate_size)
    num_attention_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False
    # provenance: the training corpus, its sources and licences, the command, per-head accuracy
    training: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(message: str) -> HeadsConfigError:
            return HeadsConfigError(f"heads config: {message}")

        if self.kind not in KINDS:
            raise bad(f"kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        if self.layout not in LAYOUTS:
            raise bad(f"layout {self.layout!r}; one of {', '.join(LAYOUTS)}")
        for name in ("hidden_size", "vocab_size", "draft_vocab_size"):
            if getattr(self, name) <= 0:
                raise bad(f"{name} must be positive, got {getattr(self, name)}")
        if self.draft_vocab_size > self.vocab_size:
            raise bad(f"draft_vocab_size {self.draft_vocab_size} exceeds the target's vocabulary {self.vocab_size}")
        if not self.feature_streams:
            raise bad("feature_streams is empty: heads must read at least one hidden state")
        if self.kind == "medusa":
            if not 1 <= self.num_heads <= 16:
                raise bad(f"a medusa set needs 1..16 heads, got {self.num_heads}")
            if self.num_res_layers < 0:
                raise bad(f"num_res_layers must be >= 0, got {self.num_res_layers}")
            if self.feature_streams != (FINAL_STREAM,):
                raise bad("medusa heads read the final hidden state only (feature_streams [-1])")
        else:
            for name in ("num_attention_heads", "num_kv_heads", "head_dim", "intermediate_size"):
                if getattr(self, name) <= 0:
                    raise bad(f"an eagle head needs {name} > 0, got {getattr(self, name)}")
            if self.num_attention_heads % self.num_kv_heads:
                raise bad(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                          f"num_kv_heads {self.num_kv_heads}")

    # ----- shapes ------------------------------------------------------------
    @property
    def feature_size(self) -> int:
        """Width of one row's feature: the concatenated hidden states."""
        return self.hidden_size * len(self.feature_streams)

    def layer_config(self) -> ModelConfig:
        """The eagle decoder layer's shape as a one-layer ``ModelConfig`` (to reuse the target's layers)."""
        return ModelConfig(
            model_type="eagle3", vocab_size=self.draft_vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta, max_position_embeddings=1 << 20, tie_word_embeddings=False,
            attention_bias=self.attention_bias, rope_scaling=self.rope_scaling,
        )

    def check_target(self, target: ModelConfig, fingerprint: str, where: str) -> None:
        """Refuse heads made for another target, naming the one they belong to."""
        owner = self.target_name or "another target"
        if self.target_fingerprint and self.target_fingerprint != fingerprint:
            raise HeadsConfigError(
                f"heads {where} belong to {owner} (fingerprint {self.target_fingerprint[:12]}), "
                f"not to this target (fingerprint {fingerprint[:12]}): train heads for it with "
                "`tandem heads train`, or serve the target they were made for"
            )
        if (self.hidden_size, self.vocab_size) != (target.hidden_size, target.vocab_size):
            raise HeadsConfigError(
                f"heads {where} were made for {owner} (hidden size {self.hidden_size}, vocabulary "
                f"{self.vocab_size}); this target has hidden size {target.hidden_size}, vocabulary {target.vocab_size}"
            )
        bad_streams = [i for i in self.feature_streams if i != FINAL_STREAM and not 0 <= i <= target.num_layers]
        if bad_streams:
            raise HeadsConfigError(f"heads {where} read layers {bad_streams}; this target has {target.num_layers}")

    # ----- JSON --------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["feature_streams"] = list(self.feature_streams)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "heads config") -> HeadsConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise HeadsConfigError(f"{where}: unknown fields {unknown}")
        try:
            values = dict(data)
            values["feature_streams"] = tuple(int(i) for i in values.get("feature_streams", ()))
            return cls(**values)
        except TypeError as exc:
            raise HeadsConfigError(f"{where}: {exc}") from None

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> HeadsConfig:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise HeadsConfigError(f"cannot read heads config {path}: {exc}") from None
        return cls.from_json(data, str(path))
