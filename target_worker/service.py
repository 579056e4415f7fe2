"""TargetWorker gRPC servicer: decode the request, submit it to the batcher, encode the reply.

Every check of a call's content happens in ``TargetEngine.run_batch`` (the
engine decodes ``draft_probs`` itself, on its model thread).
"""

from __future__ import annotations

import grpc

from tandem.rpc.room_waits import MAX_QUEUED, QueuedPrompt
from tandem.rpc.wire import logprobs_to_proto, proposal_to_proto, sampling_from_proto
from tandem.rpc.worker_service import WorkerServiceBase
from tandem.spec.rejection import Verdict
from tandem.v1 import target_pb2, target_pb2_grpc
from target_worker.engine import PrefillCall, Prefilled, Proposed, VerifyCall


class TargetService(WorkerServiceBase, target_pb2_grpc.TargetWorkerServicer):
    role = "target"

    async def Prefill(self, request: target_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        self.server.check_accepting()
        call = PrefillCall(request.seq_id, list(request.token_ids), sampling_from_proto(request.sampling),
                           request.prompt_len, request.owner, request.replace, request.propose, request.max_len,
                           request.priority, request.arrival_time,
                           tuple(QueuedPrompt(q.seq_id, q.arrival_time, q.tokens, q.max_len, q.priority)
                                 for q in request.queued[:MAX_QUEUED]),
                           request.wait_for_room_s)
        result: Prefilled | Proposed = await self.batcher.submit(call)
        prefilled = result.result if isinstance(result, Proposed) else result
        reply = target_pb2.PrefillResponse(next_token=prefilled.next_token, reused_tokens=prefilled.reused_tokens,
                                           logprobs=logprobs_to_proto(prefilled.logprobs),
                                           forced_tokens=prefilled.forced,
                                           prompt_logprobs=logprobs_to_proto(prefilled.prompt_logprobs))
        if isinstance(result, Proposed):
            reply.proposal.CopyFrom(proposal_to_proto(result.proposal.tokens, result.proposal.parents))
        return reply

    async def Verify(self, request: target_pb2.VerifyRequest, context: grpc.aio.ServicerContext):
        self.server.check_accepting()
        call = VerifyCall(request.seq_id, request.committed_len, list(request.draft_tokens), list(request.draft_probs),
                          list(request.draft_parents), request.owner, request.propose)
        result: Verdict | Proposed = await self.batcher.submit(call)
        verdict = result.result if isinstance(result, Proposed) else result
        reply = target_pb2.VerifyResponse(num_accepted=verdict.num_accepted, next_token=verdict.next_token,
                                          accepted_nodes=verdict.accepted_nodes,
                                          logprobs=logprobs_to_proto(verdict.logprobs), forced_tokens=verdict.forced)
        if isinstance(result, Proposed):
            reply.proposal.CopyFrom(proposal_to_proto(result.proposal.tokens, result.proposal.parents))
        return reply
