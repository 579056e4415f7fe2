"""An exception nobody mapped reaches the caller as INTERNAL with a fixed message and an error id; its
text and traceback are in the server's log under that id, and only there."""

from __future__ import annotations

import asyncio
import logging
import re

import grpc
import pytest

from tandem.errors import InternalError
from tandem.rpc.tls import open_channel
from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.serving import managed_server, serving

SECRET = "/srv/models/private/tokenizer_config.json line 3: 10.0.0.7:50052"
ERROR_ID = re.compile(r"error id ([0-9a-f]{16})")


class Failing(generation_pb2_grpc.GenerationServicer):
    async def Generate(self, request, context):
        if request.text == "on purpose":
            raise InternalError("a target worker answered an inconsistent verdict")
        raise RuntimeError(SECRET)

    async def GenerateStream(self, request, context):
        yield generation_pb2.GenerateStreamResponse(text="a")
        raise KeyError(SECRET)


async def failure(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value


def test_an_unexpected_exception_is_internal_with_a_fixed_message_and_an_id_the_log_has_with_the_details(caplog):
    async def scenario() -> list[grpc.aio.AioRpcError]:
        server = managed_server(role="coordinator")
        server.add_service(generation_pb2_grpc.add_GenerationServicer_to_server, Failing(), "tandem.v1.Generation")
        async with serving(server) as address, open_channel(address, None, aio=True) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            unary = await failure(stub.Generate(generation_pb2.GenerateRequest(text="x"), timeout=5))
            stream = stub.GenerateStream(generation_pb2.GenerateRequest(text="x"), timeout=5)
            assert (await stream.read()).text == "a"
            streamed = await failure(stream.read())
            on_purpose = await failure(stub.Generate(generation_pb2.GenerateRequest(text="on purpose"), timeout=5))
            return [unary, streamed, on_purpose]

    with caplog.at_level(logging.ERROR, logger="tandem.rpc.status"):
        unary, streamed, on_purpose = asyncio.run(scenario())
    ids = []
    for error, kind in ((unary, RuntimeError), (streamed, KeyError)):
        assert error.code() == grpc.StatusCode.INTERNAL
        assert "10.0.0.7" not in error.details() and "/srv" not in error.details()
        assert error.details().startswith("internal error (error id "), error.details()
        error_id = ERROR_ID.search(error.details()).group(1)
        record = next(r for r in caplog.records if error_id in r.getMessage())
        assert SECRET in record.getMessage() and record.exc_info[0] is kind
        assert "Traceback" in caplog.text
        ids.append(error_id)
    assert ids[0] != ids[1]
    # An InternalError raised on purpose says what it was written to say, with its id.
    assert on_purpose.code() == grpc.StatusCode.INTERNAL
    assert on_purpose.details().startswith("a target worker answered an inconsistent verdict (error id ")
    assert ERROR_ID.search(on_purpose.details()).group(1) in caplog.text
