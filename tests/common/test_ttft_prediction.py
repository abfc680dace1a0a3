"""The TTFT predictor, pure: the model's terms one by one, and against an event-by-event replay of the same curve."""

import heapq
import random

import pytest

from plimsoll.ttft_prediction import (
    QueueSnapshot,
    ServiceRates,
    backlog_seconds,
    parse_ttft_bound,
    predict_ttft,
)

RATES = ServiceRates(prefill_tokens_per_s=1000.0, decode_step_s=0.02, max_num_seqs=2)


def test_an_idle_replica_costs_the_prompt_and_one_step() -> None:
    p = predict_ttft(QueueSnapshot(), RATES, 100)
    assert (p.backlog_s, p.prefill_s, p.step_s) == (0.0, 0.1, 0.02)
    assert p.ttft_s == pytest.approx(0.12) and backlog_seconds(QueueSnapshot(), RATES) == 0.0


def test_a_free_slot_still_waits_for_the_prefills_ahead() -> None:
    # One running sequence mid-prefill (300 tokens left): the lane is busy for 0.3 s.
    queue = QueueSnapshot(running=((300, 10),))
    assert predict_ttft(queue, RATES, 100).backlog_s == pytest.approx(0.3)


def test_full_slots_wait_for_the_first_to_finish() -> None:
    queue = QueueSnapshot(running=((0, 5), (0, 50)))  # 0.1 s and 1.0 s of decode left
    p = predict_ttft(queue, RATES, 100)
    assert p.backlog_s == pytest.approx(0.1) and p.ttft_s == pytest.approx(0.22)


def test_waiting_requests_go_first_in_order() -> None:
    # Slots free at 0.1 and 1.0 s; the first waiting one takes 0.1 s (prefill 0.2 s, then 4 steps) -> 0.38 s.
    queue = QueueSnapshot(running=((0, 5), (0, 50)), waiting=((200, 4),))
    p = predict_ttft(queue, RATES, 100)
    assert p.ahead == 1
    assert p.backlog_s == pytest.approx(0.38)
    # Several sequences (n = 2) wait for the last one's slot: 1.0 s.
    assert predict_ttft(queue, RATES, 100, num_seqs=2).backlog_s == pytest.approx(1.0)
    assert queue.waiting_prompt_tokens == 200 and queue.decode_tokens_remaining == 55


def test_retry_after_is_the_excess_in_whole_seconds() -> None:
    p = predict_ttft(QueueSnapshot(running=((0, 200), (0, 200))), RATES, 100)  # 4 s of decode
    assert p.ttft_s == pytest.approx(4.12)
    assert p.retry_after_s(0.5) == 4 and p.retry_after_s(10.0) == 1


def _replay(rates: ServiceRates, arrivals: list[tuple[float, int, int]]) -> list[float]:
    """Event-by-event FCFS replay: slots, a serial prefill lane, first token one step after the prefill."""
    slots = [0.0] * rates.max_num_seqs
    lane = 0.0
    ttfts = []
    for at, prompt, out in arrivals:
        start = max(heapq.heappop(slots), lane, at)
        lane = start + prompt / rates.prefill_tokens_per_s
        heapq.heappush(slots, lane + out * rates.decode_step_s)
        ttfts.append(lane + rates.decode_step_s - at)
    return ttfts


def test_the_prediction_at_each_arrival_matches_a_replay_of_the_queue() -> None:
    rng = random.Random(7)
    rates = ServiceRates(prefill_tokens_per_s=2000.0, decode_step_s=0.01, max_num_seqs=3)
    arrivals, t = [], 0.0
    for _ in range(40):
        t += rng.expovariate(8.0)
        arrivals.append((t, rng.randint(10, 400), rng.randint(1, 60)))
    truth = _replay(rates, arrivals)
    # The queue each request finds: what is running (and how much it has left) and what waits.
    for i, (at, prompt, _) in enumerate(arrivals):
        history = _replay(rates, arrivals[:i])
        running, waiting = [], []
        slots = [0.0] * rates.max_num_seqs
        lane = 0.0
        for (a, p, o), _ttft in zip(arrivals[:i], history, strict=True):
            start = max(heapq.heappop(slots), lane, a)
            end_prefill = start + p / rates.prefill_tokens_per_s
            lane = end_prefill
            finish = end_prefill + o * rates.decode_step_s
            heapq.heappush(slots, finish)
            if start > at:
                waiting.append((p, o))
            elif finish > at:
                if end_prefill > at:
                    running.append((round((end_prefill - at) * rates.prefill_tokens_per_s), o))
                else:
                    running.append((0, max(1, round((finish - at) / rates.decode_step_s))))
        queue = QueueSnapshot(tuple(running), tuple(waiting))
        predicted = predict_ttft(queue, rates, prompt).ttft_s
        assert predicted == pytest.approx(truth[i], abs=0.011), (i, queue)


@pytest.mark.parametrize("value", ["abc", "-5", "0", "inf"])
def test_a_bad_bound_is_refused_with_its_reason(value: str) -> None:
    with pytest.raises(ValueError, match="x-slo-ttft-ms"):
        parse_ttft_bound(value)


def test_a_bound_in_milliseconds_is_seconds() -> None:
    assert (
        parse_ttft_bound("250") == 0.25 and parse_ttft_bound(None) is None and parse_ttft_bound(" ") is None
    )


def test_rates_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        ServiceRates(prefill_tokens_per_s=0, decode_step_s=0.01, max_num_seqs=1)
    with pytest.raises(ValueError, match="slow-step factor"):
        ServiceRates(prefill_tokens_per_s=1000.0, decode_step_s=0.01, max_num_seqs=1, slow_step_factor=0.0)


def test_at_the_tail_prefill_and_decode_are_as_slow_as_the_slow_steps() -> None:
    slow = ServiceRates(prefill_tokens_per_s=1000.0, decode_step_s=0.02, max_num_seqs=2, slow_step_factor=3.0)
    tail = slow.at_tail()
    assert tail.decode_step_s == pytest.approx(0.06) and tail.prefill_tokens_per_s == pytest.approx(
        1000.0 / 3
    )
    # Full slots (0.1 s of decode left at the mean): every term three times as long.
    queue = QueueSnapshot(running=((0, 5), (0, 50)))
    assert predict_ttft(queue, tail, 100).ttft_s == pytest.approx(3 * predict_ttft(queue, slow, 100).ttft_s)
    # No factor measured, or steps no slower than the means: the means are the promise.
    assert RATES.at_tail() is RATES
    fast = ServiceRates(prefill_tokens_per_s=1000.0, decode_step_s=0.02, max_num_seqs=2, slow_step_factor=0.8)
    assert fast.at_tail() is fast


def test_with_a_step_under_way_a_free_slot_is_free_only_when_it_ends() -> None:
    # One sequence running, one slot free: an engine that steps in whole steps takes the new
    # request after the step under way (up to one step), then prefills it, then its first step.
    queue = QueueSnapshot(running=((0, 10),))
    assert predict_ttft(queue, RATES, 100).backlog_s == 0.0
    p = predict_ttft(queue, RATES, 100, in_flight_s=0.02)
    assert p.backlog_s == pytest.approx(0.02) and p.ttft_s == pytest.approx(0.02 + 0.1 + 0.02)
    # A slot that frees later than the step under way is not moved.
    full = QueueSnapshot(running=((0, 5), (0, 50)))
    assert predict_ttft(full, RATES, 100, in_flight_s=0.02).backlog_s == pytest.approx(0.1)
