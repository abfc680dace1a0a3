"""The replica's own service rates: decode steps and prefill cost measured from its steps, as the predictor splits them."""

import pytest

from plimsoll.runtime.engine.service_rates import ServiceRateMeter


def test_nothing_is_known_until_a_decode_step_and_a_prefill_were_seen() -> None:
    meter = ServiceRateMeter(max_num_seqs=8)
    meter.observe(prefill_tokens=500, decode_tokens=0, step_s=0.5)  # no decode step yet: cannot split it
    assert meter.rates() is None
    meter.observe(prefill_tokens=0, decode_tokens=4, step_s=0.02)
    assert meter.rates() is None
    meter.observe(prefill_tokens=500, decode_tokens=0, step_s=0.52)
    rates = meter.rates()
    assert rates is not None and rates.max_num_seqs == 8
    # What the prompt added beyond one step: 0.5 s for 500 tokens.
    assert rates.prefill_tokens_per_s == pytest.approx(1000.0) and rates.decode_step_s == pytest.approx(0.02)


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
