"""A small synchronous client of the public Generation API (the CLI, tests and benchmarks use it)."""

from __future__ import annotations

from collections.abc import Iterator

from tandem.rpc.auth import bearer_metadata
from tandem.rpc.server import GRPC_OPTIONS
from tandem.rpc.tls import ClientTLS, open_channel
from tandem.rpc.wire import sampling_to_proto
from tandem.sampling_params import SamplingParams
from tandem.v1 import generation_pb2, generation_pb2_grpc


def build_request(
    prompt: str | list[int] | list[dict[str, str]],
    *,
    max_new_tokens: int = 0,
    sampling: SamplingParams | None = None,
    method: str = "",
    k: int | None = None,
    fixed_k: bool = False,
    pipelining: bool = True,
    chat: bool = False,
    stop_strings: tuple[str, ...] = (),
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
    request_id: str = "",
    tree: str = "",
    heads_nodes: int = 0,
    prediction: str = "",
) -> generation_pb2.GenerateRequest:
    """A GenerateRequest of ``prompt``: text (through the chat template with ``chat``), token ids, or a
    conversation (``{"role", "content"}`` turns, always through the chat template). ``prediction``: text the answer
    is expected to repeat (``SpeculationOptions.prediction``)."""
    request = generation_pb2.GenerateRequest(
        chat=chat, request_id=request_id,
        stopping=generation_pb2.StoppingOptions(max_new_tokens=max_new_tokens, stop_strings=stop_strings,
                                                stop_token_ids=stop_token_ids, ignore_eos=ignore_eos),
        speculation=generation_pb2.SpeculationOptions(method=method, fixed_k=fixed_k,
                                                      disable_pipelining=not pipelining, tree=tree,
                                                      heads_nodes=heads_nodes, prediction=prediction),
    )
    if k is not None:
        request.speculation.k = k
    if sampling is not None:
        request.sampling.CopyFrom(sampling_to_proto(sampling))
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt and isinstance(prompt[0], dict):  # a conversation: its turns through the chat template
        request.messages.messages.extend(generation_pb2.ChatMessage(**turn) for turn in prompt)
    else:
        request.token_ids.ids.extend(prompt)
    return request


class TandemClient:
    """``tls``: TLS options (None: plaintext); ``token``: the bearer token sent with every call."""

    def __init__(self, address: str, timeout_s: float = 600.0, *, tls: ClientTLS | None = None,
                 token: str | None = None) -> None:
        self.channel = open_channel(address, tls, GRPC_OPTIONS)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = bearer_metadata(token)

    def generate(self, request: generation_pb2.GenerateRequest) -> generation_pb2.GenerateResponse:
        return self.stub.Generate(request, timeout=self.timeout_s, metadata=self.metadata)

    def stream(self, request: generation_pb2.GenerateRequest) -> Iterator[generation_pb2.GenerateStreamResponse]:
        return self.stub.GenerateStream(request, timeout=self.timeout_s, metadata=self.metadata)

    def info(self) -> generation_pb2.InfoResponse:
        return self.stub.Info(generation_pb2.InfoRequest(), timeout=30, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
