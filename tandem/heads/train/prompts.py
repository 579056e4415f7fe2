"""Requests for the target to answer, made from text on this machine: the self-distillation prompts.

Heads serve chat requests: code to complete, tasks to code, text to summarize, passages to
answer from, questions, arithmetic word problems, writing, translation. The target's
answers to such requests (``tandem.heads.train.answers``) are what the heads should learn
from, and a corpus of files continued as they are is not (measured: heads trained on
site-packages code and Debian docs score 46% on held-back corpus text and 12% on the
target's own answers to Spec-Bench). The prompts are built from the same licensed text
as the default corpus (``tandem.heads.train.sources``), so they never contain HumanEval,
Spec-Bench or the standard library; the arithmetic problems are generated from templates.

Each kind imitates the form of a request users send, not any benchmark's items:

- ``function``: a third-party function's signature and docstring, to complete;
- ``coding_task``: "Write a Python function ..." from a docstring's first sentence;
- ``explain_code``: a snippet of third-party code to explain;
- ``summarize``: a passage of Debian documentation to summarize;
- ``rag``: passages of documentation, then a question to answer from them;
- ``qa``: a question about a package, from its one-line summary;
- ``math``: a word problem with seeded numbers;
- ``writing``: a blog post, an email, an announcement about a package;
- ``to_german`` then ``translate``: a documentation sentence translated to German by the
  target, whose German is then given back to translate to English (``translation_prompts``).

Everything is drawn from a seeded ``random.Random``: the same machine and seed give the same prompts.
"""

from __future__ import annotations

import ast
import random
import re
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from tandem.errors import InvalidRequestError
from tandem.heads.train.sources import CODE, DOC, SourceFile, read_texts

# Shares of the prompts per kind (``translate`` prompts come later, one per ``to_german`` answer).
KIND_SHARES = {
    "function": 0.22, "coding_task": 0.08, "explain_code": 0.05, "summarize": 0.12, "rag": 0.10,
    "qa": 0.10, "math": 0.13, "writing": 0.10, "to_german": 0.10,
}
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]+")


@dataclass(frozen=True, slots=True)
class TrainingPrompt:
    id: str  # unique in a prompt set: "<kind>-<n>"
    kind: str
    text: str


def build_prompts(sources: Sequence[SourceFile], count: int, seed: int) -> list[TrainingPrompt]:
    """``count`` prompts, ``KIND_SHARES`` of each kind, interleaved so that any prefix is a mix."""
    if count < 1:
        raise InvalidRequestError(f"heads answers: --prompts must be >= 1, got {count}")
    rng = random.Random(seed)
    code = sorted((s for s in sources if s.kind == CODE), key=lambda s: str(s.path))
    docs = sorted((s for s in sources if s.kind == DOC), key=lambda s: str(s.path))
    rng.shuffle(code)
    rng.shuffle(docs)
    makers: dict[str, Iterator[str]] = {
        # Kinds that read the same files start at different places in them, so they use different files.
        "function": _functions(code, rng), "coding_task": _coding_tasks(_rotated(code, 3), rng),
        "explain_code": _code_snippets(_rotated(code, 2), rng), "summarize": _summaries(docs, rng),
        "rag": _rag(_rotated(docs, 3), rng), "qa": _questions(code, rng), "math": _word_problems(rng),
        "writing": _writing(code, rng), "to_german": _to_german(_rotated(docs, 2), rng),
    }
    wanted = {kind: max(1, round(share * count)) for kind, share in KIND_SHARES.items()}
    prompts: list[TrainingPrompt] = []
    made = dict.fromkeys(wanted, 0)
    while len(prompts) < count and makers:
        for kind in list(makers):
            if made[kind] >= wanted[kind] or len(prompts) >= count:
                continue
            text = next(makers[kind], None)
            if text is None:
                del makers[kind]  # its sources ran out: the others fill in
                continue
            prompts.append(TrainingPrompt(f"{kind}-{made[kind]:05d}", kind, text))
            made[kind] += 1
        if all(made[k] >= wanted[k] for k in makers):
            wanted = {k: v + 1 for k, v in wanted.items()}  # a kind that ran out leaves room for the rest
    return prompts


def _rotated(files: list[SourceFile], parts: int) -> list[SourceFile]:
    cut = len(files) // parts
    return files[cut:] + files[:cut]


def translation_prompts(german: Sequence[tuple[str, str]]) -> list[TrainingPrompt]:
    """``translate`` prompts from ``(to_german id, the target's German)``: the German given back to translate."""
    prompts = []
    for source_id, text in german:
        line = " ".join(text.split())
        if 4 <= len(line.split()) <= 60 and "`" not in line:
            prompts.append(TrainingPrompt(f"translate-{source_id.split('-')[-1]}", "translate",
                                          f"Translate German to English: {line}"))
    return prompts


# ----- code ---------------------------------------------------------------------------


