"""`plimsoll bench disagg`: the same workload aggregated and split on the replicas at hand, and the verdict.

What it is: for each layout — aggregated on every replica given, then each ``P:D`` ratio on the first
``P + D`` of them (``P`` prefilling, ``D`` decoding) — a router of that layout is started in this
process (``router/app.py``'s ``running_router``: the real two-hop path), a bench session runs the
same closed-loop levels through it (``--levels`` are concurrency *per replica*, so every layout is
loaded alike), and the layout's figures are taken at its best level: goodput under the TTFT and TPOT
SLOs per replica, TTFT, TPOT and ITL p50/p95, and, for a split, what the KV transfer cost per
request (the replicas' ``plimsoll_kv_transfer_*`` series before and after, over the requests the
router split): its wall time and bytes, and the CPU time it took each side (producer: holding,
reading and sending the blocks; consumer: pulling, checking, staging and loading them). Every layout
also gets its replicas' whole process CPU time per request (``process_cpu_seconds_total`` before and
after, over the requests its decode replicas finished; a split's by prefill and decode replicas in
the report): what serving one request costs the layout's cores, the transfer and the second hop's
request handling included; and the bench process's own CPU per request (``time.process_time``: its
load generator and the router it runs), which on a host where they share the replicas' cores is
taken from the replicas. Each layout draws its own prompts of the same shapes (the seed moves on),
so none starts with the previous layout's prompts in its replicas' caches. With ``--repeats N`` the
layouts run N times, every other time in reverse order (A B, B A: a drift in a shared host's load weighs
on each layout alike), and each layout's figures are the mean over its repeats.
:func:`plimsoll.disaggregation.verdict` then says which layout to run and why, a layout winning only
beyond the noise band (10%, or twice the standard error of the repeats' paired differences). The replicas must be started with ``--kv-transfer-config '{"kv_role": "kv_both"}'`` (each
can then take either role); a replica that cannot is refused before any load is sent.

What it is not: the measurement of one level (``session.py``, ``loadgen.py``) or the verdict's rule.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from plimsoll import metric_names as mn
from plimsoll.bench.client import BenchError
from plimsoll.bench.config import BenchConfig, BenchInputError
from plimsoll.disaggregation import AGGREGATED, LayoutFigures, Ratio, verdict
from plimsoll.prometheus import parse

Say = Callable[[str], None]
PROCESS_CPU = "process_cpu_seconds_total"


@dataclass(frozen=True, slots=True)
class Layout:
    name: str
    prefill: tuple[str, ...]  # empty when aggregated
    decode: tuple[str, ...]  # every replica of the layout when aggregated

    @property
    def replicas(self) -> int:
        return len(self.prefill) + len(self.decode)


def layouts(urls: Sequence[str], ratios: Sequence[Ratio]) -> list[Layout]:
    """Aggregated on every URL, then each ratio on the first P + D (BenchInputError when too few)."""
    out = [Layout(AGGREGATED, (), tuple(urls))]
    for r in ratios:
        if r.replicas > len(urls):
            raise BenchInputError(
                f"ratio {r.name} needs {r.replicas} replicas and {len(urls)} were given; add --url or drop the ratio"
            )
        out.append(Layout(r.name, tuple(urls[: r.prefill]), tuple(urls[r.prefill : r.replicas])))
    return out


async def check_replicas(urls: Sequence[str], model: str | None, headers: dict[str, str]) -> None:
    """Each replica must take either role: a one-token prefill must answer with ``kv_transfer_params``."""
    async with httpx.AsyncClient(timeout=30, headers=headers) as client:
        for url in urls:
            body: dict[str, Any] = {
                "prompt": [1],
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True},
            }
            if model:
                body["model"] = model
            try:
                r = await client.post(f"{url}/v1/completions", json=body)
                params = r.json().get("kv_transfer_params") if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError) as exc:
                raise BenchError(f"{url} did not answer a probe request: {exc!r}") from exc
            if not isinstance(params, dict) or not params.get("do_remote_prefill"):
                raise BenchError(
                    f"{url} cannot prefill for another replica (HTTP {r.status_code}, no kv_transfer_params); start "
                    'every replica with --kv-transfer-config \'{"kv_role": "kv_both"}\''
                )


async def _transfer_counters(urls: Sequence[str], headers: dict[str, str]) -> dict[str, float]:
    """The KV transfer's cumulative figures over ``urls``; ``cpu:<side>:<stage>`` keys are CPU seconds."""
    totals = {"seconds": 0.0, "pulls": 0.0, "bytes": 0.0, "failures": 0.0}
    async with httpx.AsyncClient(timeout=10, headers=headers) as client:
        for url in urls:
            scrape = parse((await client.get(f"{url}/metrics")).text)
            totals["seconds"] += scrape.sum(mn.KV_TRANSFER_TIME + "_sum") or 0.0
            totals["pulls"] += scrape.sum(mn.KV_TRANSFER_TIME + "_count") or 0.0
            rows = scrape.samples.get(mn.KV_TRANSFER_BYTES, [])
            totals["bytes"] += sum(v for labels, v in rows if labels.get("direction") == "received")
            totals["failures"] += scrape.sum(mn.KV_TRANSFER_FAILURES) or 0.0
            for labels, v in scrape.samples.get(mn.KV_TRANSFER_CPU + "_sum", []):
                key = f"cpu:{labels.get('side')}:{labels.get('stage')}:{labels.get('thread')}"
                totals[key] = totals.get(key, 0.0) + v
            # The whole replica's CPU (prometheus_client's process collector) and the requests it finished.
            totals[f"process:{url}"] = scrape.sum(PROCESS_CPU) or 0.0
            totals[f"finished:{url}"] = scrape.sum(mn.REQUEST_SUCCESS) or 0.0
    return totals


