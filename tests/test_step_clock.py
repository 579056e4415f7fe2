"""Each forward's seconds on its device (tandem/step_clock.py): at once on a CPU; on CUDA from two events read once
the forward's kernels have run, never waited on but by ``settle``. CUDA's events are played by a stand-in with
``torch.cuda.Event``'s methods (record, query, synchronize, elapsed_time in milliseconds), run by the test."""

from __future__ import annotations

import torch

from tandem.config import EngineConfig
from tandem.engine import ForwardItem, ModelEngine
from tandem.step_clock import StepClock


class FakeStream:
    """One CUDA stream: events recorded in order, each done once the stream has run up to it."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self.recorded: list[FakeEvent] = []
        self.ran = 0  # events the device has passed
        self.waits = 0

    def event(self) -> FakeEvent:
        return FakeEvent(self)

    def run(self, events: int, ms_each: float) -> None:
        for event in self.recorded[self.ran:self.ran + events]:
            self.now_ms += ms_each
            event.at_ms = self.now_ms
        self.ran = min(len(self.recorded), self.ran + events)


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.at_ms = stream, None

    def record(self, stream=None) -> None:
        self.stream.recorded.append(self)

    def query(self) -> bool:
        return self.at_ms is not None

    def synchronize(self) -> None:
        self.stream.waits += 1
        self.stream.run(len(self.stream.recorded), 1.0)

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "torch raises for an event that has not run"
        return end.at_ms - self.at_ms


def test_on_a_cpu_a_forward_is_observed_when_it_returns():
    seen: list[float] = []
    clock = StepClock(torch.device("cpu"))
    mark = clock.start()
    clock.stop(mark, seen.append)
    assert len(seen) == 1 and seen[0] >= 0


def test_on_cuda_a_forward_is_observed_once_its_kernels_have_run_without_waiting_for_them():
    stream = FakeStream()
    seen: list[tuple[str, float]] = []
    clock = StepClock(torch.device("cuda"), new_event=stream.event)
    first = clock.start()
    clock.stop(first, lambda s: seen.append(("first", s)))
    assert seen == []  # queued, not run: nothing read, nothing waited on
    stream.run(2, 5.0)  # the first forward's events: 5 ms apart
    second = clock.start()  # the next forward polls
    assert seen == [("first", 0.005)]
    clock.stop(second, lambda s: seen.append(("second", s)))
    stream.run(1, 7.0)  # the second's start only: still not done
    clock.start()
    assert [name for name, _ in seen] == ["first"] and stream.waits == 0
    clock.settle()  # warm-up reads the fit at once: waits for the last, and observes in order
    assert [name for name, _ in seen] == ["first", "second"] and stream.waits == 1


class Recorded:
    """A cost fit's ``observe`` and ``seconds`` (0: the prompt's price is all its pass's time), noted."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def observe(self, tokens: int, seconds: float) -> None:
        self.seen.append((tokens, seconds))

    def seconds(self, tokens: int) -> float:
        return 0.0


def test_an_engine_prices_decode_rows_and_prompt_tokens_from_its_clock_once_they_have_run(tiny_qwen2_dir):
    engine = ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32", kv_cache_tokens=512))
    stream = FakeStream()
    engine.clock = StepClock(torch.device("cuda"), new_event=stream.event)
    engine.cost_fit, engine.prompt_cost = Recorded(), Recorded()
    decode, prompt = engine.cost_fit.seen, engine.prompt_cost.seen
    engine.forward([ForwardItem("a", [1, 2, 3, 4, 5], prompt=True)])
    engine.forward([ForwardItem("a", [6]), ForwardItem("b", [7, 8], prompt=True)])
    engine.forward([ForwardItem("a", [9])])
    assert decode == [] and prompt == []  # the device has run nothing yet
    stream.run(4, 2.0)  # the first two forwards' events
    engine.forward([ForwardItem("a", [10])])
    assert prompt == [(5, 0.002), (2, 0.002)] and decode == []  # prompt tokens priced apart from decode rows
    engine.clock.settle()
    assert decode == [(1, 0.001), (1, 0.001)]  # the two one-row decodes (the stand-in runs the rest 1 ms apart)


def test_on_a_second_gpu_the_events_record_on_that_gpu_s_stream(monkeypatch):
    """An event records on the current device's stream unless given one, and a model thread's current device is
    cuda:0: the clock names the engine's own."""
    recorded = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self, stream=None):
            recorded.append(stream)

        def query(self):
            return False

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {torch.device(device)}")
    clock = StepClock(torch.device("cuda:1"))
    clock.stop(clock.start(), lambda seconds: None)
    assert recorded == ["stream of cuda:1", "stream of cuda:1"]
