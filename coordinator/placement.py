"""Which replicas one request runs on, and where it goes when one fails it.

A ``Placement`` picks a target (and, when the method drafts, a draft) for a new
request and is the ``ReplicaSource`` of its failover channels
(``tandem.spec.failover``): when the target replica fails the request (gone,
hung, restarted), they ask for another one and rebuild the request's KV there
from its history; when the draft replica fails, another draft replica takes
over, or the request goes on without one (n-gram proposals). A request moves
at most ``max_moves`` times per role, so that a fault that follows it (a poison
request) ends as an error.
It also keeps each replica's count of this coordinator's requests current.

With a routing ``key`` (``coordinator.prefix_routing``: the prompt's first
blocks) every choice, the first and a move after a fault, goes to the replica
of each role likely to hold the prompt's prefix, within the bound on load; a
move for capacity (a full KV pool) goes by free KV instead, since the replica
the key favours is the one that just ran out. Every choice takes a replica
whose whole KV pool holds the request (its ``max_len``) where there is one: in
a fleet of unequal replicas, a long request goes to the larger ones.
"""

from __future__ import annotations

from coordinator.workers import RequestChannel, WorkerClient, WorkerPool
from tandem.spec.room_queue import RoomQueue


class Placement:
    def __init__(self, targets: WorkerPool, drafts: WorkerPool, uses_draft: bool, deadline: float | None,
                 max_moves: int, move_wait_s: float, on_move=None, key: bytes | None = None,
                 max_len: int = 0, priority: int = 0, arrival_time: float = 0.0, room: RoomQueue | None = None,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.targets, self.drafts = targets, drafts
        self.metadata = metadata  # the request's trace context, sent with every call on every replica (tandem.tracing)
        self.max_len = max_len  # the most tokens the request's KV may reach, told to each target (0: not said)
        self.priority = priority  # told to each target with every Prefill (GenerateRequest.priority)
        self.arrival_time = arrival_time  # when the request arrived (Unix seconds), told likewise (0: not said)
        self.room = room  # the coordinator's requests waiting for room, told likewise (RequestChannel._queued)
        self.key = key  # the prompt's routing key; None: load alone decides
        self.deadline = deadline  # the client's deadline (event-loop time), bounding every call
        self.max_moves = max_moves
        self.move_wait_s = move_wait_s  # how long a moving request waits for a healthy target
        self.on_move = on_move  # on_move(role): metrics
        # (replicas whose KV pools hold the whole request first: in a fleet of unequal ones, the larger)
        self.target: WorkerClient = targets.pick(key=key, tokens=max_len)
        self.draft: WorkerClient | None = drafts.pick(key=key, tokens=max_len) if uses_draft else None
        self.target_moves = self.draft_moves = 0
        self._entered = False

    # ----- the channels the loop starts with -----------------------------------
    def verifier(self) -> RequestChannel:
        return self.target.for_request(self.deadline, self.max_len, self.priority, self.arrival_time, self.room,
                                       self.metadata)

    def draft_channel(self) -> RequestChannel | None:
        return self.draft.for_request(self.deadline, metadata=self.metadata) if self.draft else None

    def enter(self) -> None:
        """The request runs: count it on its replicas (routing and adaptive k read the counts)."""
        self._entered = True
        for client in (self.target, self.draft):
            if client is not None:
                client.active += 1

    def leave(self) -> None:
        if self._entered:
            self._entered = False
            for client in (self.target, self.draft):
                if client is not None:
                    client.active -= 1

    # ----- ReplicaSource -----------------------------------------------------
    async def replace_target(self, faulty: bool) -> RequestChannel | None:
        if not faulty:  # capacity, not a fault: the best replica now, this one included
            return self._switch_target(self.targets.pick(tokens=self.max_len))
        if self.target_moves >= self.max_moves:
            return None
        self.target_moves += 1
        replacement = await self.targets.replacement(self.target, self.move_wait_s, key=self.key, tokens=self.max_len)
        if replacement is None:
            return None
        if self.on_move:
            self.on_move("target")
        return self._switch_target(replacement)

    async def replace_draft(self) -> RequestChannel | None:
        old, self.draft = self.draft, None
        if old is not None and self._entered:
            old.active -= 1
        if self.draft_moves >= self.max_moves:
            return None
        self.draft_moves += 1
        if self.on_move:
            self.on_move("draft")
        # No waiting for a draft: n-gram proposals carry the request meanwhile.
        replacement = await self.drafts.replacement(old, wait_s=0.0, key=self.key, tokens=self.max_len)
        if replacement is None:
            return None
        self.draft = replacement
        if self._entered:
            replacement.active += 1
        return replacement.for_request(self.deadline, metadata=self.metadata)

    def _switch_target(self, client: WorkerClient) -> RequestChannel:
        if self._entered and client is not self.target:
            self.target.active -= 1
            client.active += 1
        self.target = client
        return client.for_request(self.deadline, self.max_len, self.priority, self.arrival_time, self.room,
                                  self.metadata)
