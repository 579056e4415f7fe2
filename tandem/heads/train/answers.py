"""The target's own greedy answers to a list of prompts, generated in batches: self-distillation text.

Heads learn what the target says while it answers, so the best training text is the
target's own answers to requests like the ones it will serve (Medusa-2 and EAGLE train
on exactly that). A CPU computes many sequences' next tokens in one forward for little
more than one sequence's (the weights are read once), so the answers are generated
continuously batched on Tandem's engine: up to ``batch_size`` answers in flight, a new
prompt's prefill joining the batch as soon as an answer ends.

Each finished answer is appended to a JSONL file as a conversation
(``{"id", "kind", "messages": [user, assistant], "answer_tokens", "stop"}``), the
format ``tandem heads train --corpus`` reads. A run that stops keeps every answer
written; the next run with the same file skips the prompts it already holds.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.engine import ForwardItem, ModelEngine
from tandem.heads.train.options import AnswerSettings
from tandem.heads.train.prompts import TrainingPrompt
from tandem.model_convert import SILENT, Progress
from tandem.tokenizer import encode_prompt


@dataclass(slots=True)
class _Answer:
    prompt: TrainingPrompt
    ids: list[int]  # answer tokens so far
    next_token: int  # the target's greedy choice, not yet fed


def answered_ids(path: Path) -> set[str]:
    """The prompt ids ``path`` already holds answers for (a partly written last line is ignored)."""
    if not path.is_file():
        return set()
    return {row["id"] for row in read_answers(path) if isinstance(row, dict) and "id" in row}


@dataclass(slots=True)
class AnswerCount:
    written: int = 0  # answers appended by this call
    too_long: int = 0  # prompts skipped: over ``max_prompt_tokens``

    def __iadd__(self, other: AnswerCount) -> AnswerCount:
        self.written += other.written
        self.too_long += other.too_long
        return self


def generate_answers(engine: ModelEngine, tokenizer: Any, prompts: Sequence[TrainingPrompt], out: Path,
                     stop_ids: frozenset[int], settings: AnswerSettings, progress: Progress = SILENT) -> AnswerCount:
    """Append the answers ``out`` lacks."""
    done = answered_ids(out)
    count = AnswerCount()
    waiting = []  # (prompt, its chat-template ids)
    for prompt in prompts:
        if prompt.id in done:
            continue
        ids = encode_prompt(tokenizer, prompt.text, chat=True)
        if len(ids) <= settings.max_prompt_tokens:
            waiting.append((prompt, ids))
        else:
            count.too_long += 1
    waiting.reverse()  # popped from the end: the given order
    progress.stage("answers", len(waiting), "answer")
    active: dict[str, _Answer] = {}
    out.parent.mkdir(parents=True, exist_ok=True)
    _drop_partial_line(out)
    with out.open("a", encoding="utf-8") as sink:
        while waiting or active:
            decoding = list(active.values())
            admitted: list[tuple[TrainingPrompt, list[int]]] = []
            while waiting and len(decoding) + len(admitted) < settings.batch_size:
                admitted.append(waiting.pop())
            items = [ForwardItem(a.prompt.id, [a.next_token]) for a in decoding]
            items += [ForwardItem(prompt.id, ids, prompt=True) for prompt, ids in admitted]
            logits = engine.forward(items)  # [1, vocab] per item
            tokens = torch.stack([item_logits[-1] for item_logits in logits]).argmax(dim=-1).tolist()  # [items]
            for answer, token in zip(decoding, tokens):
                answer.ids.append(answer.next_token)
                answer.next_token = token
            for (prompt, _), token in zip(admitted, tokens[len(decoding):]):
                active[prompt.id] = _Answer(prompt, [], token)
            for seq in [s for s, a in active.items() if _finished(a, stop_ids, settings.max_new_tokens)]:
                answer = active.pop(seq)
                engine.release(seq)
                sink.write(json.dumps(_record(answer, tokenizer, stop_ids)) + "\n")
                sink.flush()
                count.written += 1
                progress.advance(1)
    return count


def _drop_partial_line(path: Path) -> None:
    """Cut a last line a stopped run left half written, so the next answer starts a line of its own."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def _finished(answer: _Answer, stop_ids: frozenset[int], max_new: int) -> bool:
    # A chosen stop token is never fed: the chat template writes the turn's end when training reads the answer.
    return answer.next_token in stop_ids or len(answer.ids) >= max_new


def _record(answer: _Answer, tokenizer: Any, stop_ids: frozenset[int]) -> dict[str, Any]:
    stopped = answer.next_token in stop_ids
    return {
        "id": answer.prompt.id,
        "kind": answer.prompt.kind,
        "messages": [{"role": "user", "content": answer.prompt.text},
                     {"role": "assistant", "content": tokenizer.decode(answer.ids)}],
        "answer_tokens": len(answer.ids),
        "stop": "stop_token" if stopped else "length",
    }


def read_answers(path: Path) -> list[dict[str, Any]]:
    """The complete records of an answers file (a partly written last line is skipped)."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def write_answers(target_dir: Path, out: Path, count: int, seed: int, settings: AnswerSettings, device: str = "cpu",
                  progress: Progress = SILENT) -> AnswerCount:
    """Prompts from the machine's text, the target's answers to them, then the translations back: ``out``'s rows."""
    from tandem.config import EngineConfig
    from tandem.heads.train.prompts import build_prompts, translation_prompts
    from tandem.heads.train.sources import debian_doc_files, site_packages_files
    from tandem.tokenizer import load_tokenizer, stop_token_ids

    prompts = build_prompts([*site_packages_files(), *debian_doc_files()], count, seed)  # refuses a bad count first
    engine = ModelEngine.load(EngineConfig(target_dir, device=device, kv_cache_tokens=settings.kv_tokens()))
    tokenizer = load_tokenizer(target_dir)
    stop_ids = stop_token_ids(target_dir, tokenizer, engine.config)
    # The German first, then its translation back, then the rest (interleaved by kind): a run stopped early
    # still holds every kind.
    to_german = [p for p in prompts if p.kind == "to_german"]
    total = generate_answers(engine, tokenizer, to_german, out, stop_ids, settings, progress)
    german = [(row["id"], row["messages"][1]["content"]) for row in read_answers(out)
              if row["kind"] == "to_german" and row["stop"] == "stop_token"]  # a cut-off translation is not given back
    total += generate_answers(engine, tokenizer, translation_prompts(german), out, stop_ids, settings, progress)
    rest = [p for p in prompts if p.kind != "to_german"]
    total += generate_answers(engine, tokenizer, rest, out, stop_ids, settings, progress)
    return total
