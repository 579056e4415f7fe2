"""TextStream: the streamed text is the full decode, never retracted, cut at stop strings, at bounded cost.

The oracle everywhere is the old quadratic way: decode every id generated so
far after each token (coordinator/session.py before TextStream).
"""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import tokenizers

from tandem.text_stream import REPLACEMENT, TextStream, decoder_skipped_ids
from tandem.tokenizer import load_tokenizer
from tests.conftest import prepared_model_dir

REPO_ROOT = Path(__file__).resolve().parents[1]

TEXTS = (
    "Hello, world! Ça va? Voilà: naïve café, crème brûlée, Ångström, smörgåsbord, Łódź, Dvořák.",
    "中文分词测试：我们今天去公园散步。日本語のテキスト、カタカナとひらがな。"
    "한국어 문장도 있습니다.",
    "Rare ideographs split into bytes: 龘靐齉爩 𠀀𠀁𪚥 鱻麤 "
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 ∀x∈ℝ: x² ≥ 0, ∑ᵢ aᵢ ≠ ∞.",
    "Emoji: 😀😃😄 👩‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️‍🔥 🧑🏽‍💻 🫠🪿 done.",
    "Combining marks: e\u0301 a\u0308 n\u0303 Z\u0324\u0354\u0367\u0311a\u0316\u0308l\u036eg\u030co\u0319.",
    "def f(x):\n    if x > 0:\n\t\treturn x  # positive\n\n\n    return -x\n\nclass A:\n    pass\n   \n",
    '{"key": "välue", "list": [1, 2, 3], "emoji": "🎉", "path": "C:\\\\tmp\\\\x"}'
    "\n  \t  trailing   ",
    "Ελληνικά, русский, עברית, العربية, हिन्दी, ไทย, Tiếng Việt, ქართული.",
)


@pytest.fixture(scope="module", params=("smollm2", "qwen-coder-1.5b"))
def tokenizer(request):
    path = prepared_model_dir(request.param)
    if path is None:
        pytest.skip(f"{request.param} not prepared: run `tandem models prepare {request.param}`")
    return load_tokenizer(path)


@pytest.fixture(scope="module")
def id_pools(tokenizer):
    """Ids to draw random sequences from: any token, tokens that decode to partial UTF-8, special tokens."""
    rng = random.Random(0)
    n = max(tokenizer.get_vocab().values()) + 1
    sample = rng.sample(range(n), 30_000)
    partial = [i for i, t in zip(sample, tokenizer.batch_decode([[i] for i in sample])) if REPLACEMENT in t]
    for text in TEXTS[1:4]:  # the byte pieces of rare characters
        partial += [i for i in tokenizer.encode(text, add_special_tokens=False)
                    if REPLACEMENT in tokenizer.decode([i])]
    assert len(partial) > 50
    return n, sorted(set(partial)), sorted(decoder_skipped_ids(tokenizer))


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def random_ids(rng: random.Random, pools, length: int, eos: int) -> list[int]:
    n, partial, special = pools
    out = []
    for _ in range(length):
        r = rng.random()
        out.append(rng.choice(partial) if r < 0.45 else rng.choice(special) if r < 0.5
                   else eos if r < 0.52 else rng.randrange(n))
    return out


