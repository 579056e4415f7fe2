"""``--log-requests``: one log line per request as it ends, what its reply's stats say, never its text.

vLLM's ``--enable-log-requests`` logs each request; an operator chasing one slow or failed
request finds it here by its id (the client's ``request_id``, or the one the coordinator gave
it, as the reply says) without turning on tracing::

    request r-1 ok (length): 7 prompt tokens (0 from the prefix cache), 24 generated in 0.94 s, 25.6
    tokens/s, first after 0.049 s; method hybrid, 18 rounds, 5 of 11 drafted tokens accepted; on
    10.0.3.7:50052 and 10.0.4.2:50053

The replicas are the last it ran on, by address as the rest of the coordinator's log names
workers. Moves, preemptions, waits for room and an error's reason are added when there were any.
"""

from __future__ import annotations

from tandem.spec.request import RequestState


def request_line(request_id: str, method: str, state: RequestState, outcome: str, target: str, draft: str,
                 error: str | None = None) -> str:
    st = state.stats
    reason = f" ({state.finish_reason})" if state.finish_reason else ""
    parts = [f"request {request_id} {outcome}{reason}: {len(state.prompt_ids)} prompt tokens "
             f"({st.prompt_tokens_reused} from the prefix cache), {st.generated} generated in {st.elapsed_s:.2f} s, "
             f"{st.tokens_per_s:.1f} tokens/s" + (f", first after {st.first_token_s:.3f} s" if st.generated else "")]
    spec = f"method {method}, {st.rounds} rounds"
    if st.drafted:
        spec += f", {st.accepted} of {st.drafted} drafted tokens accepted"
    parts.append(spec)
    parts.append(f"on {target}" + (f" and {draft}" if draft else ""))
    events = [f"{n} {name}" for n, name in ((st.target_moves + st.draft_moves, "moves"),
                                            (st.preemptions, "preemptions"), (st.room_waits, "waits for room"))
              if n]
    if st.queue_s:
        events.append(f"{st.queue_s:.2f} s queued")
    if events:
        parts.append(", ".join(events))
    if error:
        parts.append(f"error: {error}")
    return "; ".join(parts)
