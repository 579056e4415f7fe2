"""`tandem scale`'s requests to a running `tandem up`: what is refused, and how `tandem scale` finds it."""

from __future__ import annotations

import pytest

from tandem.cli import main
from tandem.errors import InvalidRequestError
from tandem.up_admin import parse_scale


def test_a_scale_request_keeps_what_it_leaves_out_and_defaults_the_drain_timeout():
    assert parse_scale({"target_replicas": 2}) == (2, None, 60.0)
    assert parse_scale({"draft_replicas": 0, "drain_timeout_s": 5}) == (None, 0, 5.0)


@pytest.mark.parametrize("body,complaint", [
    ([], "must be a JSON object"),
    ({"targets": 2}, "unknown fields"),
    ({"target_replicas": 0}, "target_replicas must be an integer >= 1"),
    ({"draft_replicas": -1}, "draft_replicas must be an integer >= 0"),
    ({"target_replicas": True}, "target_replicas must be an integer"),
    ({"drain_timeout_s": "soon"}, "drain_timeout_s must be a number"),
])
def test_a_bad_scale_request_is_refused_naming_the_field(body, complaint):
    with pytest.raises(InvalidRequestError, match=complaint):
        parse_scale(body)


def test_tandem_scale_without_a_running_tandem_up_says_how_to_point_it_at_one(tmp_path, capsys):
    assert main(["scale", "--port", "50999", "--cache-dir", str(tmp_path), "--target-replicas", "2"]) == 2
    assert "no running `tandem up` with its coordinator on port 50999" in capsys.readouterr().err
    assert main(["scale", "--admin", "127.0.0.1:1"]) == 2
    assert "cannot reach `tandem up` at 127.0.0.1:1" in capsys.readouterr().err
