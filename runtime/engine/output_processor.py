"""Output assembly: engine sequences to the ``RequestOutput`` a client sees, with deltas.

What it is: for each request group, the cumulative text, token ids and logprobs of
every sequence, the delta since the last output (what a stream sends), and the
request's timestamps (vLLM v1 keeps this in its output processor too). What it is
not: the finishing rules or the step loop (``llm_engine.py``).
"""

from plimsoll.runtime.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from plimsoll.runtime.engine.request import Request, RequestGroup


def completion_output(seq: Request) -> CompletionOutput:
    det = seq.detokenizer
    assert det is not None
    finished = seq.is_finished
    delta_text = det.take_delta(finished)
    delta_ids = seq.output_token_ids[seq.num_emitted_tokens :]
    seq.num_emitted_tokens = seq.num_output_tokens
    delta_lp = None
    if seq.logprobs is not None:
        delta_lp = seq.logprobs[seq.num_emitted_logprobs :]
        seq.num_emitted_logprobs = len(seq.logprobs)
    return CompletionOutput(
        index=seq.index,
        text=det.visible_text(finished),
        token_ids=list(seq.output_token_ids),
        finish_reason=seq.finish_reason,
        stop_reason=seq.stop_reason,
        logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
        delta_text=delta_text,
        delta_token_ids=delta_ids,
        delta_logprobs=delta_lp,
    )


def make_request_output(g: RequestGroup) -> RequestOutput:
    first = g.seqs[0]
    times = [s.first_token_time for s in g.seqs if s.first_token_time is not None]
    last = [s.last_token_time for s in g.seqs if s.last_token_time is not None]
    sched_times = [s.first_scheduled_time for s in g.seqs if s.first_scheduled_time is not None]
    finished_times = [s.finished_time for s in g.seqs if s.finished_time is not None]
    metrics = RequestMetrics(
        arrival_time=g.arrival_time,
        first_scheduled_time=min(sched_times) if sched_times else None,
        first_token_time=min(times) if times else None,
        last_token_time=max(last) if last else None,
        finished_time=max(finished_times) if g.finished and finished_times else None,
        num_prompt_tokens=len(g.prompt_token_ids),
        num_generation_tokens=sum(s.num_new_output_tokens for s in g.seqs),
        num_cached_tokens=max(first.num_cached_tokens, 0),
        num_preemptions=sum(s.num_preemptions for s in g.seqs),
        finish_reason=first.finish_reason if g.finished else None,
        priority=first.priority,
        lora_name=first.lora.lora_name if first.lora is not None else None,
        prefill_chunks=list(first.prefill_chunks),
    )
    return RequestOutput(
        request_id=g.request_id,
        prompt_token_ids=g.prompt_token_ids,
        outputs=[completion_output(s) for s in g.seqs],
        finished=g.finished,
        metrics=metrics,
        prompt=g.prompt,
        error=g.error,
        kv_transfer_params=first.kv_transfer_params,
    )
