"""DraftWorker gRPC servicer: decode the request, submit it to the batcher, encode the reply."""

from __future__ import annotations

import grpc

from draft_worker.engine import DraftEngine, ProposeCall
from tandem.errors import InvalidRequestError
from tandem.rpc.batcher import Batcher
from tandem.rpc.server import ManagedServer
from tandem.rpc.wire import encode_distribution, sampling_from_proto
from tandem.rpc.worker_info import worker_info
from tandem.spec.proposal import Proposal
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc

MAX_K = 32


class DraftService(draft_pb2_grpc.DraftWorkerServicer):
    def __init__(self, engine: DraftEngine, batcher: Batcher, server: ManagedServer, model_name: str,
                 tokenizer_fingerprint: str, stop_token_ids: list[int]) -> None:
        self.engine = engine
        self.batcher = batcher
        self.server = server
        self.model_name = model_name
        self.fingerprint = tokenizer_fingerprint
        self.stop_token_ids = stop_token_ids

    async def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext):
        self.server.check_accepting()
        if not request.seq_id:
            raise InvalidRequestError("seq_id is empty")
        if not 0 <= request.k <= MAX_K:
            raise InvalidRequestError(f"k must be in 0..{MAX_K}, got {request.k}")
        if request.committed_len < 0:
            raise InvalidRequestError(f"committed_len must be >= 0, got {request.committed_len}")
        bad = [t for t in request.new_tokens if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise InvalidRequestError(f"new_tokens outside the vocabulary: {bad[:5]}")
        call = ProposeCall(request.seq_id, request.committed_len, list(request.new_tokens), request.k,
                           sampling_from_proto(request.sampling))
        proposal: Proposal = await self.batcher.submit(call)
        probs = [] if proposal.probs is None else [encode_distribution(q) for q in proposal.probs]
        return draft_pb2.ProposeResponse(tokens=proposal.tokens, probs=probs)

    async def Release(self, request: common_pb2.ReleaseRequest, context: grpc.aio.ServicerContext):
        return common_pb2.ReleaseResponse(released=self.engine.release(request.seq_id))

    async def Info(self, request: common_pb2.WorkerInfoRequest, context: grpc.aio.ServicerContext):
        return worker_info("draft", self.model_name, self.engine.engine, self.batcher.queue_depth,
                           len(self.engine.histories), self.fingerprint, self.stop_token_ids)
