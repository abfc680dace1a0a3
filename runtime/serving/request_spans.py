"""The engine's phases of one request as OpenTelemetry spans, under the HTTP server span.

What it is: after a request ends, its engine timestamps become child spans of the
current (server) span: ``queue`` (arrival to first scheduled), ``prefill`` (first
scheduled to first token) with one ``prefill_chunk`` per engine step that computed
prompt tokens, and ``decode`` (first to last token), plus one ``gen_ai`` span
carrying the GenAI semantic-convention attributes (model, token counts, finish
reason). What it is not: prompt or completion text, which never goes on a span.
"""

from __future__ import annotations

from opentelemetry import trace

from plimsoll.runtime.engine.outputs import RequestOutput
from plimsoll.tracing import span_at


def record_request_spans(out: RequestOutput, model: str, endpoint: str, request_id: str, ended: float) -> None:
    if not trace.get_current_span().is_recording():
        return  # tracing off, or the caller did not sample this trace
    rm = out.metrics
    usage = {
        "gen_ai.operation.name": "chat" if endpoint == "chat" else "text_completion",
        "gen_ai.system": "plimsoll",
        "gen_ai.request.model": model,
        "gen_ai.response.model": model,
        "gen_ai.response.id": request_id,
        "gen_ai.usage.input_tokens": rm.num_prompt_tokens,
        "gen_ai.usage.output_tokens": rm.num_generation_tokens,
        "gen_ai.response.finish_reasons": [o.finish_reason or "abort" for o in out.outputs],
        "plimsoll.request.priority": rm.priority,
        "plimsoll.request.cached_tokens": rm.num_cached_tokens,
        "plimsoll.request.preemptions": rm.num_preemptions,
    }
    end = rm.finished_time or ended
    root = span_at(f"{usage['gen_ai.operation.name']} {model}", rm.arrival_time, end, usage)
    sched, first = rm.first_scheduled_time, rm.first_token_time
    span_at("queue", rm.arrival_time, sched if sched is not None else end, {}, root)
    if sched is None:
        return
    prefill = span_at("prefill", sched, first if first is not None else end,
                      {"gen_ai.usage.input_tokens": rm.num_prompt_tokens}, root)
    for start, stop, n in rm.prefill_chunks:
        span_at("prefill_chunk", start, stop, {"plimsoll.chunk.tokens": n}, prefill)
    if first is not None:
        span_at("decode", first, rm.last_token_time or end,
                {"gen_ai.usage.output_tokens": rm.num_generation_tokens}, root)
