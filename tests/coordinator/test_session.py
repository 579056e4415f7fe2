"""A request's session: stop conditions cut exactly where they occur, and streamed text is never retracted."""

from __future__ import annotations

from coordinator.session import Session, StopConditions
from tandem.sampling import SamplingParams


class CharTokenizer:
    """Token id = a character's code point (id 0 is end-of-sequence)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i)


def session(max_new=50, stop_ids=(0,), stop_strings=()) -> Session:
    return Session("r", [ord("x")], SamplingParams(), StopConditions(max_new, frozenset(stop_ids), stop_strings),
                   CharTokenizer(), "draft", 4, True, True)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_stop_token_inside_an_accepted_run_drops_the_rest():
    s = session()
    s.commit(ids("ab") + [0] + ids("cd"))
    assert s.generated == [*ids("ab"), 0] and s.finish_reason == "stop"
    assert s.final_text() == "ab"


def test_max_new_tokens_cuts_a_run():
    s = session(max_new=3)
    s.commit(ids("abcdef"))
    assert s.generated == ids("abc") and s.finish_reason == "length"


def test_stop_string_across_rounds_cuts_the_text_and_is_never_streamed():
    s = session(stop_strings=("END",))
    streamed = []
    for chunk in ("hello E", "N", "D and more"):
        s.commit(ids(chunk))
        text, _ = s.take_delta()
        streamed.append(text)
        if s.finish_reason:
            break
    assert s.finish_reason == "stop"
    assert "".join(streamed) == "hello " == s.final_text()
    assert streamed[0] == "hello "  # "E" held back: it might start the stop string


def test_deltas_reassemble_the_text_and_tokens():
    s = session()
    pieces, tokens = [], []
    for chunk in ("The ", "quick ", "fox"):
        s.commit(ids(chunk))
        text, new = s.take_delta()
        pieces.append(text)
        tokens.extend(new)
    s.commit([0])
    text, new = s.take_delta()
    pieces.append(text)
    tokens.extend(new)
    assert "".join(pieces) == "The quick fox" and tokens == s.generated
