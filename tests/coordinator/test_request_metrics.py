"""What a finished request adds to the coordinator's Prometheus metrics (``GenerationService._drive``)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from coordinator.in_flight import InFlight
from coordinator.service import GenerationService
from tandem.rpc.metrics import CoordinatorMetrics
from tandem.sampling_params import SamplingParams
from tandem.spec.request import RequestState, StopConditions
from tandem.tracing import RequestTrace


class Placement:
    def enter(self) -> None: ...

    def leave(self) -> None: ...


class Loop:
    """Three rounds of one token; the first two went without the draft (waiting to read a long prompt)."""

    def __init__(self, state: RequestState) -> None:
        self.state = state

    async def run(self):
        for round_ in range(3):
            self.state.commit([5])
            self.state.stats.draft_wait_rounds += round_ < 2
            yield


def test_a_requests_waiting_rounds_and_tokens_are_counted_when_it_ends():
    registry = CollectorRegistry()
    service = SimpleNamespace(metrics=CoordinatorMetrics(registry), in_flight=InFlight(),
                              cfg=SimpleNamespace(log_requests=False))
    state = RequestState([1, 2, 3], SamplingParams(), StopConditions(3))

    async def drive():
        run = SimpleNamespace(state=state, placement=Placement(), loop=Loop(state), trace=RequestTrace())
        async for _ in GenerationService._drive(service, run):
            pass

    asyncio.run(drive())
    assert registry.get_sample_value("tandem_coordinator_draft_wait_rounds_total") == 2
    assert registry.get_sample_value("tandem_coordinator_generated_tokens_total") == 3
    assert registry.get_sample_value("tandem_coordinator_requests_total", {"outcome": "ok"}) == 1
