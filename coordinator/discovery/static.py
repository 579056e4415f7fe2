"""Static discovery: the addresses given on the command line, once."""

from __future__ import annotations

from collections.abc import AsyncIterator


class StaticSource:
    def __init__(self, role: str, addresses: list[str]) -> None:
        self.role = role
        self.addresses = frozenset(addresses)

    async def watch(self) -> AsyncIterator[frozenset[str]]:
        yield self.addresses
