"""Prefill/decode disaggregation against aggregated serving, at equal replica count, on this machine.

Two real `plimsoll serve` replicas started with ``--kv-transfer-config '{"kv_role": "kv_both"}'``
(each may prefill or decode; KV blocks move between them over the built-in TCP transport), each
pinned to its own CPU with one thread (``--no-pin`` to let them float), and two workloads:

  long prompt, short output   (--long-input tokens in, --long-output out)
  short prompt, long output   (--short-input in, --short-output out)

Per workload:
  1. a profile of one replica (closed-loop c = 1, 2, 4): what ``plimsoll plan`` predicts from, and
     the unloaded TTFT and TPOT the SLOs are set from (TTFT p95 ≤ --ttft-x × TTFT at c=1,
     TPOT p50 ≤ --tpot-x × TPOT at c=1), so the SLOs mean the same on a fast or a slow host;
  2. `plimsoll bench disagg`'s comparison: aggregated on both replicas, then 1P:1D, the same
     closed-loop levels per replica through the real router, --repeats times in A B, B A order (each
     layout's figures the mean of its repeats): TTFT, TPOT and ITL p50/p95, goodput per replica
     under the SLO, the KV transfer in ms and MB per request, and the verdict;
  3. the prediction of ``plimsoll plan --link-bandwidth`` from the profile and the link's measured
     rate at the comparison's levels, judged against the measurement's noise band, and whether it
     agrees with the measured verdict: the same category (split, aggregated, or no clear gain). The
     replicas here are CPU replicas, whose own cores move the KV blocks: the prediction charges each
     transfer's measured CPU time per request to each side (the split's "KV CPU ms/req P/D", the
     replicas' ``plimsoll_kv_transfer_cpu_seconds``), and, for comparison, the pull's wall time to
     both sides, as it did before the CPU time was measured, and the CPU time over the share of its
     core the profiled replica got at c = 1 (its process CPU per wall second: on a shared host the
     profile's times are wall times of a partly-served core, and so is a transfer's cost).

The default model is small (``SMALL_SHAPE``: random weights, SmolLM2-135M's heads at 8 layers of
width 384) so that both workloads finish in minutes on a shared 2-core host; ``--model smollm2-135m``
measures the real embedded model (tens of minutes on such a host).

    python benchmarks/pd_split.py [--model smollm2-135m] [--levels 1,2] [--requests 16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

from plimsoll.bench.config import SLO, BenchConfig, LengthSpec
from plimsoll.bench.disagg import compare, summary_lines
from plimsoll.bench.session import BenchSession
from plimsoll.disaggregation import (
    Ratio,
    moved_tokens,
    parse_ratios,
    predict,
    profile_from_report,
    pull_stall_for,
    verdict,
)
from plimsoll.runtime.testing import ServerProcess

LINK: dict[str, float] = {}  # the KV link's rate, as the first workload's pulls measured it


# The default model: SmolLM2-135M's attention geometry (head dim 64, 3 query heads per KV head) at
# a width and depth a shared 2-core host runs through both workloads in minutes; random weights, the
# byte-level tokenizer (one token per byte of prompt). ``--model smollm2-135m`` runs the real one.
SMALL_SHAPE: dict[str, Any] = dict(
    vocab_size=259, hidden_size=384, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=6,
    num_key_value_heads=2, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    tie_word_embeddings=False,
)  # fmt: skip
SMALL = "small-llama"


def small_model() -> str:
    """The default model's directory, written once under ~/.cache/plimsoll/bench-models."""
    from pathlib import Path

    from transformers import LlamaConfig

    from plimsoll.plan import parameter_count, read_model_config
    from plimsoll.runtime.testing import save_random_model

    directory = Path.home() / ".cache" / "plimsoll" / "bench-models" / "pd-split-llama"
    if not (directory / "tokens-ascii").exists():
        save_random_model(directory, LlamaConfig(**SMALL_SHAPE))
        ascii_output(directory)
    params = parameter_count(read_model_config(directory))
    print(f"model: random Llama, {params / 1e6:.1f} M parameters (SmolLM2-135M's heads, 8 layers of width 384), "
          f"byte-level tokenizer, at {directory}")  # fmt: skip
    return str(directory)


