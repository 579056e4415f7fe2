"""Detokenizing one request: decode everything again per token (the old Session) against TextStream.

For outputs of 256, 1024 and 4096 tokens and one stop string (one that never
matches, so every token is checked and the request runs to its length), the
milliseconds per token of:

- ``full_redecode``: what coordinator/session.py did up to c227afb, per token:
  ``_hits_stop_string`` (decode every generated id, look for the stop string)
  then ``take_delta`` (decode every generated id again, hold back a tail);
- ``full_redecode_stop_only``: the stop-string check alone (a request that
  streams its text once per round, not per token, pays about this);
- ``text_stream``: ``TextStream.push`` then ``take`` per token.

Both sides must stream the same text (checked). The output text is this
repository's own prose and code (README.md, then tandem/**/*.py), tokenized
and cut to length. Median of --reps interleaved runs after one untimed warm-up.
No torch: only the tokenizer is loaded. The 1-minute load average before and
after is recorded: other processes on the cores inflate every figure.

    python benchmarks/detokenize.py                       # qwen-coder-1.5b and smollm2, if prepared
    python benchmarks/detokenize.py --models smollm2 --reps 1

Writes detokenize.json into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/detokenize.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import DEFAULT_RESULTS_DIR, interleaved_medians, markdown_table, write_json  # noqa: E402
from tandem.text_stream import TextStream  # noqa: E402
from tandem.tokenizer import load_tokenizer  # noqa: E402

LENGTHS = (256, 1024, 4096)
STOP = "<|end of answer|>"  # never in the corpus: every token is checked, nothing is cut


class FullRedecode:
    """coordinator/session.py's text handling up to c227afb: every check decodes all generated ids."""

    def __init__(self, tokenizer: Any, stop_strings: tuple[str, ...], stop_token_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.stop_token_ids = stop_token_ids
        self.generated: list[int] = []
        self.finish_reason: str | None = None
        self._stop_text: str | None = None
        self._emitted_text = 0

    def commit(self, token: int) -> None:
        self.generated.append(token)
        if token in self.stop_token_ids:
            self.finish_reason = "stop"
        elif self.stop_strings and self._hits_stop_string():
            self.finish_reason = "stop"

    def _hits_stop_string(self) -> bool:
        text = self.decode_generated()
        cut = min((i for s in self.stop_strings if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self._stop_text = text[:cut]
            return True
        return False

    def decode_generated(self) -> str:
        ids = [t for t in self.generated if t not in self.stop_token_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def final_text(self) -> str:
        return self._stop_text if self._stop_text is not None else self.decode_generated()

    def take_delta(self) -> str:
        text = self.final_text() if self.finish_reason else self.decode_generated()
        if not self.finish_reason:
            safe = len(text.rstrip("\ufffd"))
            for s in self.stop_strings:
                for n in range(min(len(s) - 1, safe), 0, -1):
                    if text[:safe].endswith(s[:n]):
                        safe -= n
                        break
            text = text[:safe]
        delta = text[self._emitted_text:]
        self._emitted_text = max(self._emitted_text, len(text))
        return delta


def corpus_ids(tokenizer: Any, length: int) -> list[int]:
    """``length`` ids of this repository's README and tandem sources, repeated if too short."""
    files = [_REPO_ROOT / "README.md", *sorted((_REPO_ROOT / "tandem").rglob("*.py"))]
    text = "\n".join(f.read_text(encoding="utf-8") for f in files)
    assert STOP not in text
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    while len(ids) < length:
        ids += ids
    return ids[:length]


def run_full_redecode(tokenizer: Any, ids: list[int], stop_only: bool, out: list[str]) -> None:
    session = FullRedecode(tokenizer, (STOP,), frozenset({tokenizer.eos_token_id}))
    chunks = []
    for token in ids:
        session.commit(token)
        if not stop_only:
            chunks.append(session.take_delta())
    session.finish_reason = "length"
    chunks.append(session.take_delta())
    out[:] = ["".join(chunks)]


def run_text_stream(tokenizer: Any, ids: list[int], out: list[str]) -> None:
    stream = TextStream(tokenizer, (STOP,), frozenset({tokenizer.eos_token_id}))
    chunks = []
    for token in ids:
        stream.push(token)
        chunks.append(stream.take())
    stream.finish()
    chunks.append(stream.take())
    out[:] = ["".join(chunks)]


def measure(model: str, model_dir: Path, reps: int) -> list[dict[str, Any]]:
    tokenizer = load_tokenizer(model_dir)
    records = []
    for length in LENGTHS:
        ids = corpus_ids(tokenizer, length)
        texts: dict[str, list[str]] = {"old": [], "old_stop": [], "new": []}
        seconds = interleaved_medians([
            (lambda ids=ids, texts=texts: run_full_redecode(tokenizer, ids, False, texts["old"]), None),
            (lambda ids=ids, texts=texts: run_full_redecode(tokenizer, ids, True, texts["old_stop"]), None),
            (lambda ids=ids, texts=texts: run_text_stream(tokenizer, ids, texts["new"]), None),
        ], reps=reps, warmup=1)
        assert texts["old"] == texts["old_stop"] == texts["new"], "the two ways streamed different text"
        old, old_stop, new = (s * 1000 / length for s in seconds)
        records.append({
            "model": model, "tokens": length, "chars": len(texts["new"][0]),
            "full_redecode_ms_per_token": round(old, 4),
            "full_redecode_stop_only_ms_per_token": round(old_stop, 4),
            "text_stream_ms_per_token": round(new, 4),
            "speedup": round(old / new, 1),
        })
        print(f"{model:>16} {length:>5} tokens: full re-decode {old:.4f} ms/token "
              f"(stop check only {old_stop:.4f}), TextStream {new:.4f} ms/token, {old / new:.1f}x", flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["qwen-coder-1.5b", "smollm2"],
                        help="prepared catalog names or tokenizer directories (missing ones are skipped)")
    parser.add_argument("--reps", type=int, default=3, help="timed runs per measurement (median)")
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    args = parser.parse_args(argv)

    from tandem.model_store import default_cache_root

    load_before = os.getloadavg()[0]
    records = []
    for model in args.models:
        model_dir = Path(model) if Path(model).is_dir() else default_cache_root(os.environ) / "models" / model
        if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
            print(f"skipping {model}: no tokenizer at {model_dir} (tandem models prepare {model})")
            continue
        records.extend(measure(model, model_dir, args.reps))
    if not records:
        return 1
    columns = ["model", "tokens", "full_redecode_ms_per_token", "full_redecode_stop_only_ms_per_token",
               "text_stream_ms_per_token", "speedup"]
    print(markdown_table(({k: f"{v:.4f}" if k.endswith("per_token") else v for k, v in r.items()} for r in records),
                         columns))
    settings = {"stop_string": STOP, "reps": args.reps, "lengths": list(LENGTHS),
                "window": TextStream.WINDOW, "python": platform.python_version(), "machine": platform.machine(),
                "cpus": os.cpu_count(), "load_avg_1min_before_after": [load_before, os.getloadavg()[0]]}
    path = write_json(args.out, "detokenize", {"settings": settings, "records": records})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