def _replica_cpu(delta: dict[str, float], layout: Layout) -> dict[str, float]:
    """Process CPU seconds per client request on the layout's prefill and decode replicas (aggregated: all
    are decode replicas); empty when the replicas finished none or do not export their CPU."""
    finished = _finished(delta, layout)
    if not finished or not any(delta.get(f"process:{u}", 0.0) for u in (*layout.prefill, *layout.decode)):
        return {}
    return {
        role: sum(delta.get(f"process:{u}", 0.0) for u in urls) / finished
        for role, urls in (("prefill", layout.prefill), ("decode", layout.decode))
        if urls
    }


def _finished(delta: dict[str, float], layout: Layout) -> float:
    """Requests the layout's replicas finished over ``delta`` (every request ends on a decode replica)."""
    return sum(delta.get(f"finished:{u}", 0.0) for u in layout.decode)


def _cpu_per_request(delta: dict[str, float], requests: float) -> dict[str, float]:
    """CPU seconds per split request by ``side:stage:thread``, from the counters' difference."""
    return {k.removeprefix("cpu:"): v / requests for k, v in sorted(delta.items()) if k.startswith("cpu:")}


def _s(level: dict[str, Any], metric: str, pct: str) -> float | None:
    value = ((level.get("latency_ms") or {}).get(metric) or {}).get(pct)
    return value / 1e3 if value is not None else None