def ascii_output(directory: Any) -> None:
    """Make the random model write printable ASCII: a random byte-level model otherwise picks bytes of
    half a UTF-8 character about half the time, which stream no text (the bench's "empty" error).
    The output rows of every other token are zeroed and the ASCII ones scaled up; the compute is
    unchanged."""
    import torch
    from safetensors.torch import load_file, save_file

    from plimsoll.runtime.testing import byte_level_tokenizer

    tok = byte_level_tokenizer()
    keep = [
        i for i in range(SMALL_SHAPE["vocab_size"]) if len(t := tok.decode([i])) == 1 and 32 <= ord(t) < 127
    ]
    path = directory / "model.safetensors"
    weights = load_file(path)
    head = weights["lm_head.weight"]
    scaled = torch.zeros_like(head)
    scaled[keep] = head[keep] * 20
    weights["lm_head.weight"] = scaled
    save_file(weights, path, metadata={"format": "pt"})
    (directory / "tokens-ascii").write_text(f"{len(keep)} printable ASCII tokens kept\n")


def serve(model: str, cpu: int | None, max_model_len: int, kv_cache: str) -> ServerProcess:
    both = json.dumps({"kv_role": "kv_both", "kv_ip": "127.0.0.1", "kv_port": 0})
    prelude = f"import os; os.sched_setaffinity(0, {{{cpu}}})" if cpu is not None else ""
    env = {"OMP_NUM_THREADS": "1"} if cpu is not None else {}
    return ServerProcess(["--model", model, "--max-model-len", str(max_model_len), "--kv-cache-memory", kv_cache,
                          "--max-num-seqs", "16", "--kv-transfer-config", both, "--log-level", "warning"],
                         startup_timeout=600, env=env, prelude=prelude)  # fmt: skip


def config(
    url: str,
    isl: int,
    osl: int,
    levels: tuple[int, ...],
    requests: int,
    slo: SLO,
    seed: int,
    repeats: int = 1,
) -> BenchConfig:
    return BenchConfig(
        url=url, input_tokens=LengthSpec(value=isl), output_tokens=LengthSpec(value=osl), levels=levels,
        requests_per_level=requests, warmup_requests=1, slo=slo, seed=seed, request_timeout_s=600, repeats=repeats,
        max_client_lag_ms=1000, min_concurrency_ratio=0.5, max_error_rate=0.05,
    )  # fmt: skip


async def process_cpu(url: str) -> float:
    """The replica's process CPU seconds so far (prometheus_client's process collector)."""
    import httpx

    from plimsoll.prometheus import parse

    async with httpx.AsyncClient(timeout=10) as client:
        return parse((await client.get(f"{url}/metrics")).text).sum("process_cpu_seconds_total") or 0.0


async def profile(url: str, isl: int, osl: int, requests: int, seed: int) -> dict[str, Any]:
    """One replica at c = 1, 2, 4: a sweep report's levels (what `plimsoll plan --report` reads), and
    ``core_share``: the replica's CPU seconds per wall second at c = 1, where it is busy all the time —
    the share of its core it got from a host it shares, which turns CPU time into its wall time."""
    session = await BenchSession.open(config(url, isl, osl, (1, 2, 4), requests, SLO(), seed))
    try:
        cpu0, t0 = await process_cpu(url), time.monotonic()
        levels = [await session.level(1)]
        share = (await process_cpu(url) - cpu0) / (time.monotonic() - t0)
        return {"levels": [*levels, *[await session.level(c) for c in (2, 4)]], "core_share": share}
    finally:
        await session.aclose()


def ms(level: dict[str, Any], metric: str, pct: str = "p50") -> float:
    return float(level["latency_ms"][metric][pct])


