"""What the coordinator keeps per replica (cost models per pairing, public names) is as large as the fleet,
not as its history: in Kubernetes every pod that comes back has a new address."""

from __future__ import annotations

import asyncio

from coordinator.replica_state import PairCosts, ReplicaNames
from tandem.tokenizer import tokenizer_fingerprint
from tandem.v1 import generation_pb2
from tests.coordinator.inprocess import TOKEN, fake_target, tiny_tokenizer, warm_coordinator

CYCLES = 8


def test_replicas_coming_and_going_with_new_addresses_leave_the_maps_as_large_as_the_fleet(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path)
    fingerprint = tokenizer_fingerprint(tokenizer)

    async def scenario():
        async with warm_coordinator(tokenizer) as (coordinator, _, stub):
            service, targets = coordinator.service, coordinator.targets
            request = generation_pb2.GenerateRequest(
                text="ab", stopping=generation_pb2.StoppingOptions(max_new_tokens=1),
                speculation=generation_pb2.SpeculationOptions(method="none"))
            addresses = {c.address for c in targets.clients}
            for _ in range(CYCLES):  # the pod is replaced: a new one at a new address, the old one leaves
                async with fake_target(fingerprint) as (_, _, address):
                    addresses.add(address)
                    targets.update({address})
                    while not targets.has_healthy():
                        await asyncio.sleep(0.01)
                    reply = await stub.Generate(request, timeout=5)
                    assert list(reply.token_ids) == [TOKEN]
                    assert reply.stats.target_worker.startswith("target-")
                    info = await stub.Info(generation_pb2.InfoRequest(), timeout=5)
                    assert [w.state for w in info.target_workers] == ["healthy"]
                    assert len(service.costs) == 1
                    assert len(service.public_name.names) == 1
            assert len(addresses) == CYCLES + 1
    asyncio.run(scenario())


class Replica:
    def __init__(self, role: str, address: str) -> None:
        self.role, self.address = role, address


def test_an_entry_is_dropped_once_either_replica_of_its_pair_has_left_and_names_are_stable_meanwhile():
    present = {("target", "t1"), ("target", "t2"), ("draft", "d1")}
    costs, names = PairCosts(lambda: present), ReplicaNames(False, lambda: present)
    t1, t2, d1, d2 = Replica("target", "t1"), Replica("target", "t2"), Replica("draft", "d1"), Replica("draft", "d2")
    kept = costs.get("hybrid", d1, t1)
    costs.get("ngram", None, t2)
    assert costs.get("hybrid", d1, t1) is kept  # requests of one pairing share its measurements
    assert [names(t1), names(d1), names(t2)] == ["target-0", "draft-0", "target-1"]
    present.discard(("draft", "d1"))
    present.add(("draft", "d2"))
    costs.get("hybrid", d2, t1)
    assert set(costs.models) == {("ngram", "", "t2"), ("hybrid", "d2", "t1")}
    assert names(d2) == "draft-1" and names(t1) == "target-0"
    assert set(names.names) == {("target", "t1"), ("target", "t2"), ("draft", "d2")}