async def run_layout(
    cfg: BenchConfig, layout: Layout, levels: Sequence[int], say: Say
) -> tuple[LayoutFigures, dict[str, Any]]:
    """Route ``cfg``'s workload through ``layout`` at each per-replica level; its figures at its best level."""
    from plimsoll.bench.session import BenchSession
    from plimsoll.router.app import running_router
    from plimsoll.router.config import RouterConfig

    split = layout.name != AGGREGATED
    router = (
        RouterConfig(port=0, prefill_backends=layout.prefill, decode_backends=layout.decode)
        if split else RouterConfig(port=0, backends=layout.decode)
    )  # fmt: skip
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    async with running_router(router) as (url, state):
        session = await BenchSession.open(cfg.model_copy(update={"url": url}))
        try:
            everyone = (*layout.prefill, *layout.decode)
            before = await _transfer_counters(everyone, headers)
            cpu0 = time.process_time()
            results = []
            for per_replica in levels:
                c = per_replica * layout.replicas
                say(f"{layout.name}: c={c} ({per_replica} per replica)")
                results.append(await session.level(c))
            bench_cpu = time.process_time() - cpu0
            after = await _transfer_counters(everyone, headers)
        finally:
            await session.aclose()
        registry = state.metrics.registry
        split_requests = (
            registry.get_sample_value(
                "plimsoll_router_pd_requests_total", {"path": "split", "reason": "split"}
            )
            or 0.0
        )
        # Generation requests the router did not split (fallbacks; /v1/models and the like are not counted).
        fallbacks = sum(
            s.value
            for m in registry.collect()
            if m.name == "plimsoll_router_pd_requests"
            for s in m.samples
            if s.name.endswith("_total")
            and s.labels.get("path") != "split"
            and s.labels.get("reason") != "endpoint"
        )
    valid = [lv for lv in results if lv["valid"]]
    if not valid:
        reasons = "; ".join(", ".join(lv["invalid_reasons"]) for lv in results)
        raise BenchError(f"{layout.name}: no valid level ({reasons})")
    best = max(valid, key=lambda lv: lv["throughput"]["goodput_requests_per_s"] or 0.0)
    figures = LayoutFigures(
        layout.name, layout.replicas, float(best["throughput"]["goodput_requests_per_s"] or 0.0),
        ttft_p50_s=_s(best, "ttft", "p50"), ttft_p95_s=_s(best, "ttft", "p95"),
        tpot_p50_s=_s(best, "tpot", "p50"), tpot_p95_s=_s(best, "tpot", "p95"),
        itl_p50_s=_s(best, "itl", "p50"), itl_p95_s=_s(best, "itl", "p95"),
        prefill_replicas=len(layout.prefill), decode_replicas=len(layout.decode) if split else 0,
    )  # fmt: skip
    cpu: dict[str, float] = {}
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    replica_cpu = _replica_cpu(delta, layout)
    if replica_cpu:
        figures.replica_cpu_s = sum(replica_cpu.values())
    finished = _finished(delta, layout)
    if finished:
        figures.bench_cpu_s = bench_cpu / finished
    if split:
        if split_requests:
            figures.transfer_s = delta["seconds"] / split_requests
            figures.transfer_bytes = delta["bytes"] / split_requests
            cpu = _cpu_per_request(delta, split_requests)
            if cpu:  # replicas that export the transfer's CPU time
                figures.transfer_cpu_producer_s = sum(v for k, v in cpu.items() if k.startswith("producer:"))
                figures.transfer_cpu_consumer_s = sum(v for k, v in cpu.items() if k.startswith("consumer:"))
        if fallbacks or delta["failures"]:
            figures.notes.append(
                f"{fallbacks:.0f} requests not split, {delta['failures']:.0f} failed pulls (prefilled locally)"
            )
    detail = {"layout": layout.name, "prefill": list(layout.prefill), "decode": list(layout.decode),
              "best_concurrency": best["concurrency"], "split_requests": split_requests,
              "transfer_cpu_s_per_request": cpu, "replica_cpu_s_per_request": replica_cpu,
              "levels": results}  # fmt: skip
    return figures, detail


def mean_figures(runs: Sequence[LayoutFigures]) -> LayoutFigures:
    """One layout's repeats as one: the mean of each figure (a note gives each repeat's goodput)."""
    if len(runs) == 1:
        return runs[0]

    def mean(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) / len(known) if known else None

    first = runs[0]
    out = LayoutFigures(first.layout, first.replicas, sum(f.goodput_rps for f in runs) / len(runs),
                        prefill_replicas=first.prefill_replicas, decode_replicas=first.decode_replicas)  # fmt: skip
    for name in ("ttft_p50_s", "ttft_p95_s", "tpot_p50_s", "tpot_p95_s", "itl_p50_s", "itl_p95_s",
                 "transfer_s", "transfer_bytes", "transfer_cpu_producer_s", "transfer_cpu_consumer_s",
                 "replica_cpu_s", "bench_cpu_s"):  # fmt: skip
        setattr(out, name, mean([getattr(f, name) for f in runs]))
    each = ", ".join(f"{f.goodput_per_replica:.3g}" for f in runs)
    out.notes = [f"mean of {len(runs)} repeats; good req/s per replica in each: {each}",
                 *(n for f in runs for n in f.notes)]  # fmt: skip
    return out


def repeat_agreement(runs: dict[str, list[LayoutFigures]], chosen: str | None) -> str:
    """How many repeats, each on its own, favour the layout the means chose: the measurement's certainty."""
    agg = runs[AGGREGATED]
    splits = {name: figs for name, figs in runs.items() if name != AGGREGATED}
    best = chosen or max(splits, key=lambda name: sum(f.goodput_rps for f in splits[name]))
    pairs = list(zip(agg, splits[best], strict=True))
    ahead = sum(
        (s.goodput_per_replica > a.goodput_per_replica)
        if chosen
        else (a.goodput_per_replica >= s.goodput_per_replica)
        for a, s in pairs
    )
    winner = chosen or AGGREGATED
    other = AGGREGATED if chosen else best
    text = f"repeat by repeat, {winner} is ahead of {other} in {ahead} of {len(pairs)}"
    return text + ("" if ahead == len(pairs) else ": the host's load moves more than the layouts differ")