async def workload(
    name: str, urls: list[str], args: argparse.Namespace, isl: int, osl: int, seed: int
) -> dict[str, Any]:
    print(f"\n== {name}: {isl} prompt tokens, {osl} output tokens ==", flush=True)
    t0 = time.monotonic()
    prof = await profile(urls[0], isl, osl, args.profile_requests, seed)
    c1 = prof["levels"][0]
    slo = SLO(
        ttft_p95_ms=round(args.ttft_x * ms(c1, "ttft"), 1), tpot_p50_ms=round(args.tpot_x * ms(c1, "tpot"), 1)
    )
    print(f"profile (one replica, c=1,2,4) in {time.monotonic() - t0:.0f} s: " + "; ".join(
        f"c={lv['concurrency']} TTFT p50 {ms(lv, 'ttft'):.0f} ms TPOT p50 {ms(lv, 'tpot'):.1f} ms"
        for lv in prof["levels"]))  # fmt: skip
    print(f"SLO: TTFT p95 <= {slo.ttft_p95_ms:g} ms ({args.ttft_x:g} x c=1), "
          f"TPOT p50 <= {slo.tpot_p50_ms:g} ms ({args.tpot_x:g} x c=1)", flush=True)  # fmt: skip
    t0 = time.monotonic()
    cfg = config(urls[0], isl, osl, args.levels, args.requests, slo, seed + 1, args.repeats)
    report = await compare(cfg, urls, args.ratios, args.levels, lambda line: print("  " + line, flush=True))
    print(f"comparison in {time.monotonic() - t0:.0f} s")
    for line in summary_lines(report):
        print(line)
    measured = report["verdict"]
    split = next(lay for lay in measured["layouts"] if lay["layout"] != "aggregated")
    # The link as this run measured it: bytes moved over the time the pulls took (kept for a workload
    # whose prompts are too short to move a block).
    if split["transfer_s"] and split["transfer_bytes"]:
        LINK["bytes_per_s"] = split["transfer_bytes"] / split["transfer_s"]
        LINK["kv_per_token"] = split["transfer_bytes"] / max(1.0, moved_tokens(isl))  # whole blocks moved
    link, kv_per_token = LINK.get("bytes_per_s"), LINK.get("kv_per_token", 0.0)
    out: dict[str, Any] = {"name": name, "input_tokens": isl, "output_tokens": osl, "slo": slo.model_dump(),
                           "profile": prof, "measured": report}  # fmt: skip
    cpu = (split["transfer_cpu_producer_s"], split["transfer_cpu_consumer_s"])
    for lay in measured["layouts"]:
        runs = [d["replica_cpu_s_per_request"] for d in report["layouts"] if d["layout"] == lay["layout"]]
        roles = sorted({role for r in runs for role in r})
        print(f"replica process CPU ms per request, {lay['layout']} (each repeat): " + "; ".join(
            ", ".join(f"{role} {r[role] * 1e3:.1f}" for role in roles if role in r) for r in runs))  # fmt: skip
    stages = [d["transfer_cpu_s_per_request"] for d in report["layouts"] if d["transfer_cpu_s_per_request"]]
    if stages:
        print("transfer CPU ms per request by side:stage:thread (mean of the split's repeats): " + ", ".join(
            f"{k} {sum(st.get(k, 0.0) for st in stages) / len(stages) * 1e3:.2f}" for k in stages[0]))  # fmt: skip
    if link:
        prof_ = profile_from_report(prof, kv_per_token, slo.tpot_p50_ms / 1e3)
        # At the levels the comparison ran (per replica), judged against the measurement's own noise band;
        # CPU replicas: the transfer's measured CPU time charged to each side (the wall time when unmeasured).
        band = measured["band"]
        measured_cpu = cpu if None not in cpu else None

        # The bench's own CPU per request (its load generator and the router it runs), on the replicas' cores.
        host = {lay["layout"]: lay["bench_cpu_s"] for lay in measured["layouts"] if lay.get("bench_cpu_s")}

        def judged(transfer_cpu: tuple[float, float] | None, on_host: dict[str, float] = host) -> Any:
            return verdict(predict(prof_, isl, osl, link, args.ratios, slo.ttft_p95_ms / 1e3, slo.tpot_p50_ms / 1e3,
                                   levels=args.levels, pull_stall=pull_stall_for(0), transfer_cpu_s=transfer_cpu,
                                   host_cpu_s=on_host), margin=band)  # fmt: skip

        predicted, by_wall, apart = judged(measured_cpu), judged(None), judged(measured_cpu, {})
        # The profile's times are wall times on a core shared with the host's other work: the transfer's CPU
        # time in the same units is its CPU time over the share of the core the replica got.
        share = min(1.0, prof["core_share"])
        by_share = judged((cpu[0] / share, cpu[1] / share)) if measured_cpu and share > 0 else None
        agrees = predicted.category == measured["category"]
        steps = ", ".join(f"{b:g}: {t * 1e3:.1f} ms" for b, t in prof_.step_s)
        charged = (f"the transfer's measured CPU charged: {cpu[0] * 1e3:.2f} ms prefill side, {cpu[1] * 1e3:.2f} ms "
                   "decode side" if measured_cpu else "the transfer's wall time charged to both sides (CPU unmeasured)")  # fmt: skip
        print(f"predicted (plimsoll plan, link {link / 1e6:.0f} MB/s measured, prefill "
              f"{prof_.prefill_tokens_per_s:,.0f} tok/s, decode step by sequences {steps}, "
              f"{prof_.request_overhead_s * 1e3:.1f} ms a request outside the engine's compute; levels "
              f"{', '.join(map(str, args.levels))} per replica; band {band:.0%}; {charged}): {predicted.category}, run "
              f"{predicted.runs} — {'agrees with' if agrees else 'DIFFERS from'} the measurement")  # fmt: skip
        for lay in predicted.layouts:
            print(f"  predicted {lay.layout}: {lay.goodput_per_replica:.3g} good req/s per replica, TTFT "
                  f"{(lay.ttft_p50_s or 0) * 1e3:.0f} ms, TPOT {(lay.tpot_p50_s or 0) * 1e3:.1f} ms ({lay.limited_by})")  # fmt: skip
        said = [r for r in predicted.reasons if r.startswith(("split ", "aggregated:", "no clear gain"))]
        print(f"  predicted: {said[-1] if said else predicted.reasons[-1]}")
        # The same prediction at the plan's own band (what `plimsoll plan` prints without a measurement).
        alone = verdict(predicted.layouts)
        print(f"  predicted at the plan's {alone.band:.0%} band: {alone.category}")
        apart_gain = gain_of(apart.layouts)
        apart_agrees = apart.category == measured["category"]
        print("  predicted without the bench's CPU on the replicas' cores ("
              + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in host.items()) + f" per request): {apart_gain:+.0%}, "
              f"{apart.category} — {'agrees with' if apart_agrees else 'DIFFERS from'} the measurement")  # fmt: skip
        wall_gain = gain_of(by_wall.layouts)
        wall_agrees = by_wall.category == measured["category"]
        print(f"  predicted with the wall time charged instead: {wall_gain:+.0%}, {by_wall.category} — "
              f"{'agrees with' if wall_agrees else 'DIFFERS from'} the measurement")  # fmt: skip
        share_fig: dict[str, Any] | None = None
        if by_share is not None:
            share_gain = gain_of(by_share.layouts)
            share_agrees = by_share.category == measured["category"]
            print(f"  predicted with the CPU time at the replica's measured core share ({share:.0%} of a core at "
                  f"c=1): {share_gain:+.0%}, {by_share.category} — "
                  f"{'agrees with' if share_agrees else 'DIFFERS from'} the measurement")  # fmt: skip
            share_fig = {"core_share": share, "category": by_share.category, "gain": share_gain,
                         "agrees": share_agrees}  # fmt: skip
        out["predicted"] = {**predicted.to_dict(), "link_bytes_per_s": link, "agrees": agrees,
                            "by_core_share": share_fig,
                            "category_at_plan_band": alone.category, "transfer_cpu_s": measured_cpu,
                            "gain": gain_of(predicted.layouts), "measured_gain": gain_of_dicts(measured["layouts"]),
                            "by_wall": {"category": by_wall.category, "gain": wall_gain, "agrees": wall_agrees},
                            "bench_cpu_s": host,
                            "without_bench_cpu": {"category": apart.category, "gain": apart_gain,
                                                  "agrees": apart_agrees}}  # fmt: skip
    return out


