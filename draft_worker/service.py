"""DraftWorker gRPC servicer: decode the request, submit it to the batcher, encode the reply.

The reply's distributions are the messages the engine encoded once and
sampled from (``DraftReply.probs``); they are passed through, never re-encoded.
Every check of a call's content happens in ``DraftEngine.run_batch``.
"""

from __future__ import annotations

import grpc

from draft_worker.engine import DraftReply, ProposeCall
from tandem.rpc.wire import sampling_from_proto
from tandem.rpc.worker_service import WorkerServiceBase
from tandem.v1 import draft_pb2, draft_pb2_grpc


class DraftService(WorkerServiceBase, draft_pb2_grpc.DraftWorkerServicer):
    role = "draft"

    async def Propose(self, request: draft_pb2.ProposeRequest, context: grpc.aio.ServicerContext):
        self.server.check_accepting()
        call = ProposeCall(request.seq_id, request.committed_len, list(request.new_tokens), request.k,
                           sampling_from_proto(request.sampling), request.alternatives, request.prompt_len,
                           request.owner, request.verified_len, request.stop_below)
        reply: DraftReply = await self.batcher.submit(call)
        return draft_pb2.ProposeResponse(
            tokens=reply.tokens, probs=reply.probs,
            alternatives=[draft_pb2.Alternatives(token_ids=alts) for alts in reply.alternatives])
