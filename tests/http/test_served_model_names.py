"""--served-model-name: the names clients call the model by, in both APIs and the metrics, over the scripted target
(tests/http/harness.py); the first names the model in every reply, as vLLM's does."""

from __future__ import annotations

import asyncio

import aiohttp
import grpc
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.config import check_served_model_names
from tandem.errors import InvalidRequestError
from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.coordinator.inprocess import tiny_tokenizer
from tests.http.harness import MODEL, http_coordinator
from tests.http.test_http_api import client

NAMES = ("qwen-coder", "gpt-4o-mini")
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


async def model_names_in_metrics(running) -> set[str]:
    async with aiohttp.ClientSession() as session, session.get(running.root + "/metrics") as reply:
        text = await reply.text()
    return {s.labels["model_name"] for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("vllm:") and "model_name" in s.labels}


def test_each_name_is_listed_and_answered_replies_and_metrics_use_the_first(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, served_model_names=NAMES) as running:
            api = client(running)
            assert [card.id for card in (await api.models.list()).data] == list(NAMES)
            assert (await api.models.retrieve("gpt-4o-mini")).id == "gpt-4o-mini"
            for name in NAMES:
                reply = await api.chat.completions.create(model=name, messages=ASK, max_tokens=2, temperature=0)
                assert reply.model == "qwen-coder"
            completion = await api.completions.create(model="gpt-4o-mini", prompt="hi", max_tokens=2)
            assert completion.model == "qwen-coder"
            # the workers' own name is not one of them any more
            with pytest.raises(openai.NotFoundError) as missing:
                await api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2)
            assert "'qwen-coder' or 'gpt-4o-mini'" in missing.value.message and missing.value.code == "model_not_found"
            assert await model_names_in_metrics(running) == {"qwen-coder"}
            async with grpc.aio.insecure_channel(running.grpc_address) as channel:
                info = await generation_pb2_grpc.GenerationStub(channel).Info(generation_pb2.InfoRequest())
            assert info.target_model == "qwen-coder"

    asyncio.run(go())


def test_without_names_the_workers_name_is_the_models(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            api = client(running)
            assert [card.id for card in (await api.models.list()).data] == [MODEL]
            reply = await api.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2, temperature=0)
            assert reply.model == MODEL and await model_names_in_metrics(running) == {MODEL}

    asyncio.run(go())


@pytest.mark.parametrize(("names", "says"), [
    (("",), "non-empty names"),
    ((" qwen",), "without spaces around them"),
    (("qwen", "coder", "qwen"), "gives 'qwen' more than once"),
    (("q" * 300,), "longer than 256 characters"),
])
def test_a_bad_name_is_refused_naming_the_flag(names, says):
    with pytest.raises(InvalidRequestError, match="--served-model-name") as refused:
        check_served_model_names(names)
    assert says in str(refused.value)