def gain_of(layouts: list[Any]) -> float:
    """The best split's goodput per replica against aggregated's (predicted figures)."""
    agg = layouts[0].goodput_per_replica
    best = max(lay.goodput_per_replica for lay in layouts[1:])
    return (best - agg) / agg if agg else 0.0


def gain_of_dicts(layouts: list[dict[str, Any]]) -> float:
    """The same for a report's layouts (measured figures)."""
    agg = layouts[0]["goodput_per_replica_rps"]
    best = max(lay["goodput_per_replica_rps"] for lay in layouts[1:])
    return float((best - agg) / agg) if agg else 0.0


async def main(args: argparse.Namespace) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    pins = [cpus[0], cpus[1 % len(cpus)]] if args.pin else [None, None]
    model = small_model() if args.model == SMALL else args.model
    replicas = [serve(model, cpu, args.max_model_len, args.kv_cache) for cpu in pins]
    print(f"model {args.model}; 2 replicas (kv_both) pinned to CPUs {pins}; load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)  # fmt: skip
    try:
        for r in replicas:
            r.start()
        urls = [r.url for r in replicas]
        results = [
            await workload("long prompt, short output", urls, args, args.long_input, args.long_output, 100),
            await workload("short prompt, long output", urls, args, args.short_input, args.short_output, 200),
        ]
    finally:
        for r in replicas:
            r.stop(timeout=30)
    print("\nsummary: workload — measured (noise band) — predicted, transfer CPU charged — agree — "
          "predicted, wall time charged — agree — predicted, CPU at the core share — agree — "
          "predicted without the bench's CPU — agree (same category)")  # fmt: skip
    for res in results:
        v = res["measured"]["verdict"]
        predicted = res.get("predicted")
        if predicted is None:
            print(f"  {res['name']} — {v['category']} (±{v['band']:.0%}) — no prediction (no link measured)")
            continue
        wall, by_share, apart = predicted["by_wall"], predicted["by_core_share"], predicted["without_bench_cpu"]
        shared = "-" if by_share is None else (f"{by_share['gain']:+.0%} {by_share['category']} — "
                                               f"{'yes' if by_share['agrees'] else 'NO'}")  # fmt: skip
        print(f"  {res['name']} — {predicted['measured_gain']:+.0%} {v['category']} (±{v['band']:.0%}) — "
              f"{predicted['gain']:+.0%} {predicted['category']} — {'yes' if predicted['agrees'] else 'NO'} — "
              f"{wall['gain']:+.0%} {wall['category']} — {'yes' if wall['agrees'] else 'NO'} — {shared} — "
              f"{apart['gain']:+.0%} {apart['category']} — {'yes' if apart['agrees'] else 'NO'}")  # fmt: skip
    print(f"load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2, default=str)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=SMALL, help=f"{SMALL} (written once, see SMALL_SHAPE) or a model "
                   "`plimsoll serve --model` takes, e.g. smollm2-135m")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache", default="256MiB")
    p.add_argument("--long-input", type=int, default=512)
    p.add_argument("--long-output", type=int, default=16)
    p.add_argument("--short-input", type=int, default=32)
    p.add_argument("--short-output", type=int, default=48)
    p.add_argument("--levels", type=lambda s: tuple(int(x) for x in s.split(",")), default=(1, 2))
    # 16 requests a level left a noise band of ±16-37 % even on a quiet host: 48 bring it to ±10-19 %.
    p.add_argument("--requests", type=int, default=48, help="measured requests per level of the comparison")
    p.add_argument(
        "--profile-requests", type=int, default=24, help="measured requests per level of the profile"
    )
    p.add_argument("--repeats", type=int, default=2, help="comparison repeats, every other one in reverse "
                   "layout order (A B, B A), so a drift in the host's load weighs on both layouts alike")  # fmt: skip
    p.add_argument("--ratios", type=parse_ratios, default=[Ratio(1, 1)])
    p.add_argument("--ttft-x", type=float, default=4.0, help="TTFT p95 SLO as a multiple of TTFT at c=1")
    p.add_argument("--tpot-x", type=float, default=1.5, help="TPOT p50 SLO as a multiple of TPOT at c=1")
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--output", default=None, help="write every figure as JSON here")
    # A SIGTERM unwinds like Ctrl-C, so the replicas this script started are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(asyncio.run(main(p.parse_args())))