def _parsed(files: Sequence[SourceFile]) -> Iterator[tuple[SourceFile, str, ast.Module]]:
    for source in files:
        for text in read_texts(source):
            try:
                yield source, text, ast.parse(text)
            except (SyntaxError, ValueError, RecursionError):
                continue


def _documented_functions(files: Sequence[SourceFile], rng: random.Random
                          ) -> Iterator[tuple[SourceFile, str, ast.FunctionDef]]:
    """One public, documented top-level function per file (chosen by ``rng``)."""
    for source, text, module in _parsed(files):
        found = [node for node in module.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")
                 and len(ast.get_docstring(node) or "") >= 40 and node.body]
        if found:
            yield source, text, rng.choice(found)


def _functions(files: Sequence[SourceFile], rng: random.Random) -> Iterator[str]:
    """A function's signature and docstring, as written, for the target to complete."""
    for _, text, node in _documented_functions(files, rng):
        lines = text.splitlines()
        docstring = node.body[0]
        head = lines[node.lineno - 1 - len(node.decorator_list): docstring.end_lineno]  # type: ignore[attr-defined]
        if 3 <= len(head) <= 40:
            yield textwrap.dedent("\n".join(head)) + "\n"


def _coding_tasks(files: Sequence[SourceFile], rng: random.Random) -> Iterator[str]:
    openings = ("Write a Python function `{name}` that does the following: {task}",
                "Develop a Python program with a function `{name}`. {task}",
                "Implement `{name}` in Python. {task} Include a short usage example.")
    for _, _, node in _documented_functions(files, rng):
        first = " ".join((ast.get_docstring(node) or "").split("\n\n")[0].split())
        if 20 <= len(first) <= 300:
            yield rng.choice(openings).format(name=node.name, task=first)


def _code_snippets(files: Sequence[SourceFile], rng: random.Random) -> Iterator[str]:
    asks = ("Explain what this Python code does:", "What does the following code do? Point out anything unusual.",
            "Review this Python code and suggest improvements:")
    for source in files:
        for text in read_texts(source):
            lines = [line for line in text.splitlines() if line.strip()]
            if len(lines) < 12:
                continue
            start = rng.randrange(0, len(lines) - 10)
            snippet = textwrap.dedent("\n".join(lines[start: start + rng.randint(10, 30)]))
            yield f"{rng.choice(asks)}\n```python\n{snippet}\n```"


def _package_summaries(files: Sequence[SourceFile]) -> Iterator[tuple[str, str]]:
    """``(distribution name, its one-line summary)``, once per distribution, in file order."""
    import importlib.metadata

    seen: set[str] = set()
    for source in files:
        name = source.origin.split()[0]
        if name in seen:
            continue
        seen.add(name)
        try:
            summary = (importlib.metadata.metadata(name).get("Summary") or "").strip()
        except importlib.metadata.PackageNotFoundError:
            continue
        if 10 <= len(summary) <= 200:
            yield name, summary.rstrip(".")


def _questions(files: Sequence[SourceFile], rng: random.Random) -> Iterator[str]:
    asks = ("What is {name}?", "What is the Python package {name} used for?", "Who would use {name}, and why?",
            "What is {lower}?", "How does {name} work?", "What are the alternatives to {name}?",
            "Is {name} still maintained, and what does it do?")
    for _ in range(3):  # three questions per package at most, each of another form
        for name, summary in _package_summaries(files):
            yield rng.choice(asks).format(name=name, lower=summary[0].lower() + summary[1:])


def _writing(files: Sequence[SourceFile], rng: random.Random) -> Iterator[str]:
    asks = ("Compose an engaging blog post about {name}, {lower}.",
            "Write a persuasive email to your team proposing to adopt {name} ({lower}).",
            "Write a short announcement of a new release of {name}: {summary}.",
            "Pretend you are the maintainer of {name}. Describe to a newcomer why it exists and what it does.",
            "Write a short poem about {lower}.",
            "Draft a professional paragraph for a project report explaining why we chose {name}.")
    for _ in range(3):
        for name, summary in _package_summaries(files):
            lower = summary[0].lower() + summary[1:]
            yield rng.choice(asks).format(name=name, summary=summary, lower=lower)


# ----- documentation ------------------------------------------------------------------


def _prose_paragraphs(text: str) -> list[str]:
    """Paragraphs that read as sentences: mostly words, ending like prose."""
    found = []
    for block in re.split(r"\n\s*\n", text):
        joined = " ".join(block.split())
        words = joined.split()
        if len(words) < 12 or joined[-1:] not in ".:!?)":
            continue
        if len(_WORD.findall(joined)) >= 0.7 * len(words) and not joined.startswith(("*", "-", "#", "|", "=")):
            found.append(joined)
    return found


