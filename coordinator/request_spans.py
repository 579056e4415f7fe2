"""What a request's span says (``tandem.tracing``): OpenTelemetry's GenAI names, vLLM's latencies, Tandem's own.

Metadata only: sizes, settings, times and speculation figures, never the prompt or the text.
"""

from __future__ import annotations

from typing import Any

from tandem.spec.options import SpecOptions
from tandem.spec.request import RequestState


def opening(request_id: str, model: str, state: RequestState, options: SpecOptions, priority: int) -> dict[str, Any]:
    """Known when the request is placed: what it asks for."""
    sampling = state.sampling
    return {
        "gen_ai.request.id": request_id,
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": state.stop.max_new_tokens,
        "gen_ai.request.temperature": sampling.temperature,
        "gen_ai.request.top_p": sampling.top_p,
        "gen_ai.request.top_k": sampling.top_k or None,
        "gen_ai.request.seed": sampling.seed,
        "gen_ai.usage.input_tokens": len(state.prompt_ids),
        "gen_ai.usage.prompt_tokens": len(state.prompt_ids),  # (vLLM's name)
        "tandem.method": options.method,
        "tandem.priority": priority,
    }


def closing(state: RequestState, outcome: str, target: str, draft: str) -> dict[str, Any]:
    """Known when it ends: what it came to, and how its speculation went (as its reply's stats say)."""
    st = state.stats
    return {
        "gen_ai.response.finish_reasons": [state.finish_reason] if state.finish_reason else None,
        "gen_ai.usage.output_tokens": st.generated,
        "gen_ai.usage.completion_tokens": st.generated,  # (vLLM's name)
        "gen_ai.latency.time_to_first_token": round(st.first_token_s, 6) if st.generated else None,
        "gen_ai.latency.e2e": round(st.elapsed_s, 6),
        "gen_ai.latency.time_in_queue": round(st.queue_s, 6),  # waiting for room in a full KV pool
        "tandem.outcome": outcome,  # ok, error, cancelled (the client went away) or drained
        "tandem.target_worker": target,
        "tandem.draft_worker": draft,
        "tandem.rounds": st.rounds,
        "tandem.drafted": st.drafted,
        "tandem.accepted": st.accepted,
        "tandem.acceptance_rate": round(st.acceptance_rate, 4),
        "tandem.mean_accepted_len": round(st.mean_accepted_len, 4),
        "tandem.tree_rounds": st.tree_rounds,
        "tandem.prompt_tokens_reused": st.prompt_tokens_reused,
        "tandem.forced_tokens": st.forced_tokens,
        "tandem.target_moves": st.target_moves,
        "tandem.draft_moves": st.draft_moves,
        "tandem.preemptions": st.preemptions,
        "tandem.room_waits": st.room_waits,
        "tandem.draft_wait_rounds": st.draft_wait_rounds,
        "tandem.draft_wait_s": round(st.draft_wait_s, 6),  # the loop waiting on its draft channel, in all
        "tandem.verify_wait_s": round(st.verify_wait_s, 6),  # ... and on its verifier
    }
