"""DraftWorker gRPC servicer: decode the request, submit it to the batcher, encode the reply."""

from __future__ import annotations

import grpc

from draft_worker.engine import ProposeCall
from tandem.errors import InvalidRequestError, check_token_ids
from tandem.rpc.worker_service import WorkerServiceBase
from tandem.rpc.wire import encode_distribution, sampling_from_proto
from tandem.spec.adaptive import MAX_K
from tandem.spec.proposal import Proposal
from tandem.v1 import draft_pb2, draft_pb2_grpc

# k drafts, plus the pipelining guesses: of the first token (during prefill) and of the bonus token.
MAX_PROPOSE = MAX_K + 2


class DraftService(WorkerServiceBase, draft_pb2_grpc.DraftWorkerServicer):
    role = "draft"

    async def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext):
        self.server.check_accepting()
        if not request.seq_id:
            raise InvalidRequestError("seq_id is empty")
        if not 0 <= request.k <= MAX_PROPOSE:
            raise InvalidRequestError(f"k must be in 0..{MAX_PROPOSE}, got {request.k}")
        if request.committed_len < 0:
            raise InvalidRequestError(f"committed_len must be >= 0, got {request.committed_len}")
        check_token_ids("new_tokens", request.new_tokens, self.engine.vocab_size)
        call = ProposeCall(request.seq_id, request.committed_len, list(request.new_tokens), request.k,
                           sampling_from_proto(request.sampling))
        proposal: Proposal = await self.batcher.submit(call)
        probs = [] if proposal.probs is None else [encode_distribution(q) for q in proposal.probs]
        return draft_pb2.ProposeResponse(tokens=proposal.tokens, probs=probs)