async def compare(
    cfg: BenchConfig, urls: Sequence[str], ratios: Sequence[Ratio], levels: Sequence[int], say: Say
) -> dict[str, Any]:
    """Every layout in turn, then the verdict; the report as a dict (``kind: disagg``)."""
    if not cfg.slo.is_set() or cfg.slo.ttft_p95_ms is None or cfg.slo.tpot_p50_ms is None:
        raise BenchInputError(
            "goodput needs the SLO it is measured under: give --slo-ttft-p95-ms and --slo-tpot-p50-ms"
        )
    plan = layouts(urls, ratios)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    await check_replicas(urls, cfg.model, headers)
    runs: dict[str, list[LayoutFigures]] = {layout.name: [] for layout in plan}
    details = []
    for r in range(cfg.repeats):
        # Every other repeat in reverse (A B, B A, ...): a drift in the host's load weighs on every layout alike.
        if cfg.repeats > 1:
            say(f"repeat {r + 1}/{cfg.repeats}")
        for layout in plan if r % 2 == 0 else plan[::-1]:
            i = plan.index(layout)
            # The same shapes, fresh prompts: a layout run after another finds none of its prompts cached there.
            seed = cfg.seed + 1009 * i + 7919 * r
            fig, detail = await run_layout(
                cfg.model_copy(update={"seed": seed, "repeats": 1}), layout, levels, say
            )
            runs[layout.name].append(fig)
            details.append({**detail, "repeat": r + 1})
    figures = [mean_figures(runs[layout.name]) for layout in plan]
    # The noise band comes from the repeats themselves: a layout wins only beyond what they move.
    v = verdict(figures, repeats={name: [f.goodput_per_replica for f in figs] for name, figs in runs.items()})
    if cfg.repeats > 1:
        v.reasons.append(repeat_agreement(runs, v.ratio))
    return {
        "kind": "disagg",
        "replicas": list(urls),
        "workload": {
            "input_tokens": cfg.input_tokens.model_dump(),
            "output_tokens": cfg.output_tokens.model_dump(),
            "levels_per_replica": list(levels),
            "repeats": cfg.repeats,
        },
        "slo": {"ttft_p95_ms": cfg.slo.ttft_p95_ms, "tpot_p50_ms": cfg.slo.tpot_p50_ms},
        "verdict": v.to_dict(),
        "layouts": details,
    }


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The report as a table and the verdict with its reasons."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.0f}"

    def cpu(lay: dict[str, Any]) -> str:
        p, c = lay.get("transfer_cpu_producer_s"), lay.get("transfer_cpu_consumer_s")
        return "-" if p is None or c is None else f"{p * 1e3:.1f}/{c * 1e3:.1f}"

    rows = [("layout", "replicas", "good/s/replica", "TTFT p50/p95 ms", "TPOT p50/p95 ms", "ITL p50/p95 ms",
             "KV ms/req", "KV MB/req", "KV CPU ms/req P/D", "CPU ms/req", "bench CPU ms/req")]  # fmt: skip
    for lay in report["verdict"]["layouts"]:
        rows.append((
            lay["layout"], str(lay["replicas"]), f"{lay['goodput_per_replica_rps']:.3f}",
            f"{ms(lay['ttft_p50_s'])}/{ms(lay['ttft_p95_s'])}", f"{ms(lay['tpot_p50_s'])}/{ms(lay['tpot_p95_s'])}",
            f"{ms(lay['itl_p50_s'])}/{ms(lay['itl_p95_s'])}",
            "-" if lay["transfer_s"] is None else f"{lay['transfer_s'] * 1e3:.1f}",
            "-" if lay["transfer_bytes"] is None else f"{lay['transfer_bytes'] / 1e6:.3f}", cpu(lay),
            "-" if lay.get("replica_cpu_s") is None else f"{lay['replica_cpu_s'] * 1e3:.1f}",
            "-" if lay.get("bench_cpu_s") is None else f"{lay['bench_cpu_s'] * 1e3:.1f}",
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    v = report["verdict"]
    lines.append(f"verdict: run {v['ratio'] or 'aggregated'} ({v['category']}, noise band {v['band']:.0%})")
    lines += [f"  - {reason}" for reason in v["reasons"]]
    for lay in v["layouts"]:
        lines += [f"  note ({lay['layout']}): {note}" for note in lay["notes"]]
    return lines
