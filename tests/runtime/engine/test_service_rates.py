"""The replica's own service rates: decode steps and prefill cost measured from its steps, as the predictor splits them."""

import pytest

from plimsoll.runtime.engine.service_rates import ServiceRateMeter


def test_nothing_is_known_until_a_decode_step_and_a_prefill_were_seen() -> None:
    meter = ServiceRateMeter(max_num_seqs=8)
    meter.observe(prefill_tokens=0, decode_tokens=4, step_s=0.02)
    assert meter.rates() is None
    meter.observe(prefill_tokens=500, decode_tokens=0, step_s=0.52)
    rates = meter.rates()
    assert rates is not None and rates.max_num_seqs == 8
    # What the prompt added beyond one step: 0.5 s for 500 tokens.
    assert rates.prefill_tokens_per_s == pytest.approx(1000.0) and rates.decode_step_s == pytest.approx(0.02)


def test_a_prefill_seen_before_any_decode_step_counts_once_one_is() -> None:
    """A request's prefill step comes before its decode steps (the warm-up's measuring request)."""
    meter = ServiceRateMeter(max_num_seqs=8)
    meter.observe(prefill_tokens=500, decode_tokens=0, step_s=0.52)  # no decode step yet: cannot split it
    assert meter.rates() is None
    meter.observe(prefill_tokens=0, decode_tokens=1, step_s=0.02)
    rates = meter.rates()
    assert rates is not None and rates.prefill_tokens_per_s == pytest.approx(1000.0)
    meter.observe(prefill_tokens=0, decode_tokens=1, step_s=0.02)  # counted once, not again
    assert meter.prefill_s_per_token == pytest.approx(0.001)


