"""Prefix-aware placement: a prompt's first blocks pick its replica, within a bound on load."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
from types import SimpleNamespace

import grpc
import pytest

from coordinator.placement import Placement
from coordinator.prefix_routing import KEY_BLOCKS, LOAD_FACTOR, choose, load_bound, preference, routing_key
from coordinator.service import GenerationService
from coordinator.workers import WorkerPool
from tandem.config import CoordinatorConfig, ServerOptions
from tandem.errors import InvalidRequestError
from tandem.tokenizer import tokenizer_fingerprint
from tandem.v1 import generation_pb2
from tests.coordinator.inprocess import fake_target, tiny_tokenizer, warm_coordinator
from tests.coordinator.test_workers import client

BLOCK = 16


def replica(address: str, free: int = 50, role: str = "target"):
    """A replica known only by its last Info (no channel), as the pool routes with it."""
    c = client(address, free)
    c.role, c.owner = role, ""
    return c


def keys(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [routing_key([rng.randrange(50_000) for _ in range(KEY_BLOCKS * BLOCK)]) for _ in range(n)]


# ----- the key ---------------------------------------------------------------------------------------


def test_the_key_covers_the_first_full_blocks_only():
    system = list(range(100, 100 + KEY_BLOCKS * BLOCK))
    key = routing_key(system + [1, 2, 3])
    assert key is not None
    assert routing_key(system + [9] * 500) == key  # a chat's later turn, a longer question: the same key
    assert routing_key([7] + system[1:]) != key  # its first token differs: another prefix
    assert routing_key(system[:-1] + [0]) != key  # its last keyed token differs
    assert routing_key(system[:BLOCK]) == routing_key(system[:BLOCK + 5])  # a partial block is not keyed
    assert routing_key(system[:2 * BLOCK]) != routing_key(system[:BLOCK])  # one more full block: deeper key
    assert routing_key(system[:BLOCK - 1]) is None  # no full block: no key (load decides)
    assert routing_key(system, block_size=32) != key  # (other routing blocks: another key)
    with pytest.raises(ValueError, match="block size"):
        routing_key(system, block_size=0)


# ----- rendezvous with a bound on load ---------------------------------------------------------------


def test_the_same_key_goes_to_the_same_replica_every_time():
    pool = WorkerPool("target", [replica(f"10.0.0.{i}:50052") for i in range(4)])
    for key in keys(20):
        picks = {pool.pick(key=key).address for _ in range(5)}  # no request is entered: the load stays 0
        assert len(picks) == 1
        assert picks == {preference(key, pool.clients)[0].address}


def test_keys_spread_evenly_over_replicas():
    replicas = [replica(f"10.0.0.{i}:50052") for i in range(4)]
    counts = collections.Counter(choose(key, replicas).address for key in keys(4000))
    assert set(counts) == {r.address for r in replicas}
    assert all(800 <= n <= 1200 for n in counts.values()), counts  # 1000 each expected (sd ~27)


def test_the_load_bound_moves_a_hot_keys_overflow_to_other_replicas_and_back_once_it_drains():
    replicas = [replica(f"10.0.0.{i}:50052") for i in range(3)]
    pool = WorkerPool("target", replicas)
    hot = keys(1)[0]
    favoured = preference(hot, replicas)[0]
    placed = []
    for _ in range(12):  # twelve requests of one prefix at once, none finished
        chosen = pool.pick(key=hot)
        chosen.active += 1  # what Placement.enter does
        placed.append(chosen)
        total = sum(r.active for r in replicas)
        assert max(r.active for r in replicas) <= load_bound(total - 1, len(replicas))  # never past the bound
    assert favoured.active == max(r.active for r in replicas)  # the favoured replica takes the most
    assert all(r.active > 0 for r in replicas)  # the overflow went elsewhere
    assert favoured.active <= LOAD_FACTOR * 12 / 3 + 1
    for r in placed:  # they finish
        r.active -= 1
    assert pool.pick(key=hot) is favoured  # idle again: the prefix goes home


def test_the_bound_lets_sequential_requests_of_one_prefix_stay_together():
    replicas = [replica(f"10.0.0.{i}:50052") for i in range(2)]
    hot = keys(1, seed=3)[0]
    favoured = preference(hot, replicas)[0]
    favoured.active = 1  # one request of it running, the next arrives: under the bound of ceil(1.25 * 2 / 2) = 2
    assert choose(hot, replicas) is favoured
    favoured.active = 2  # two running: the third goes to the other replica
    assert choose(hot, replicas) is not favoured


def test_removing_a_replica_moves_only_the_keys_it_held():
    replicas = [replica(f"10.0.0.{i}:50052") for i in range(5)]
    many = keys(1000, seed=1)
    before = {key: choose(key, replicas).address for key in many}
    gone = replicas[2]
    after = {key: choose(key, [r for r in replicas if r is not gone]).address for key in many}
    moved = [key for key in many if before[key] != after[key]]
    assert moved and all(before[key] == gone.address for key in moved)
    assert len(moved) == sum(1 for key in many if before[key] == gone.address)


def test_without_a_key_the_load_score_decides():
    pool = WorkerPool("target", [replica("a", 50), replica("b", 90), replica("c", 70)])
    assert routing_key(list(range(BLOCK - 1))) is None  # shorter than a block
    assert pool.pick(key=None).address == "b"  # the most free KV, as before


def test_a_keyed_pick_still_skips_unhealthy_replicas_and_the_one_to_avoid():
    replicas = [replica(f"10.0.0.{i}:50052") for i in range(3)]
    key = keys(1, seed=5)[0]
    first, second, third = preference(key, replicas)
    first.healthy = False
    assert WorkerPool("target", replicas).pick(key=key) is second
    assert WorkerPool("target", replicas).pick(avoid=second, key=key) is third
    with pytest.raises(ValueError, match="load factor"):
        choose(key, replicas, factor=0.5)


# ----- placement: both pools, and moves -------------------------------------------------------------


def test_placement_puts_target_and_draft_on_the_keys_replicas_and_a_faulty_move_on_its_next_choice():
    async def scenario():
        targets = [replica(f"10.0.0.{i}:50052") for i in range(3)]
        drafts = [replica(f"10.0.1.{i}:50053", role="draft") for i in range(3)]
        key = keys(1, seed=7)[0]
        order = preference(key, targets)
        order[2].info.free_blocks = 99  # by load the third would win: the key must decide, not the score
        placement = Placement(WorkerPool("target", targets), WorkerPool("draft", drafts), uses_draft=True,
                              deadline=None, max_moves=2, move_wait_s=0.0, key=key)
        placement.enter()
        assert placement.target is order[0]
        assert placement.draft is preference(key, drafts)[0]
        order[0].healthy = False  # it fails the request
        await placement.replace_target(faulty=True)
        assert placement.target is order[1]  # the key's next choice, so every moved request of it meets there
        await placement.replace_draft()
        assert placement.draft is preference(key, drafts)[1]
        assert await placement.replace_target(faulty=False) is not None  # a full KV pool: by load
        assert placement.target is order[2]
        placement.leave()
        assert all(c.active == 0 for c in [*targets, *drafts])

    asyncio.run(scenario())


# ----- the service and its flag --------------------------------------------------------------------


def test_the_service_keys_in_routing_blocks_whatever_the_targets_block_size_and_not_under_load_placement():
    """The chart's targets use 256-token blocks: keyed by those, a chat's key changed at every turn until its prompt
    held 1,024 tokens, and each change could move it off the replica holding its prompts and answers."""
    targets = WorkerPool("target", [replica("a")])
    targets.clients[0].info.block_size = 256
    service = SimpleNamespace(cfg=SimpleNamespace(placement="prefix"), targets=targets)
    first_turn = list(range(100, 170))  # 70 tokens: four routing blocks
    turns = [first_turn, first_turn + list(range(300)), first_turn + list(range(1500))]
    assert {GenerationService._routing_key(service, t) for t in turns} == {routing_key(first_turn)}
    assert len({routing_key(t, block_size=256) for t in turns}) == 3  # keyed by 256-token blocks: no key, 1, 4
    service.cfg.placement = "load"
    assert GenerationService._routing_key(service, first_turn) is None


@contextlib.asynccontextmanager
async def two_targets(tmp_path):
    """A coordinator over two fake target replicas, both healthy: its Generation stub."""
    tokenizer = tiny_tokenizer(tmp_path)
    async with warm_coordinator(tokenizer) as (coordinator, _, stub), \
            fake_target(tokenizer_fingerprint(tokenizer)) as (_, _, second):
        targets = coordinator.targets
        targets.update({*(c.address for c in targets.clients), second})
        while sum(c.healthy for c in targets.clients) < 2:
            await asyncio.sleep(0.01)
        yield stub


def test_through_the_service_each_prompt_stays_on_one_target_and_prompts_spread(tmp_path):
    rng = random.Random(11)
    prompts = [[rng.randrange(2, 40) for _ in range(20)] for _ in range(16)]  # one full block each

    async def scenario():
        async with two_targets(tmp_path) as stub:
            placed = collections.defaultdict(set)
            for _ in range(2):
                for i, prompt in enumerate(prompts):
                    request = generation_pb2.GenerateRequest(
                        token_ids=generation_pb2.TokenIds(ids=prompt),
                        stopping=generation_pb2.StoppingOptions(max_new_tokens=2),
                        speculation=generation_pb2.SpeculationOptions(method="none"))
                    reply = await stub.Generate(request, timeout=5)
                    placed[i].add(reply.stats.target_worker)
            assert all(len(names) == 1 for names in placed.values())  # a prompt's requests meet its cache
            assert len(set.union(*placed.values())) == 2  # different prompts use both replicas

    asyncio.run(scenario())


def test_a_clients_cache_key_puts_its_requests_on_one_target_whatever_their_prompts(tmp_path):
    """GenerateRequest.cache_key (OpenAI's prompt_cache_key): different prompts with one key meet on one replica,
    short prompts (no prefix key of their own) included; different keys spread over the replicas."""
    rng = random.Random(5)

    async def scenario():
        async with two_targets(tmp_path) as stub:
            async def target_of(key: str, length: int) -> str:
                prompt = [rng.randrange(2, 40) for _ in range(length)]
                request = generation_pb2.GenerateRequest(
                    token_ids=generation_pb2.TokenIds(ids=prompt), cache_key=key,
                    stopping=generation_pb2.StoppingOptions(max_new_tokens=2),
                    speculation=generation_pb2.SpeculationOptions(method="none"))
                return (await stub.Generate(request, timeout=5)).stats.target_worker

            for key in ("tenant-a", "tenant-b"):
                assert len({await target_of(key, length) for length in (3, 20, 40, 3, 20, 40)}) == 1
            assert len({await target_of(f"user-{i}", 20) for i in range(16)}) == 2
            with pytest.raises(grpc.aio.AioRpcError, match="cache_key: at most 256 characters"):
                await target_of("k" * 257, 3)

    asyncio.run(scenario())


def test_placement_flag_is_validated_and_passed_on_by_tandem_up():
    from tandem.cli import build_parser
    from tandem.cli.up import cluster_spec

    make = dict(server=ServerOptions(), tokenizer_dir="/models/t", target_addrs=["127.0.0.1:1"])
    assert CoordinatorConfig(**make).placement == "prefix"
    with pytest.raises(InvalidRequestError, match="--placement must be one of prefix, load, got 'nearest'"):
        CoordinatorConfig(**make, placement="nearest")
    parser = build_parser()
    assert parser.parse_args(["serve", "coordinator", "--tokenizer", "t"]).placement == "prefix"
    args = list(cluster_spec(parser.parse_args(["up", "--target", "t", "--placement", "load"])).coordinator_args)
    assert args[args.index("--placement") + 1] == "load"


def test_the_bound_is_c_times_the_mean_after_the_new_request():
    assert load_bound(0, 2) == 1  # an idle pair: the favoured replica takes it
    assert load_bound(2, 2) == 2  # ceil(1.25 * 3 / 2)
    assert load_bound(7, 4, factor=1.0) == 2  # c = 1: perfectly even
