"""tandem.log_follow: the lines a process adds to its log, and which of a coordinator's `tandem up` shows."""

from __future__ import annotations

from tandem.log_follow import LogFollower, coordinator_summary

STATS = "2026-12-04 14:03:36,019 INFO coordinator.stats_log: stats: 1 running, 0 waiting; 5.0 tokens/s generated"
REQUEST = "2026-12-04 14:03:37,500 INFO coordinator.service: request r-1 ok (length): 3 prompt tokens"
OTHER = "2026-12-04 14:03:38,000 INFO coordinator.workers: target worker 127.0.0.1:1 listed"


def test_only_lines_written_after_the_first_poll_and_only_whole_ones(tmp_path):
    log = tmp_path / "coordinator.log"
    log.write_text("before\n")
    follow = LogFollower(lambda: log, lambda line: line)
    assert follow.poll() == []
    with log.open("a") as f:
        f.write("one\ntw")
    assert follow.poll() == ["one"]
    with log.open("a") as f:
        f.write("o\nthree\n")
    assert follow.poll() == ["two", "three"] and follow.poll() == []


def test_a_log_written_afresh_or_a_new_file_is_followed_from_what_comes_next(tmp_path):
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    first.write_text("x" * 100 + "\n")
    current = [first]
    follow = LogFollower(lambda: current[0], lambda line: line)
    follow.poll()
    first.write_text("restarted\n")  # truncated by a restarted process, shorter than before
    assert follow.poll() == ["restarted"]
    second.write_text("old\n")
    current[0] = second
    assert follow.poll() == []  # (its start is not shown)
    with second.open("a") as f:
        f.write("new\n")
    assert follow.poll() == ["new"]
    current[0] = tmp_path / "missing.log"
    assert follow.poll() == []


def test_tandem_up_shows_the_coordinators_stats_and_request_lines_with_their_time():
    assert coordinator_summary(STATS) == "14:03:36 stats: 1 running, 0 waiting; 5.0 tokens/s generated"
    assert coordinator_summary(REQUEST) == "14:03:37 request r-1 ok (length): 3 prompt tokens"
    assert coordinator_summary(OTHER) is None and coordinator_summary("") is None