def test_the_rate_probe_feeds_the_meter_after_the_first_request_warm_up(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Before Ready only the tiny request runs (its steps pay first-call costs and are dropped: a
    fresh meter, nothing measured, the probe due). The probe, run once the engine idles after
    Ready, gives the meter what it needs to know both rates: a prefill of enough prompt tokens, then
    decode-only steps. (Whether a step stands out from a decode step is the host's business, so this
    checks what was fed, not the rates.)"""
    from plimsoll.runtime import LLM
    from plimsoll.runtime.engine import llm_engine
    from plimsoll.runtime.engine.service_rates import MIN_PREFILL_TOKENS

    fed: list[tuple[int, int]] = []

    class Recording(ServiceRateMeter):
        def observe(
            self, prefill_tokens: int, decode_tokens: int, step_s: float, end: float | None = None
        ) -> None:
            fed.append((prefill_tokens, decode_tokens))
            super().observe(prefill_tokens, decode_tokens, step_s, end)

    llm = LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="256KiB", max_model_len=256)
    try:
        engine = llm.engine
        original, llm_engine.ServiceRateMeter = llm_engine.ServiceRateMeter, Recording
        try:
            engine.warmup(defer_rest=True)
        finally:
            llm_engine.ServiceRateMeter = original
        assert isinstance(engine.rate_meter, Recording)  # a fresh meter after the tiny request
        assert fed == [] and engine.rate_meter.rates() is None and engine.rate_probe_due
        assert engine.measure_rates() is True
        assert fed and fed[0][0] >= MIN_PREFILL_TOKENS  # the measuring prompt, first thing it saw
        assert sum(1 for prefill, decode in fed if prefill == 0 and decode > 0) >= 2
        assert engine.rate_meter.rates() is not None
        assert not engine.rate_probe_due and engine.measure_rates() is False  # once
        assert not engine.has_unfinished_requests()
    finally:
        llm.close()


def test_traffic_before_the_probe_measures_the_rates_and_the_probe_is_skipped(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    from plimsoll.runtime import LLM
    from plimsoll.runtime.engine.sampling_params import SamplingParams
    from plimsoll.runtime.engine.service_rates import MIN_PREFILL_TOKENS

    llm = LLM(model=str(tiny_model_dir("llama")), kv_cache_memory="256KiB", max_model_len=256)
    try:
        engine = llm.engine
        engine.warmup_first_request()
        assert engine.rate_probe_due and engine.rate_meter.rates() is None
        prompt = list(range(3, 3 + 2 * MIN_PREFILL_TOKENS))
        engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert engine.rate_meter.rates() is not None  # the request's prefill and decode steps
        steps: list[int] = []
        original = engine.step
        engine.step = lambda: (steps.append(1), original())[1]  # type: ignore[method-assign]
        assert engine.measure_rates() is False and steps == []  # nothing ran
        assert not engine.rate_probe_due
    finally:
        llm.close()


def test_a_few_prompt_tokens_say_nothing_about_the_rate() -> None:
    meter = ServiceRateMeter(max_num_seqs=1)
    meter.observe(0, 1, 0.02)
    meter.observe(1, 0, 0.05)  # a one-token prompt: the step's fixed cost, not a rate
    assert meter.prefill_s_per_token is None


def test_the_rates_follow_the_host_without_jumping_on_one_step() -> None:
    meter = ServiceRateMeter(max_num_seqs=1)
    meter.observe(0, 1, 0.02)
    for _ in range(50):
        meter.observe(0, 1, 0.04)  # the host got twice as slow
    assert meter.decode_step_s == pytest.approx(0.04, rel=1e-3)
    meter.observe(0, 1, 0.4)  # one stalled step moves the estimate a fifth of the way
    assert meter.decode_step_s == pytest.approx(0.04 + 0.2 * 0.36, rel=1e-4)


def _known_meter(step_s: float = 0.02, s_per_token: float = 0.001) -> ServiceRateMeter:
    """A meter that has measured a decode step of ``step_s`` and ``s_per_token`` of prefill."""
    meter = ServiceRateMeter(max_num_seqs=4)
    meter.decode_step_s, meter.prefill_s_per_token = step_s, s_per_token
    return meter


def test_the_slowest_recent_step_against_the_means_is_the_slow_step_factor() -> None:
    from plimsoll.runtime.engine.service_rates import MIN_TAIL_STEPS, TAIL_WINDOW, TAIL_WINDOW_S

    meter = _known_meter()
    for _ in range(MIN_TAIL_STEPS - 1):
        meter.observe(prefill_tokens=0, decode_tokens=4, step_s=0.02)
    assert meter.slow_step_factor() is None  # too few steps to say
    # A mixed step with a few prompt tokens (too few to measure the rate) still says how slow steps
    # are: 5 tokens at 1 ms beyond a 20 ms step, taken at 100 ms, is four times what the means say.
    meter.observe(prefill_tokens=5, decode_tokens=3, step_s=0.1)
    assert meter.slow_step_factor() == pytest.approx(0.1 / 0.025)
    rates = meter.rates()
    assert rates is not None and rates.slow_step_factor == pytest.approx(4.0)
    # The tail the admission promises at: four times as slow, prefill and decode.
    tail = rates.at_tail()
    assert tail.decode_step_s == pytest.approx(4 * rates.decode_step_s)
    assert tail.prefill_tokens_per_s == pytest.approx(rates.prefill_tokens_per_s / 4)
    # The slow step is remembered for TAIL_WINDOW_S seconds of stepping, not only TAIL_WINDOW
    # steps: a host that stalled once stalls again within seconds, however many fast steps ran.
    step = 0.02
    for _ in range(TAIL_WINDOW + 1):
        meter.observe(prefill_tokens=0, decode_tokens=4, step_s=meter.decode_step_s or step)
    assert (meter.slow_step_factor() or 0) > 2
    # Once that much stepping time has passed, the factor is what the steps since say.
    for _ in range(int(TAIL_WINDOW_S / step) + 1):
        meter.observe(prefill_tokens=0, decode_tokens=4, step_s=meter.decode_step_s or step)
    factor = meter.slow_step_factor()
    assert factor is not None and factor == pytest.approx(1.0, rel=0.05)


def test_steps_as_fast_as_the_means_leave_the_promise_at_the_means() -> None:
    meter = _known_meter()
    for _ in range(10):
        meter.observe(prefill_tokens=100, decode_tokens=0, step_s=0.02 + 0.1)  # exactly as predicted
    rates = meter.rates()
    assert rates is not None and rates.at_tail().decode_step_s == pytest.approx(rates.decode_step_s)


def test_a_prefill_no_slower_than_a_decode_step_still_gives_a_rate() -> None:
    """The warm-up's measuring prefill is split against a decode step that the host may have slowed
    more; without a rate the replica would admit everything, and short prompts never measure one."""
    meter = ServiceRateMeter(max_num_seqs=4)
    meter.observe(prefill_tokens=100, decode_tokens=0, step_s=0.05)
    meter.observe(prefill_tokens=0, decode_tokens=1, step_s=0.08)  # slower than the prefill step
    rates = meter.rates()
    assert rates is not None and rates.prefill_tokens_per_s == pytest.approx(100 / 0.05)
    # A later prefill that splits goes into the mean as usual.
    meter.observe(prefill_tokens=100, decode_tokens=0, step_s=0.08 + 0.1)
    assert meter.prefill_s_per_token == pytest.approx(0.0005 + 0.1 * (0.001 - 0.0005))


def test_the_steps_a_request_waited_through_are_those_that_ended_after_it_arrived() -> None:
    from plimsoll.runtime.engine.service_rates import HISTORY_S

    meter = ServiceRateMeter(max_num_seqs=4)
    meter.observe(prefill_tokens=0, decode_tokens=4, step_s=0.02, end=10.0)
    meter.observe(prefill_tokens=16, decode_tokens=3, step_s=0.9, end=10.9)
    meter.observe(prefill_tokens=0, decode_tokens=4, step_s=0.02)  # no end: not in the timed history
    meter.observe(prefill_tokens=0, decode_tokens=4, step_s=0.03, end=10.95)
    # Arrived at 10.5, mid-step: it waited through the rest of the 0.9 s step and the next one.
    assert meter.steps_since(10.5) == [(0.9, 16), (0.03, 0)]
    assert meter.steps_since(11.0) == []
    # The history reaches back HISTORY_S seconds from the latest step, no further.
    meter.observe(prefill_tokens=0, decode_tokens=4, step_s=0.02, end=10.0 + HISTORY_S + 0.5)
    assert meter.steps_since(0.0) == [(0.9, 16), (0.03, 0), (0.02, 0)]
