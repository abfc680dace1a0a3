"""A bench session against one server: pre-flight, levels, knees, the report.

What it is: :class:`BenchSession` opens the connection (model check, probe
request, token calibration, engine family from /metrics), runs closed-loop levels
with repeats and open-loop schedules, and assembles the validated report. Bad
input surfaces here as :class:`BenchError` before any load is sent, and a sweep
whose every level failed raises instead of writing a report full of zeros.
What it is not: the CLI (cli.py) or the scenario recipes (scenarios.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from plimsoll.bench.client import BenchError, OpenAIClient, calibrate, probe, resolve_model
from plimsoll.bench.config import BenchConfig
from plimsoll.bench.knees import (
    LatencyKnee,
    ThroughputKnee,
    confidence,
    is_disturbed,
    latency_knee,
    recommend,
    throughput_knee,
)
from plimsoll.bench.loadgen import LevelRun, Progress, run_concurrency, run_schedule
from plimsoll.bench.report import build_report
from plimsoll.bench.scrape import Scraper, family_of, fetch
from plimsoll.bench.stats import mark_disturbed, summarize_level
from plimsoll.bench.workload import Workload, load_local_tokenizer
from plimsoll.capacity import Recommendation

# Completed requests below which a percentile is mostly one or two samples.
MIN_SAMPLES_P95 = 20
MIN_SAMPLES_P99 = 100


def _label(lv: dict[str, Any]) -> str:
    return f"c={lv['concurrency']}" if lv["concurrency"] is not None else f"rate={lv['rate']:g}/s"


# Called as (label, repeat) when a level starts; returns the per-completion callback.
LevelStart = Callable[[str, int], Progress | None]


@dataclass(slots=True)
class BenchSession:
    cfg: BenchConfig
    client: OpenAIClient
    workload: Workload
    engine_family: str | None
    scraper: Scraper | None
    runs: list[LevelRun] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # Levels summarised so far, so that an interrupted sweep can still report them.
    finished_levels: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    async def open(cls, cfg: BenchConfig) -> BenchSession:
        model = await resolve_model(cfg)
        client = OpenAIClient(cfg, model, cfg.models)
        try:
            await probe(client, 8)
            tokenizer = load_local_tokenizer(model)
            fit = await calibrate(client) if tokenizer is None else None
            family, scraper = None, None
            try:
                snap = await fetch(client.http, cfg.url)
                fam = family_of(snap)
                if fam is not None:
                    family = "vllm" if fam.running.startswith("vllm:") else "plimsoll"
                    scraper = Scraper(cfg.url, cfg.scrape_interval_s, dict(client.http.headers))
            except (httpx.HTTPError, ValueError):
                pass
        except BaseException:
            await client.aclose()
            raise
        session = cls(cfg, client, Workload(cfg, fit, tokenizer), family, scraper)
        if scraper is None:
            session.warnings.append(
                "the server exposes no plimsoll or vLLM /metrics; server gauges not recorded"
            )
        return session

    async def aclose(self) -> None:
        await self.client.aclose()
        if self.scraper is not None:
            await self.scraper.aclose()

    def server_info(self) -> dict[str, Any]:
        info = {"url": self.cfg.url, "model": self.client.model, "engine_family": self.engine_family}
        return {**info, "models": list(self.cfg.models)} if self.cfg.models else info

    async def level(self, concurrency: int, on_start: LevelStart | None = None) -> dict[str, Any]:
        """Run all repeats of one closed-loop level and summarise them."""
        runs = []
        for repeat in range(self.cfg.repeats):
            progress = on_start(f"c={concurrency}", repeat) if on_start else None
            run = await run_concurrency(
                self.client, self.workload, self.cfg, concurrency, repeat, self.scraper, progress
            )
            runs.append(run)
        self.runs.extend(runs)
        return summarize_level(runs, self.cfg)

    async def schedule(
        self,
        offsets: list[float],
        window: tuple[float, float],
        rate: float | None,
        max_concurrency: int | None = None,
        on_start: LevelStart | None = None,
    ) -> LevelRun:
        progress = on_start(f"rate={rate:g}/s" if rate else "schedule", 0) if on_start else None
        run = await run_schedule(
            self.client, self.workload, offsets, window, rate, 0, max_concurrency, self.scraper, progress
        )
        self.runs.append(run)
        return run

    async def sweep(
        self, on_start: LevelStart | None = None, on_level: Callable[[dict[str, Any]], None] | None = None
    ) -> list[dict[str, Any]]:
        levels = []
        for c in self.cfg.levels:
            lv = await self.level(c, on_start)
            levels.append(lv)
            self.finished_levels.append(lv)
            if on_level is not None:
                on_level(lv)
        return levels

    def report(
        self,
        kind: str,
        levels: list[dict[str, Any]],
        scenario: dict[str, Any] | None = None,
        knees: bool = True,
        partial: bool = False,
    ) -> dict[str, Any]:
        """Knees, recommendation and the validated report; BenchError when nothing was valid.

        ``knees=False`` for scenarios whose levels are not a concurrency sweep (rate, burst, soak).
        """
        levels = mark_disturbed(levels, self.cfg) if knees else levels
        valid = [lv for lv in levels if lv["valid"] and lv["concurrency"] is not None]
        if levels and not any(lv["valid"] for lv in levels):
            reasons = "; ".join(
                f"{lv['concurrency'] or lv['rate']}: {', '.join(lv['invalid_reasons'])}" for lv in levels[:3]
            )
            examples = {k: v for lv in levels for k, v in lv["requests"].get("error_examples", {}).items()}
            raise BenchError(
                f"no valid level, so no report: {reasons}. Server errors seen: {examples or 'none'}"
            )
        if knees:
            thr = throughput_knee(
                [(lv["concurrency"], lv["throughput"]["output_tokens_per_s"]) for lv in valid],
                self.cfg.throughput_alpha,
            )
            lat = latency_knee(valid, self.cfg.slo)
        else:
            why = f"not computed: a {kind} run is not a concurrency sweep; use `plimsoll bench sweep`"
            thr = ThroughputKnee(None, None, self.cfg.throughput_alpha, None, why)
            lat = LatencyKnee(
                None,
                "no_data",
                "slo" if self.cfg.slo.is_set() else "inflation_vs_lowest_level",
                None,
                [],
                why,
            )
        rec = (
            recommend(thr, lat, self.cfg.headroom)
            if knees
            else Recommendation(None, self.cfg.headroom, None, None, thr.reason)
        )
        warnings = list(self.warnings)
        if partial:
            missing = [c for c in self.cfg.levels if c not in {lv["concurrency"] for lv in levels}]
            warnings.append(
                f"partial: interrupted before levels {','.join(map(str, missing))}; knees and the "
                "recommendation rest on the finished levels only"
            )
        few = [lv for lv in levels if lv["valid"] and lv["requests"]["completed"] < MIN_SAMPLES_P99]
        if few:
            counts = ", ".join(f"{_label(lv)} ({lv['requests']['completed']} requests)" for lv in few)
            warnings.append(
                f"few samples: {counts}; a p95 needs {MIN_SAMPLES_P95} and a p99 {MIN_SAMPLES_P99} completed "
                "requests to mean much, so treat those percentiles, knees and the recommendation as rough; "
                f"raise --requests-per-level to {MIN_SAMPLES_P99} or more"
            )
        if valid and valid[0]["concurrency"] != 1:
            warnings.append(
                f"the lowest valid level is c={valid[0]['concurrency']}, not 1: latency inflation "
                "limits are relative to it"
            )
        if thr.concurrency and thr.kneedle_concurrency:
            ratio = thr.kneedle_concurrency / thr.concurrency
            if not 0.5 <= ratio <= 2.0:
                warnings.append(
                    f"Kneedle cross-check ({thr.kneedle_concurrency:.1f}) disagrees with the 90% "
                    f"throughput knee ({thr.concurrency}) by more than a doubling step"
                )
        disturbed = [lv for lv in levels if is_disturbed(lv)]
        if disturbed:
            warnings.append(
                "disturbed: the host was busy during "
                + "; ".join(f"{_label(lv)} ({' and '.join(lv['disturbed']['reasons'])})" for lv in disturbed)
                + ". Client latency limits ignore those levels; rerun on a quieter host to confirm the knees"
            )
        notes = None
        if knees:
            notes = {
                "throughput": confidence(valid, thr.concurrency),
                "latency": confidence(valid, lat.concurrency),
                "recommendation": confidence(valid, rec.knee_concurrency),
            }
        workload = self.workload.describe()
        report = build_report(
            kind, self.cfg, self.server_info(), workload, levels, thr, lat, rec, warnings, scenario, notes
        )
        if partial:
            report["partial"] = True
        return report
