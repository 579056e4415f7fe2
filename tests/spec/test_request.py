"""A request's state: stop conditions cut exactly where they occur, and streamed text is never retracted."""

from __future__ import annotations

import pytest

from tandem.errors import InvalidRequestError
from tandem.sampling_params import SamplingParams
from tandem.spec.request import RequestState, StopConditions
from tandem.text_stream import TextStream


class CharTokenizer:
    """Token id = a character's code point (id 0 is end-of-sequence)."""

    added_tokens_decoder: dict = {}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i)


def state(max_new=50, stop_ids=(0,), stop_strings=()) -> RequestState:
    stop = StopConditions(max_new, frozenset(stop_ids), stop_strings)
    return RequestState([ord("x")], SamplingParams(), stop,
                        TextStream(CharTokenizer(), stop_strings, stop.stop_token_ids))


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_stop_token_inside_an_accepted_run_drops_the_rest():
    s = state()
    s.commit(ids("ab") + [0] + ids("cd"))
    assert s.generated == [*ids("ab"), 0] and s.finish_reason == "stop"
    assert s.text.text == "ab" and s.stats.generated == 3


def test_max_new_tokens_cuts_a_run():
    s = state(max_new=3)
    s.commit(ids("abcdef"))
    assert s.generated == ids("abc") and s.finish_reason == "length"


def test_stop_string_across_rounds_cuts_the_text_and_is_never_streamed():
    s = state(stop_strings=("END",))
    streamed = []
    for chunk in ("hello E", "N", "D and more"):
        s.commit(ids(chunk))
        streamed.append(s.text.take())
        if s.finish_reason:
            break
    assert s.finish_reason == "stop"
    assert "".join(streamed) == "hello " == s.text.text
    assert streamed[0] == "hello "  # "E" held back: it might start the stop string
    assert s.generated == ids("hello END")  # tokens up to the one that completed the stop string


def test_deltas_reassemble_the_text_and_tokens():
    s = state()
    pieces = []
    for chunk in ("The ", "quick ", "fox"):
        s.commit(ids(chunk))
        pieces.append(s.text.take())
    s.commit([0])
    pieces.append(s.text.take())
    assert "".join(pieces) == "The quick fox" and s.finish_reason == "stop"


def test_bad_stop_conditions_are_refused():
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        StopConditions(0)
    with pytest.raises(InvalidRequestError, match="empty"):
        StopConditions(5, stop_strings=("",))
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        RequestState([], SamplingParams(), StopConditions(5))
