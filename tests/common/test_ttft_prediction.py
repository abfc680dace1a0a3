"""The TTFT predictor, pure: the model's terms one by one, and against an event-by-event replay of the same curve."""

import heapq
import math
import random

import pytest

from plimsoll.ttft_prediction import (
    QueueSnapshot,
    ServiceRates,
    backlog_seconds,
    classify_miss,
    late_waiting,
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


# ---- an admitted request judged again in the queue -------------------------------------------


def test_a_waiting_sequence_is_late_when_its_first_token_falls_past_what_its_bound_has_left() -> None:
    # Two slots, both running: 10 and 30 tokens left at 20 ms → free at 0.2 s and 0.6 s. Three wait,
    # 100-token prompts (0.1 s of prefill each), 5 tokens to generate: the first takes the slot free
    # at 0.2 s (first token 0.32 s, slot free again at 0.4 s), the second that one (0.52 s), the third
    # the one free at 0.6 s (0.72 s).
    queue = QueueSnapshot(running=((0, 10), (0, 30)), waiting=((100, 5), (100, 5), (100, 5)))
    assert late_waiting(queue, RATES, [1.0, 1.0, 1.0]) == {}
    assert late_waiting(queue, RATES, [1.0, 0.5, 1.0]) == {1: pytest.approx(0.52)}
    # The late one leaves the walk: the third takes its place and meets 0.6 s, which behind it
    # (0.72 s) it would not.
    assert late_waiting(queue, RATES, [1.0, 0.5, 0.6]) == {1: pytest.approx(0.52)}
    assert late_waiting(queue, RATES, [None, None, 0.6]) == {2: pytest.approx(0.72)}


def test_a_waiting_sequence_is_walked_as_a_request_arriving_behind_the_ones_ahead_of_it() -> None:
    rng = random.Random(7)
    for _ in range(200):
        running = tuple((rng.choice((0, 0, 50)), rng.randint(1, 40)) for _ in range(rng.randint(0, 3)))
        waiting = tuple((rng.randint(1, 200), rng.randint(1, 40)) for _ in range(rng.randint(1, 6)))
        rates = ServiceRates(rng.uniform(200, 3000), rng.uniform(0.01, 0.1), 3)
        in_flight = rng.choice((0.0, 0.05))
        # Every deadline 0, a step under way (so none starts at once): each sequence's prediction is
        # what predict_ttft gives a request of its prompt behind the same running ones, nothing
        # waiting ahead (they all left).
        late = late_waiting(QueueSnapshot(running, waiting), rates, [0.0] * len(waiting), 0.05)
        for i, (prompt, _) in enumerate(waiting):
            alone = predict_ttft(QueueSnapshot(running), rates, prompt, 1, 0.05)
            assert late[i] == pytest.approx(alone.ttft_s)
        # None late: the i-th first token is predict_ttft's for a request behind the first i.
        late = late_waiting(QueueSnapshot(running, waiting), rates, [math.inf] * len(waiting), in_flight)
        assert late == {}
        for i, (prompt, _) in enumerate(waiting):
            behind = predict_ttft(QueueSnapshot(running, waiting[:i]), rates, prompt, 1, in_flight)
            left = [math.inf] * i + [behind.ttft_s * 0.999]
            expected = {i: pytest.approx(behind.ttft_s)} if behind.backlog_s > 0 else {}
            assert late_waiting(QueueSnapshot(running, waiting[: i + 1]), rates, left, in_flight) == expected


def test_a_miss_is_a_stall_when_a_step_ran_slower_than_the_promise_allowed() -> None:
    promised = ServiceRates(prefill_tokens_per_s=1000.0, decode_step_s=0.05, max_num_seqs=4)
    # Decode steps allowed 50 ms, a step with 100 prompt tokens 150 ms.
    assert classify_miss(promised, [(0.04, 0), (0.14, 100), (0.045, 0)]) == (
        "queue",
        0.14,
        pytest.approx(0.15),
    )
    assert classify_miss(promised, [(0.04, 0), (0.14, 100), (1.2, 0)]) == ("stall", 1.2, 0.05)
    assert classify_miss(promised, [])[0] == "queue"


def test_a_sequence_the_coming_step_would_start_is_never_late() -> None:
    # A free slot, no prefill ahead: refusing it saves nothing and stops it measuring the rates.
    queue = QueueSnapshot(running=((0, 10),), waiting=((100, 5), (100, 5)))
    # The first takes the free slot now; the second waits for a slot (0.2 s) and the lane (0.1 s).
    assert late_waiting(queue, RATES, [0.0, 0.0]) == {1: pytest.approx(0.32)}