def stop_prefix_length(text: str, stops) -> int:
    """Longest tail of text that is a proper prefix of a stop string: what take() may hold back."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def stopped_text(tokenizer, ids, stops, skip=frozenset()) -> str:
    """The old way: after each token decode everything; at the first stop string cut before its earliest occurrence."""
    kept = [i for i in ids if i not in skip]
    for k in range(1, len(kept) + 1):
        text = tokenizer.decode(kept[:k], skip_special_tokens=True)
        cuts = [i for s in stops if (i := text.find(s)) >= 0]
        if cuts:
            return text[:min(cuts)]
    return tokenizer.decode(kept, skip_special_tokens=True)


def check_stream(tokenizer, ids, stops=(), skip=frozenset(), take_every=1):
    """Push ids into a TextStream, comparing with full decodes after every token; return the stream and its output."""
    stream = TextStream(tokenizer, stops, skip)
    kept: list[int] = []
    emitted = ""
    stopped_at = None
    for k, token in enumerate(ids):
        hit = stream.push(token)
        if token not in skip:
            kept.append(token)
        full = tokenizer.decode(kept, skip_special_tokens=True)
        cuts = [i for s in stops if (i := full.find(s)) >= 0]
        # The stop is seen on the very token that completes it, as with a full decode.
        assert hit == bool(cuts) == stream.stopped, (k, full)
        if hit:
            stopped_at = k
            full = full[:min(cuts)]
        assert stream.text == full
        if k % take_every == 0 or hit:
            chunk = stream.take()
            bad = [i for i, c in enumerate(chunk) if c == REPLACEMENT and full[len(emitted) + i] != REPLACEMENT]
            assert not bad, f"U+FFFD at {bad} not in the full decode"
            emitted += chunk
            assert full.startswith(emitted)  # never retracted
            assert not any(s in emitted for s in stops)
            if not hit and not full.endswith(REPLACEMENT):
                # Only a tail that could still become a stop string is held back.
                assert emitted == full[:len(full) - stop_prefix_length(full, stops)]
        if hit:
            with pytest.raises(RuntimeError):
                stream.push(token)
            break
    stream.finish()
    emitted += stream.take()
    assert emitted == stream.text == full
    return stream, emitted, stopped_at


# ----- the full text, emitted exactly once ------------------------------------------------
@pytest.mark.parametrize("text", TEXTS)
def test_text_encodings_stream_exactly_the_full_decode(tokenizer, text):
    ids = encode(tokenizer, text)
    full = tokenizer.decode(ids)  # not always text: Qwen's NFC normalizer composes the combining marks
    for take_every in (1, 3, 1000):  # a caller that takes after every token, now and then, only at the end
        assert check_stream(tokenizer, ids, take_every=take_every)[1] == full


def byte_token_ids(tokenizer) -> dict[int, int]:
    """byte -> the id of the byte-level token that is just that byte (GPT-2's byte-to-character table)."""
    vocab = tokenizer.get_vocab()
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, extra = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {b: vocab[chr(c)] for b, c in zip(bs, cs) if chr(c) in vocab}  # no 0xC0, 0xC1, 0xF5-0xFF: never UTF-8


def test_text_split_into_its_bytes_streams_exactly(tokenizer):
    """Every character's bytes as separate tokens: the worst case for held-back tails."""
    byte_id = byte_token_ids(tokenizer)
    for text in TEXTS:
        assert check_stream(tokenizer, [byte_id[b] for b in text.encode()])[1] == text
    # bytes that never form characters: stray continuation bytes, lead bytes cut short
    junk = bytes([0x80, 0x80, 0xBF, 0xE4, 0xB8, 0x41, 0xF0, 0x9F, 0x98, 0xE4, 0xE4, 0xC3, 0x80, 0xF0]) * 3
    stream, emitted, _ = check_stream(tokenizer, [byte_id[b] for b in junk])
    assert emitted == junk.decode("utf-8", errors="replace")


def test_random_id_sequences_stream_exactly_the_full_decode(tokenizer, id_pools):
    rng = random.Random(1)
    eos = tokenizer.eos_token_id
    for _ in range(60):
        ids = random_ids(rng, id_pools, rng.randrange(1, 80), eos)
        check_stream(tokenizer, ids, skip=frozenset({eos}), take_every=rng.choice((1, 2, 5)))


def test_special_and_skipped_ids_add_no_text(tokenizer, id_pools):
    _, _, special = id_pools
    first, *rest = encode(tokenizer, "龘")
    assert rest, "a rare character comes in byte pieces"
    for sp in special:  # dropped before the decoder runs: the bytes around them still join
        assert tokenizer.decode([first, sp, *rest], skip_special_tokens=True) == "龘"
    eos = tokenizer.eos_token_id
    ids = encode(tokenizer, "🎉 party") + [eos, special[-1], eos] + encode(tokenizer, " 龘 time")
    stream, emitted, _ = check_stream(tokenizer, ids, skip=frozenset({eos}))
    assert emitted == "🎉 party 龘 time"


# ----- stop strings ------------------------------------------------------------------------
def test_stop_strings_cut_at_the_first_occurrence(tokenizer):
    cases = [
        (TEXTS[5], ("return -x",)),  # spans several tokens
        (TEXTS[5], ("\n\n\n",)),
        (TEXTS[1], ("公园散",)),
        (TEXTS[3], ("👧‍👦",)),  # inside a ZWJ sequence made of byte pieces
        (TEXTS[2], ("𪚥",)),
        (TEXTS[0], ("crème brûlée", "crème")),  # one stop string is a prefix of another
        (TEXTS[0], ("crème", "crème brûlée")),
        (TEXTS[0], ("brûlée, Å", "café", "never there")),  # the earliest wins, not the first listed
        (TEXTS[0], ("never there", "Nor this")),
        ("The answer is 42.\nEND OF TEXT and more", ("END OF", "END", "\nEND")),
    ]
    for text, stops in cases:
        ids = encode(tokenizer, text)
        assert tokenizer.decode(ids) == text
        stream, emitted, stopped_at = check_stream(tokenizer, ids, stops)
        cut = min((i for s in stops if (i := text.find(s)) >= 0), default=len(text))
        assert emitted == text[:cut]
        assert stream.stopped == (cut < len(text)) == (stopped_at is not None)


def test_random_stop_strings_on_texts_and_random_ids(tokenizer, id_pools):
    rng = random.Random(2)
    eos = tokenizer.eos_token_id
    sequences = [encode(tokenizer, t) for t in TEXTS]
    sequences += [random_ids(rng, id_pools, 60, eos) for _ in range(20)]
    for ids in sequences:
        full = tokenizer.decode([i for i in ids if i != eos], skip_special_tokens=True)
        for _ in range(4):
            stops = []
            for _ in range(rng.randrange(1, 4)):
                start = rng.randrange(len(full))
                s = full[start:start + rng.randrange(1, 13)].replace(REPLACEMENT, "")
                if s:
                    stops.append(s)
                    if len(s) > 2 and rng.random() < 0.5:
                        stops.append(s[:rng.randrange(1, len(s))])  # a prefix of another stop string
            rng.shuffle(stops)
            _, emitted, _ = check_stream(tokenizer, ids, tuple(stops), frozenset({eos}), rng.choice((1, 3)))
            assert emitted == stopped_text(tokenizer, ids, stops, frozenset({eos}))


def test_the_first_stop_string_to_complete_ends_the_text(tokenizer):
    """A longer stop string that began earlier but is not complete yet does not count: generation stops now."""
    text = "x = 1 </answer> and more"
    stream, emitted, _ = check_stream(tokenizer, encode(tokenizer, text), ("</answer>", "answer"))
    assert emitted == "x = 1 </"


def run_stream(tokenizer, text: str, stops: tuple[str, ...], include_stop: bool) -> str:
    """What a request's stream emits for ``text``'s tokens, one take() after each push."""
    stream, emitted = TextStream(tokenizer, stops, include_stop=include_stop), ""
    for token in encode(tokenizer, text):
        stopped = stream.push(token)
        emitted += stream.take()
        if stopped:
            break
    stream.finish()
    emitted += stream.take()
    assert emitted == stream.text
    return emitted


@pytest.mark.parametrize("text,stops,before,after", [
    ("The answer is 42.\nEND OF TEXT and more", ("END OF", "END", "\nEND"), "The answer is 42.",
     "The answer is 42.\nEND"),  # "\nEND" starts first and completes with "END"
    ("x = 1 </answer> and more", ("</answer>", "answer"), "x = 1 </", "x = 1 </answer"),  # the first to complete
    (TEXTS[0], ("crème", "crème brûlée"), TEXTS[0][:TEXTS[0].find("crème")],
     TEXTS[0][:TEXTS[0].find("crème") + len("crème")]),
    (TEXTS[3], ("👧‍👦",), TEXTS[3][:TEXTS[3].find("👧‍👦")], TEXTS[3][:TEXTS[3].find("👧‍👦") + len("👧‍👦")]),
    (TEXTS[0], ("never there",), TEXTS[0], TEXTS[0]),
])
def test_include_stop_ends_the_text_after_the_stop_string(tokenizer, text, stops, before, after):
    """vLLM's include_stop_str_in_output: the text ends after the stop string that ended it."""
    assert run_stream(tokenizer, text, stops, include_stop=False) == before
    assert run_stream(tokenizer, text, stops, include_stop=True) == after


def test_of_two_stop_strings_completed_by_one_token_at_one_place_the_longer_is_included(tokenizer):
    ids = encode(tokenizer, "say hello world")
    stream = TextStream(tokenizer, ("wor", "world", "xyz"), include_stop=True)
    for token in ids[:-1]:
        assert not stream.push(token)
    last = tokenizer.decode(ids[-1:])
    assert "wor" in last  # " world" is one token: it completes both stop strings at once
    assert stream.push(ids[-1]) and stream.text == "say hello world"


def test_hold_back_is_only_what_a_stop_string_needs(tokenizer):
    stream = TextStream(tokenizer, ("</answer>", "STOP"))
    for token in encode(tokenizer, "x = 1 </ans"):
        assert not stream.push(token)
    assert stream.take() == "x = 1 "  # "</ans" could still become "</answer>"
    for token in encode(tokenizer, "wer is"):
        stream.push(token)
    assert stream.take() == "</answer is"
    stream.finish()
    assert stream.take() == "" and stream.text == "x = 1 </answer is"


def test_push_after_stop_or_finish_is_refused(tokenizer):
    stream = TextStream(tokenizer, ("b",))
    hits = [stream.push(t) for t in encode(tokenizer, "a, b")]
    assert hits == [False, False, True] and stream.stopped and stream.text == "a, "
    with pytest.raises(RuntimeError):
        stream.push(encode(tokenizer, "c")[0])
    stream = TextStream(tokenizer)
    stream.push(encode(tokenizer, "a")[0])
    stream.finish()
    with pytest.raises(RuntimeError):
        stream.push(encode(tokenizer, "c")[0])
    with pytest.raises(ValueError):
        TextStream(tokenizer, ("",))


# ----- bounded work ------------------------------------------------------------------------
class CountingTokenizer:
    """The real tokenizer, recording the length of every id list passed to decode()."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_work_per_token_is_bounded(tokenizer, id_pools):
    rng = random.Random(3)
    eos = tokenizer.eos_token_id
    bound = TextStream.WINDOW + 1
    assert bound <= 16
    byte_id = byte_token_ids(tokenizer)
    for n in (200, 2000):
        long_text = "".join(rng.sample(TEXTS, len(TEXTS)) * (n // 100))
        as_bytes = [byte_id[b] for b in long_text.encode()][:n]
        for ids in (encode(tokenizer, long_text)[:n], as_bytes, random_ids(rng, id_pools, n, eos)):
            counting = CountingTokenizer(tokenizer)
            stream = TextStream(counting, ("never in this text",), frozenset({eos}))
            for token in ids:
                stream.push(token)
                stream.take()
            stream.finish()
            stream.take()
            assert len(ids) == n
            assert max(counting.lengths) <= bound  # each decode sees a small window, whatever n is
            assert len(counting.lengths) <= 1.5 * n  # one decode per token, one more per window restart
            text = tokenizer.decode([i for i in ids if i != eos], skip_special_tokens=True)
            assert stream.text == text


def test_work_stays_bounded_when_no_token_boundary_is_a_character_boundary():
    """Tokens that start and end inside characters ("中" as [e4 b8][ad e4 b8][ad e4 b8]...[ad]), like Qwen's
    b"\\x92\\xe1\\x9e" repeated in Khmer text: the window still restarts, text still streams."""
    pieces = [b"\xe4\xb8", b"\xad\xe4\xb8", b"\xad"]

    class Bridges:
        backend_tokenizer = SimpleNamespace(decoder=tokenizers.decoders.ByteLevel())

        def decode(self, ids, skip_special_tokens=True):
            return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    counting = CountingTokenizer(Bridges())
    stream, emitted = TextStream(counting), ""
    for k in range(1000):
        stream.push(0 if k == 0 else 1)
        emitted += stream.take()
        assert emitted == "中" * k
    stream.push(2)
    stream.finish()
    assert emitted + stream.take() == stream.text == "中" * 1000
    assert max(counting.lengths) <= TextStream.WINDOW + 1 and len(counting.lengths) <= 1.5 * 1001


# ----- no model needed: a byte tokenizer with tokens that split characters anywhere ---------
class ByteTokenizer:
    """Tokens are byte strings (some start or end inside a character); decode is lossy UTF-8 like byte-level BPE."""

    def __init__(self, rng: random.Random, lossy: bool = True) -> None:
        if lossy:  # what TextStream looks at to know the decode is lossy UTF-8 over joined bytes
            self.backend_tokenizer = SimpleNamespace(decoder=tokenizers.decoders.ByteLevel())
        pieces = {bytes([b]) for b in range(256)}
        for text in TEXTS:
            data = text.encode()
            for _ in range(300):
                i = rng.randrange(len(data))
                pieces.add(data[i:i + rng.randrange(1, 6)])
        self.vocab = sorted(pieces)

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.vocab[i] for i in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("lossy", (True, False), ids=("byte-level", "holding-every-trailing-FFFD"))
def test_random_byte_pieces_without_a_model(lossy):
    rng = random.Random(4)
    tok = ByteTokenizer(rng, lossy)
    index = {p: i for i, p in enumerate(tok.vocab)}
    for _ in range(300):
        if rng.random() < 0.5:  # a text cut into random pieces, or random pieces
            data, ids = rng.choice(TEXTS).encode(), []
            while data:
                n = rng.randrange(1, 6)
                while data[:n] not in index:
                    n -= 1
                ids.append(index[data[:n]])
                data = data[n:]
        else:
            ids = [rng.randrange(len(tok.vocab)) for _ in range(rng.randrange(1, 60))]
        full = tok.decode(ids)
        stops = ()
        if rng.random() < 0.5:
            starts = (rng.randrange(len(full)) for _ in range(2))
            stops = tuple(sorted({s for i in starts if REPLACEMENT not in (s := full[i:i + rng.randrange(1, 8)])}))
        _, emitted, _ = check_stream(tok, ids, stops, take_every=rng.choice((1, 4)))
        assert emitted == stopped_text(tok, ids, stops)


def test_module_imports_neither_torch_nor_numpy():
    code = "import sys, tandem.text_stream; print(sorted({'torch', 'numpy'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
