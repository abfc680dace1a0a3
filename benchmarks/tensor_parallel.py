"""Tensor parallelism on this CPU: TP=1 against TP=2 for a random 0.5B-class Llama, printing figures.

For each tensor-parallel size and each concurrency ``c`` (default 1 and 16), ``c``
requests of a 32-token prompt decode ``--tokens`` tokens each (ignore_eos) through
the offline engine; only pure decode steps are counted (the prefill steps are left
out), giving

- decode tok/s = decode tokens ÷ the wall time of those steps;
- collective share = rank 0's wall time inside all-reduce and the logits gather
  (``TensorParallelGroup.collective_seconds``) ÷ the same step time. On a CPU this
  includes waiting for the slower rank, which is what a step pays for it.

TP=1 runs with all of the host's intra-op threads, TP=2 with half on each rank
(``threads_per_rank``), so both use the same cores. The model (hidden 1024, 28
layers, 16 heads with 8 KV heads, MLP 4096, vocabulary 32,000: 0.5 B parameters,
2 GiB in fp32) is random and written once under ``--model-dir``. A script that
prints figures, not a test; on a shared host, say how loaded it was (``uptime``).

    python benchmarks/tensor_parallel.py --levels 1,16 --tokens 32
"""

import argparse
import os
import time
from pathlib import Path

import torch

from plimsoll.runtime.engine.config import EngineConfig
from plimsoll.runtime.engine.llm_engine import LLMEngine
from plimsoll.runtime.engine.outputs import RequestOutput, StepStats
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.testing import llama_shape

# vocab, hidden, intermediate, layers, heads, KV heads, context
SHAPE = llama_shape(32000, 1024, 4096, 28, 16, 8, 2048)


def write_model(directory: Path) -> Path:
    if (directory / "config.json").exists():
        return directory
    from transformers import LlamaConfig

    from plimsoll.plan import parameter_count, read_model_config
    from plimsoll.runtime.testing import save_random_model

    save_random_model(directory, LlamaConfig(**SHAPE, bos_token_id=1, eos_token_id=2))
    params = parameter_count(read_model_config(directory))
    print(f"random Llama: {params / 1e9:.3f} B parameters, written to {directory}")
    return directory


class DecodeSteps:
    """Sums of the pure decode steps: time, tokens, and rank 0's collective seconds during them."""

    def __init__(self) -> None:
        self.engine: LLMEngine | None = None
        self.time = self.collectives = 0.0
        self.tokens = 0
        self._last_collective = 0.0

    def _collective_total(self) -> float:
        executor = self.engine.executor if self.engine is not None else None
        return executor.group.collective_seconds if executor is not None else 0.0

    def on_step(self, stats: StepStats) -> None:
        total = self._collective_total()
        spent, self._last_collective = total - self._last_collective, total
        if stats.num_prefill_tokens == 0 and stats.num_decode_tokens > 0:
            self.time += stats.step_time_s
            self.tokens += stats.num_decode_tokens
            self.collectives += spent

    def on_request_finished(self, output: RequestOutput) -> None:
        pass

    def reset(self) -> None:
        self.time = self.collectives = 0.0
        self.tokens = 0
        self._last_collective = self._collective_total()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/plimsoll-bench-llama-0.5b"))
    ap.add_argument("--levels", default="1,16")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens per request")
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes to compare")
    ap.add_argument(
        "--threads", type=int, default=None, help="host intra-op threads to share out (default: torch's)"
    )
    args = ap.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = write_model(args.model_dir)
    levels = [int(c) for c in args.levels.split(",")]
    host_threads = torch.get_num_threads()
    print(f"host: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start (shared machine)")
    prompt = list(range(3, 35))
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    rows = []
    for tp in (int(t) for t in args.tp.split(",")):
        torch.set_num_threads(host_threads)  # each engine shares the host's threads out itself
        seen = DecodeSteps()
        config = EngineConfig(
            model=str(model),
            kv_cache_memory="512MiB",
            max_model_len=256,
            max_num_seqs=max(levels),
            tensor_parallel_size=tp,
        )
        t0 = time.monotonic()
        engine = LLMEngine(config, observer=seen)
        seen.engine = engine
        print(
            f"TP={tp}: engine up in {time.monotonic() - t0:.1f}s, {torch.get_num_threads()} threads per rank"
        )
        try:
            engine.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm up
            for c in levels:
                seen.reset()
                engine.generate([prompt] * c, params)
                tok_s = seen.tokens / seen.time
                share = seen.collectives / seen.time
                rows.append((tp, c, tok_s, seen.time / max(1, seen.tokens / c), share))
                print(
                    f"  c={c:>3}: decode {tok_s:7.1f} tok/s, step {1000 * rows[-1][3]:7.1f} ms, collectives {100 * share:4.1f}% of a step"
                )
        finally:
            engine.close()
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    print("\n| TP | c | decode tok/s | decode step ms | collective share |\n|---|---|---|---|---|")
    for tp, c, tok_s, step, share in rows:
        print(f"| {tp} | {c} | {tok_s:.1f} | {1000 * step:.1f} | {100 * share:.1f}% |")


if __name__ == "__main__":
    main()
