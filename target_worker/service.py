"""TargetWorker gRPC servicer: decode the request, submit it to the batcher, encode the reply."""

from __future__ import annotations

import grpc
import torch

from tandem.errors import InvalidRequestError, check_token_ids
from tandem.rpc.worker_service import WorkerServiceBase
from tandem.rpc.wire import decode_distribution, sampling_from_proto
from tandem.spec.rejection import Verdict
from tandem.v1 import target_pb2, target_pb2_grpc
from target_worker.engine import PrefillCall, VerifyCall


class TargetService(WorkerServiceBase, target_pb2_grpc.TargetWorkerServicer):
    role = "target"

    async def Prefill(self, request: target_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        self.server.check_accepting()
        if not request.seq_id:
            raise InvalidRequestError("seq_id is empty")
        if not request.token_ids:
            raise InvalidRequestError("token_ids is empty: nothing to prefill")
        check_token_ids("token_ids", request.token_ids, self.engine.vocab_size)
        if len(request.token_ids) >= self.engine.max_context:
            raise InvalidRequestError(f"prompt of {len(request.token_ids)} tokens exceeds the context of {self.engine.max_context}")
        call = PrefillCall(request.seq_id, list(request.token_ids), sampling_from_proto(request.sampling))
        token: int = await self.batcher.submit(call)
        return target_pb2.PrefillResponse(next_token=token)

    async def Verify(self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext):
        self.server.check_accepting()
        drafts = list(request.draft_tokens)
        check_token_ids("draft_tokens", drafts, self.engine.vocab_size)
        probs = None
        if request.draft_probs:
            probs = torch.stack([decode_distribution(d, self.engine.vocab_size) for d in request.draft_probs])
        verdict: Verdict = await self.batcher.submit(VerifyCall(request.seq_id, request.committed_len, drafts, probs))
        return target_pb2.VerifyResponse(num_accepted=verdict.num_accepted, next_token=verdict.next_token)
