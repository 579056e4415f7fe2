"""What the coordinator remembers per worker replica: its public name and the measured costs of each pairing.

Both are keyed by address. In Kubernetes a pod that comes back has a new
address, so over a coordinator's life the addresses seen grow without end;
whenever an entry is added, those of replicas no pool holds any more (the
pool keeps a leaving replica until its last request has finished) are
dropped, so the maps stay as large as the fleet, not as its history.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from tandem.spec.adaptive import CostModel

# (role, address) of every replica the pools hold now.
Present = Callable[[], set[tuple[str, str]]]
Value = TypeVar("Value")


class Replica(Protocol):
    role: str
    address: str


def _kept(entries: dict[tuple[str, ...], Value], replicas: Callable[[tuple[str, ...]], list[tuple[str, str]]],
          present: Present) -> dict[tuple[str, ...], Value]:
    """``entries`` without those naming a replica that is gone."""
    live = present()
    return {key: value for key, value in entries.items() if all(r in live for r in replicas(key))}


class ReplicaNames:
    """What replies call a worker replica: its address if the operator says so, else ``role-N``.

    N counts the distinct addresses of that role this coordinator has seen, in
    order, so a replica keeps its name while it stays in its pool, whoever
    else joins or leaves; one that left and comes back is named anew.
    ``present`` lists the replicas the pools hold (None: nothing is forgotten).
    """

    def __init__(self, expose_addresses: bool, present: Present | None = None) -> None:
        self.expose_addresses = expose_addresses
        self.present = present
        self.names: dict[tuple[str, str], str] = {}
        self.counts: dict[str, int] = {}

    def __call__(self, client: Replica | None) -> str:
        if client is None:
            return ""
        if self.expose_addresses:
            return client.address
        key = (client.role, client.address)
        if key not in self.names:
            if self.present is not None:
                self.names = _kept(self.names, lambda k: [k], self.present)
            index = self.counts.get(client.role, 0)
            self.counts[client.role] = index + 1
            self.names[key] = f"{client.role}-{index}"
        return self.names[key]


class PairCosts:
    """One ``CostModel`` per (method, draft replica, target replica): the requests of a pairing share it."""

    def __init__(self, present: Present) -> None:
        self.present = present
        self.models: dict[tuple[str, str, str], CostModel] = {}

    def __len__(self) -> int:
        return len(self.models)

    def get(self, method: str, draft: Replica | None, target: Replica) -> CostModel:
        key = (method, draft.address if draft is not None else "", target.address)
        model = self.models.get(key)
        if model is None:
            self.models = _kept(self.models, _pair, self.present)
            model = self.models[key] = CostModel()
        return model


def _pair(key: tuple[str, ...]) -> list[tuple[str, str]]:
    _, draft, target = key
    return [("target", target), *([("draft", draft)] if draft else [])]