def _doc_passages(files: Sequence[SourceFile], words: tuple[int, int], rng: random.Random) -> Iterator[str]:
    """A run of consecutive prose paragraphs of ``words`` words (low, high), one per file."""
    low, high = words
    for source in files:
        for text in read_texts(source):
            paragraphs = _prose_paragraphs(text)
            if not paragraphs:
                continue
            start = rng.randrange(len(paragraphs))
            passage: list[str] = []
            for paragraph in paragraphs[start:]:
                if sum(len(p.split()) for p in passage) >= low:
                    break
                passage.append(paragraph)
            text_words = " ".join(passage).split()
            if len(text_words) >= low:
                yield " ".join(text_words[:high])


def _summaries(files: Sequence[SourceFile], rng: random.Random) -> Iterator[str]:
    asks = ("Summarize: {text}", "Summarize the following text in a few sentences:\n{text}",
            "{text}\n\nTL;DR:")
    for passage in _doc_passages(files, (80, 350), rng):
        yield rng.choice(asks).format(text=passage)


def _rag(files: Sequence[SourceFile], rng: random.Random) -> Iterator[str]:
    asks = ("What does the text say about {term}?", "Describe {term} based on the passages above.",
            "According to the passages, how is {term} used?", "Explain the role of {term}.")
    passages = _doc_passages(files, (60, 160), rng)
    while True:
        chosen = [p for p in (next(passages, None) for _ in range(rng.randint(2, 3))) if p]
        if len(chosen) < 2:
            return
        words = [w for w in _WORD.findall(chosen[0]) if len(w) > 5]
        if words:
            yield " ".join(chosen) + "\n" + rng.choice(asks).format(term=rng.choice(words).lower())


def _to_german(files: Sequence[SourceFile], rng: random.Random) -> Iterator[str]:
    for source in files:
        for text in read_texts(source):
            sentences = [s for p in _prose_paragraphs(text) for s in re.split(r"(?<=[.!?])\s+", p)
                         if 8 <= len(s.split()) <= 35]
            if sentences:
                yield f"Translate English to German: {rng.choice(sentences)}"


# ----- arithmetic ---------------------------------------------------------------------

_NAMES = ("Ava", "Ben", "Chloe", "Daniel", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Kemi", "Liam",
          "Maya", "Noah", "Olga", "Priya", "Quinn", "Rosa", "Sam", "Tariq")
_ITEMS = ("notebook", "apple", "ticket", "shirt", "book", "candle", "plant", "mug", "cable", "lamp")


def _word_problems(rng: random.Random) -> Iterator[str]:
    forms: list[Callable[[random.Random, str, str], str]] = [
        lambda r, n, i: (f"{n} buys {r.randint(2, 12)} {i}s at ${r.randint(2, 40)} each and pays with a "
                         f"${r.choice((100, 200, 500))} bill. How much change does {n} get?"),
        lambda r, n, i: (f"A store sells {i}s for ${r.randint(5, 90)} each. During a sale the price drops by "
                         f"{r.choice((10, 15, 20, 25, 30, 40))}%. How much do {r.randint(2, 9)} {i}s cost "
                         "in the sale?"),
        lambda r, n, i: (f"{n} reads {r.randint(5, 40)} pages a day for {r.randint(2, 9)} days, then "
                         f"{r.randint(5, 40)} pages a day for {r.randint(2, 9)} days. How many pages is that?"),
        lambda r, n, i: (f"A train travels at {r.randint(40, 120)} km per hour for {r.randint(1, 5)} hours and then "
                         f"at {r.randint(40, 120)} km per hour for {r.randint(1, 5)} hours. What is the total "
                         "distance and the average speed?"),
        lambda r, n, i: (f"{n} is {r.randint(6, 40)} years old. Their sister is {r.randint(2, 15)} years older, and "
                         "their brother is half the sister's age. How old is the brother?"),
        lambda r, n, i: (f"Solve for x: {r.randint(2, 15)}x + {r.randint(1, 60)} = {r.randint(61, 300)}."),
        lambda r, n, i: (f"If {r.randint(3, 30)} people are in a room and each shakes hands with everyone else once, "
                         "how many handshakes happen?"),
        lambda r, n, i: (f"{n} saves ${r.randint(5, 60)} a week. After {r.randint(3, 20)} weeks {n} spends "
                         f"{r.choice((20, 25, 40, 50))}% of the savings on a {i}. How much is left?"),
        lambda r, n, i: (f"What is the area of a rectangle {r.randint(2, 30)} m long and {r.randint(2, 30)} m "
                         "wide, and how much fencing goes around it?"),
        lambda r, n, i: (f"A recipe needs {r.randint(2, 6)} cups of flour for {r.randint(8, 24)} cookies. How many "
                         f"cups are needed for {r.randint(30, 120)} cookies?"),
        lambda r, n, i: (f"What is the sum of the first {r.randint(5, 60)} odd numbers?"),
        lambda r, n, i: (f"A tank holds {r.randint(50, 500)} liters. {n} drains {r.randint(10, 49)} liters, then "
                         f"fills {r.choice((10, 20, 50))}% of what is left back in. How much is in the tank now?"),
    ]
    while True:
        yield rng.choice(forms)(rng, rng.choice(_NAMES), rng.choice(_ITEMS))
