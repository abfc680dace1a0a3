"""`plimsoll bench spec-ab`: is a speculative-decoding config worth keeping on this workload?

What it is: the same closed-loop workload against two servers that differ only in
``--speculative-config`` — a baseline and a candidate — in alternating windows (A, B,
A, B …, so a busy spell of the host or a warming cache hits both arms alike), then
the gain (TPOT p50, end-to-end p50 and output tokens/s of the candidate against the
baseline), the acceptance rate from the candidate's own counters
(``*_spec_decode_num_accepted_tokens_total`` ÷ ``*_num_draft_tokens_total``, plimsoll's
or vLLM's names), and the decision: keep the config when the candidate decodes more
than 30 % faster (TPOT p50) without more errors. Run it for the 30 minutes an A/B is
advised to run for a decision that holds; a short run is a smoke test.
What it is not: a way to start the servers (run both, e.g. two replicas or two
`plimsoll serve` processes), or a sweep: one concurrency, where the service runs.
"""

from __future__ import annotations

import statistics
from typing import Any

import httpx

from plimsoll import metric_names as mn
from plimsoll.bench.scenarios import Windows, windowed_levels
from plimsoll.bench.scrape import Snapshot, counter_delta, fetch
from plimsoll.bench.session import BenchSession, LevelStart

KEEP_ABOVE = 0.30  # the candidate must decode this much faster (TPOT p50) to be kept
SPEC_COUNTERS = {
    "plimsoll": (mn.SPEC_DECODE_NUM_DRAFT_TOKENS, mn.SPEC_DECODE_NUM_ACCEPTED_TOKENS),
    "vllm": ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_accepted_tokens_total"),
}


def _median(levels: list[dict[str, Any]], *path: str) -> float | None:
    values = []
    for lv in levels:
        value: Any = lv
        for key in path:
            value = (value or {}).get(key)
        if value is not None:
            values.append(float(value))
    return statistics.median(values) if values else None


def _arm(levels: list[dict[str, Any]]) -> dict[str, Any]:
    ok = sum(lv["requests"]["completed"] for lv in levels)
    failed = sum(lv["requests"]["failed"] for lv in levels)
    return {
        "windows": len(levels),
        "requests": ok + failed,
        "error_rate": failed / (ok + failed) if ok + failed else None,
        "tpot_p50_ms": _median(levels, "latency_ms", "tpot", "p50"),
        "e2e_p50_ms": _median(levels, "latency_ms", "e2e", "p50"),
        "ttft_p95_ms": _median(levels, "latency_ms", "ttft", "p95"),
        "output_tokens_per_s": _median(levels, "throughput", "output_tokens_per_s"),
    }


def _gain(base: float | None, candidate: float | None, lower_is_better: bool) -> float | None:
    """Relative gain of the candidate: how much faster (or more) it is than the baseline."""
    if base is None or candidate is None or base <= 0 or candidate <= 0:
        return None
    return base / candidate - 1.0 if lower_is_better else candidate / base - 1.0


def acceptance(first: Snapshot, last: Snapshot, family: str | None) -> dict[str, float | None]:
    """Draft tokens proposed and accepted between two scrapes of the candidate, and their ratio."""
    drafts_name, accepted_name = SPEC_COUNTERS.get(family or "plimsoll", SPEC_COUNTERS["plimsoll"])
    drafts, accepted = counter_delta(first, last, drafts_name), counter_delta(first, last, accepted_name)
    rate = accepted / drafts if drafts and accepted is not None else None
    return {"draft_tokens": drafts, "accepted_tokens": accepted, "acceptance_rate": rate}


def decide(baseline: dict[str, Any], candidate: dict[str, Any]) -> tuple[str, str, dict[str, float | None]]:
    """("keep" | "drop" | "inconclusive", why, the gains) for the two arms' figures."""
    gains = {
        "tpot_p50": _gain(baseline["tpot_p50_ms"], candidate["tpot_p50_ms"], lower_is_better=True),
        "e2e_p50": _gain(baseline["e2e_p50_ms"], candidate["e2e_p50_ms"], lower_is_better=True),
        "output_tokens_per_s": _gain(
            baseline["output_tokens_per_s"], candidate["output_tokens_per_s"], lower_is_better=False
        ),
    }
    speed = gains["tpot_p50"]
    if speed is None:
        return "inconclusive", "no TPOT measured in one of the arms (outputs of one token?)", gains
    more_errors = (candidate["error_rate"] or 0.0) > (baseline["error_rate"] or 0.0) + 0.01
    if more_errors:
        return (
            "drop",
            (
                f"the speculative config failed more requests ({candidate['error_rate']:.1%} against "
                f"{baseline['error_rate']:.1%})"
            ),
            gains,
        )
    verdict = "keep" if speed > KEEP_ABOVE else "drop"
    return (
        verdict,
        (
            f"decodes {speed:+.0%} faster (TPOT p50 {candidate['tpot_p50_ms']:.1f} ms against "
            f"{baseline['tpot_p50_ms']:.1f} ms); {'above' if verdict == 'keep' else 'not above'} the "
            f"{KEEP_ABOVE:.0%} a speculative config must win by to be kept"
        ),
        gains,
    )


async def run_spec_ab(
    baseline: BenchSession, candidate: BenchSession, each: Windows, on_start: LevelStart | None = None
) -> dict[str, Any]:
    """Alternate ``each`` window by window on the two servers; the report is the baseline session's."""
    http = candidate.client.http
    first_scrape = await _scrape(http, candidate.cfg.url)
    sessions = [({"arm": "baseline"}, baseline), ({"arm": "speculative"}, candidate)]
    base_levels, spec_levels = await windowed_levels(sessions, each, on_start)
    arms = {"baseline": base_levels, "speculative": spec_levels}
    last_scrape = await _scrape(http, candidate.cfg.url)
    figures = {name: _arm(levels) for name, levels in arms.items()}
    accepted: dict[str, float | None] = {
        "draft_tokens": None,
        "accepted_tokens": None,
        "acceptance_rate": None,
    }
    if first_scrape is not None and last_scrape is not None:
        accepted = acceptance(first_scrape, last_scrape, candidate.engine_family)
    verdict, why, gains = decide(figures["baseline"], figures["speculative"])
    if not accepted["draft_tokens"]:
        baseline.warnings.append(
            f"the speculative server at {candidate.cfg.url} proposed no draft tokens: is it started with "
            "--speculative-config, and does it export the spec_decode counters?"
        )
    scenario = {
        "baseline_url": baseline.cfg.url,
        "speculative_url": candidate.cfg.url,
        "concurrency": each.concurrency,
        "windows_per_arm": each.count,
        "window_s": each.window_s,
        "arms": figures,
        "gain": gains,
        **accepted,
        "recommendation": verdict,
        "why": why,
        "keep_above": KEEP_ABOVE,
    }
    levels = [lv for pair in zip(arms["baseline"], arms["speculative"], strict=True) for lv in pair]
    baseline.warnings.extend(candidate.warnings)
    return baseline.report("spec_ab", levels, scenario, knees=False)


async def _scrape(http: httpx.AsyncClient, url: str) -> Snapshot | None:
    try:
        return await fetch(http, url)
    except (httpx.HTTPError, ValueError):
        return None
