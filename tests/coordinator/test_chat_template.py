"""A chat template that refuses the client's prompt is the client's INVALID_ARGUMENT, saying why."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.v1 import generation_pb2
from tests.coordinator.inprocess import TOKEN, tiny_tokenizer, warm_coordinator


def test_a_prompt_the_chat_template_refuses_is_invalid_argument_naming_the_templates_reason(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path)  # its template refuses prompts with "!"

    async def scenario():
        async with warm_coordinator(tokenizer) as (_, worker, stub):
            stopping = generation_pb2.StoppingOptions(max_new_tokens=1)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(generation_pb2.GenerateRequest(text="a!", chat=True, stopping=stopping), timeout=5)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert refused.value.details() == ("chat: the model's chat template refused this prompt: "
                                               "this model takes no exclamation marks")
            assert worker.calls["Prefill"] == 0
            reply = await stub.Generate(generation_pb2.GenerateRequest(text="ab", chat=True, stopping=stopping),
                                        timeout=5)
            assert list(reply.token_ids) == [TOKEN]
    asyncio.run(scenario())
