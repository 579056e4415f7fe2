"""A coordinator inside the test's event loop: the real GenerationService on a ManagedServer, as
coordinator/main.py builds it, with fake target workers (in-process gRPC servers) behind it.

The fake target answers Info (counting the calls), Prefill and Verify (always ``TOKEN``) and
Release, which is all a request with ``method="none"`` needs. The tokenizer is the tiny real one
(tests/tiny_models.py), with a chat template that refuses prompts containing ``!``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from coordinator.access import AccessControl
from coordinator.service import GenerationService
from coordinator.workers import WorkerPool
from tandem.config import CoordinatorConfig, ServerOptions
from tandem.rpc.metrics import CoordinatorMetrics
from tandem.rpc.tls import open_channel
from tandem.tokenizer import load_tokenizer, tokenizer_fingerprint
from tandem.v1 import common_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc
from tests.serving import managed_server, serving
from tests.tiny_models import save_tiny_tokenizer

VOCAB = 40
MAX_CONTEXT = 64
TOKEN = 7  # what the fake target predicts, every time
# ``<s>`` and each turn's text, then ``#`` to ask for an answer; a prompt with ``!`` is refused.
REFUSING_TEMPLATE = ("{% if '!' in messages[0]['content'] %}{{ raise_exception('this model takes no "
                     "exclamation marks') }}{% endif %}"
                     "{% for message in messages %}<s>{{ message['content'] }}{% endfor %}"
                     "{% if greeting is defined %}{{ greeting }}{% endif %}"  # a template variable (its kwargs)
                     "{% if repeat is defined %}{{ '$' * repeat }}{% endif %}"  # one that needs a number
                     "{% if add_generation_prompt %}#{% endif %}")


def tiny_tokenizer(out_dir: Path) -> Any:
    """The tiny real tokenizer, with a chat template that refuses prompts containing ``!``."""
    save_tiny_tokenizer(out_dir, VOCAB, eos_token_id=1, bos_token_id=0)
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = REFUSING_TEMPLATE
    config_path.write_text(json.dumps(config))
    return load_tokenizer(out_dir)


KV_FULL = "KV cache exhausted: the batch needs 1 more blocks of 16 tokens, 0 are free"  # as a full pool refuses


class FakeTarget(target_pb2_grpc.TargetWorkerServicer):
    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.calls: collections.Counter[str] = collections.Counter()
        self.free_blocks = 90
        self.total_blocks = 100  # its KV pool: 100 blocks of 16 tokens
        self.release_gate: asyncio.Event | None = None  # a test's: each Release waits for it (a worker mid-step)
        self.metadata: dict[str, dict[str, str]] = {}  # each method's last call's metadata (trace context...)
        self.refuse_verify = ""  # a test's: Verify answers FAILED_PRECONDITION saying this ("": it answers)
        self.full_verifies = 0  # a test's: that many Verify calls are refused as a full KV pool would refuse them
        self.full_prefills = 0  # the same for Prefill calls

    async def Info(self, request, context):
        self.calls["Info"] += 1
        return common_pb2.WorkerInfo(role="target", model="fake-target", vocab_size=VOCAB, max_context=MAX_CONTEXT,
                                     total_blocks=self.total_blocks, free_blocks=self.free_blocks, block_size=16,
                                     tokenizer_fingerprint=self.fingerprint, stop_token_ids=[1])

    def _heard(self, method: str, context) -> None:
        self.calls[method] += 1
        self.metadata[method] = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}

    async def Prefill(self, request, context):
        self._heard("Prefill", context)
        if self.full_prefills:
            self.full_prefills -= 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, KV_FULL)
        return target_pb2.PrefillResponse(next_token=TOKEN)

    async def Verify(self, request, context):
        self._heard("Verify", context)
        if self.refuse_verify:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self.refuse_verify)
        if self.full_verifies:
            self.full_verifies -= 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, KV_FULL)
        return target_pb2.VerifyResponse(num_accepted=0, next_token=TOKEN)

    async def Release(self, request, context):
        if self.release_gate is not None:
            await self.release_gate.wait()
        self._heard("Release", context)
        return common_pb2.ReleaseResponse(released=True)


@contextlib.asynccontextmanager
async def fake_target(fingerprint: str, serve: bool = True) -> AsyncIterator[tuple[FakeTarget, Any, str]]:
    """A fake target worker on 127.0.0.1: (servicer, its ManagedServer, address); ``serve=False``: still warming up."""
    servicer = FakeTarget(fingerprint)
    server = managed_server(role="target")
    server.add_service(target_pb2_grpc.add_TargetWorkerServicer_to_server, servicer, "tandem.v1.TargetWorker")
    if serve:
        async with serving(server) as address:
            yield servicer, server, address
        return
    await server.start()
    try:
        yield servicer, server, f"127.0.0.1:{server.port}"
    finally:
        await server.server.stop(0)


class Coordinator:
    """The coordinator's parts as coordinator/main.py wires them; ``server`` is built but not started."""

    def __init__(self, tokenizer: Any, max_concurrent_per_client: int = 0) -> None:
        cfg = CoordinatorConfig(server=ServerOptions(host="127.0.0.1", port=0, drain_grace_s=0),
                                tokenizer_dir=Path("unused"), target_addrs=["127.0.0.1:1"],
                                max_concurrent_per_client=max_concurrent_per_client)
        fingerprint = tokenizer_fingerprint(tokenizer)
        self.targets = WorkerPool("target", [], fingerprint)
        self.drafts = WorkerPool("draft", [], fingerprint)
        self.server = managed_server(role="coordinator",
                                     interceptors=[AccessControl(None, cfg.max_concurrent_per_client)])
        metrics = CoordinatorMetrics(self.server.registry)
        self.service = GenerationService(cfg, tokenizer, self.targets, self.drafts, self.server, metrics)
        self.server.add_service(generation_pb2_grpc.add_GenerationServicer_to_server, self.service,
                                "tandem.v1.Generation")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    async def warm_up(self, target_address: str) -> None:
        """What coordinator/main.py's warm-up does: find a target, learn the model's limits, serve."""
        self.targets.update({target_address})  # its first Info is on its way
        while not self.targets.has_healthy():
            await asyncio.sleep(0.01)
        info = next(c.info for c in self.targets.clients if c.routable and c.healthy)
        self.service.vocab_size, self.service.max_context = info.vocab_size, info.max_context
        self.service.model_stop_ids = frozenset(info.stop_token_ids)
        await self.server.set_serving()

    async def close(self) -> None:
        await self.server.server.stop(0)
        await self.targets.close()
        await self.drafts.close()


@contextlib.asynccontextmanager
async def warm_coordinator(tokenizer: Any) -> AsyncIterator[tuple[Coordinator, FakeTarget, Any]]:
    """A coordinator serving with one fake target: (coordinator, the target's servicer, a Generation stub)."""
    coordinator = Coordinator(tokenizer)
    await coordinator.server.start()
    try:
        async with fake_target(tokenizer_fingerprint(tokenizer)) as (worker, _, target_address), \
                open_channel(coordinator.address, None, aio=True) as channel:
            await coordinator.warm_up(target_address)
            yield coordinator, worker, generation_pb2_grpc.GenerationStub(channel)
    finally:
        await coordinator.close()
