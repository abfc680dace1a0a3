"""The synchronous engine: schedule → run → sample → update, one step at a time.

What it is: request intake (tokenise, split ``n > 1`` into sibling sequences),
the step loop, finishing rules (EOS, stop token ids, stop strings,
``max_tokens``, ``max_model_len``; ``min_tokens`` and ``ignore_eos``), fault
isolation (a request whose sampling raises fails alone), and the statistics of
every step. What it is not: threads or asyncio (see ``async_engine.py``), HTTP,
or assembling outputs (``output_processor.py``).
"""

import gc
import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from plimsoll.kv_memory import KVCacheBudget, kv_cache_line
from plimsoll.runtime.engine import kv_sizing, sleep_mode
from plimsoll.runtime.engine.compilation import cache_counters, use_cache_dir
from plimsoll.runtime.engine.config import (
    DEFAULT_CPU_KV_CACHE_MEMORY,
    DEFAULT_MAX_MODEL_LEN_CAP,
    EngineConfig,
)
from plimsoll.runtime.engine.cuda_graphs import ineligible_reason
from plimsoll.runtime.engine.detokenizer import IncrementalDetokenizer
from plimsoll.runtime.engine.kv_cache_manager import KVCacheManager
from plimsoll.runtime.engine.kv_sizing import CudaMemory, DeviceMemory
from plimsoll.runtime.engine.late_refusal import late_refusals, unstarted
from plimsoll.runtime.engine.lora_manager import LoRAManager, LoRARequest
from plimsoll.runtime.engine.model_runner import ModelRunner, cpu_options, kv_bytes_per_token, weight_cache
from plimsoll.runtime.engine.output_processor import make_request_output
from plimsoll.runtime.engine.outputs import EngineObserver, EngineStats, RequestOutput, StepStats
from plimsoll.runtime.engine.request import Continuation, Request, RequestGroup
from plimsoll.runtime.engine.sampler import Sampler, sample_each
from plimsoll.runtime.engine.sampling_params import SamplingParams
from plimsoll.runtime.engine.scheduler import Scheduler
from plimsoll.runtime.engine.service_rates import MIN_PREFILL_TOKENS, ServiceRateMeter
from plimsoll.runtime.engine.spec_decode.speculator import Speculator
from plimsoll.runtime.engine.startup import STARTUP
from plimsoll.runtime.engine.tp_executor import TensorParallelExecutor
from plimsoll.runtime.kernels import cpu_kernels
from plimsoll.runtime.kernels.host_memory import keep_freed_memory
from plimsoll.runtime.kv.connector import KVConnector, build_connector
from plimsoll.runtime.kv.remote_prefill import RemoteDecode, RemoteSource
from plimsoll.runtime.models.loader import load_model, read_hf_config
from plimsoll.runtime.models.tensor_parallel import check_tensor_parallel
from plimsoll.ttft_prediction import QueueSnapshot, TTFTDeadline, TTFTDeadlineRefusal

log = logging.getLogger(__name__)
# The warm-up's rate-measuring prompt: long enough that its prefill stands out from a decode step.
RATE_PROBE_TOKENS = 64


def select_device(device: str) -> torch.device:
    """The engine's device; ``cuda:N`` also becomes this thread's current CUDA device, since Triton
    launches and CUDA graph capture use the current device's stream, not the tensors' device."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    return dev


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        observer: EngineObserver | None = None,
        device_memory: DeviceMemory | None = None,
    ) -> None:
        """``device_memory`` replaces the device's own memory figures (``kv_sizing.py``): tests pass
        a fake card to size the cache by ``gpu_memory_utilization`` on a CPU."""
        self.config = config
        self.observer = observer
        self.device = select_device(config.device)
        # Sizing from the device: no explicit cache size, on CUDA (or with figures given).
        self.device_memory = device_memory if config.kv_cache_memory is None else None  # bytes given: kept
        if device_memory is None and config.sizes_kv_from_device and self.device.type == "cuda":
            self.device_memory = CudaMemory(self.device)
        # Tensor parallelism: this process is rank 0; the executor spawns and drives the others.
        self.executor: TensorParallelExecutor | None = None
        if config.tensor_parallel_size > 1:
            # A shape that cannot split is refused before any worker process starts.
            check_tensor_parallel(read_hf_config(config.model), config.tensor_parallel_size)
            self.executor = TensorParallelExecutor(config)
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig) -> None:
        if config.keep_freed_memory:
            keep_freed_memory()  # a step's multi-MiB activations reuse the last step's pages (kernels/host_memory.py)
        if self.device.type == "cpu":  # the process's build of the kernels, before any model uses them
            cpu_kernels.select(config.cpu_kernels, config.cpu_kernel_parallel)
        memory = self.device_memory
        if memory is None and config.kv_cache_memory is None and not self.device.type == "cpu":
            raise ValueError(
                f"the KV cache cannot be sized from {self.device.type} memory figures; set kv_cache_memory "
                "(--kv-cache-memory-bytes)"
            )
        baseline = kv_sizing.start(memory, config.gpu_memory_utilization) if memory is not None else None
        tp_group = self.executor.group if self.executor is not None else None
        loaded = load_model(
            config.model, config.torch_dtype, self.device, config.quantization, tp_group, weight_cache(config),
            defer_store=True,
        )  # fmt: skip
        # A weight cache that missed is written after Ready (the deferred warm-up): a fresh pod's
        # first answer does not wait for half a GiB to reach the disk.
        self._store_weights = loaded.store_weights
        STARTUP.mark("weights_loaded")
        self.hf_config = loaded.hf_config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.model_path = loaded.path
        bs = config.block_size
        per_token = kv_bytes_per_token(
            loaded.hf_config, config.torch_dtype, config.kv_cache_dtype, config.tensor_parallel_size
        )
        self.kv_bytes_per_token = per_token
        self.kv_budget: KVCacheBudget | None = None  # set when sized from the device
        weights = memory.memory_reserved() - baseline.reserved if memory is not None and baseline else 0
        if memory is not None and baseline is not None and self.executor is not None:
            # Tensor parallelism: the ranks cannot rerun a profiling step, so the activations are
            # estimated as `plimsoll plan` does and the weights are this rank's, measured.
            self.kv_budget = kv_sizing.estimated_budget(
                config, loaded.hf_config, memory.mem_get_info()[1], weights, per_token
            )
            self.num_blocks = self.kv_budget.num_blocks
            kv_tokens: int | None = self.num_blocks * bs
        elif memory is not None:
            # A provisional cache for the profiling run; the real one replaces it (_size_from_device).
            largest = min(config.max_num_batched_tokens, loaded.max_position_embeddings - 1)
            self.num_blocks, kv_tokens = kv_sizing.profile_blocks(largest, bs), None
        else:
            kv_bytes = config.kv_cache_memory if config.kv_cache_memory is not None else DEFAULT_CPU_KV_CACHE_MEMORY
            self.num_blocks, kv_tokens = kv_bytes // (per_token * bs), kv_bytes // (per_token * bs) * bs
            if self.num_blocks < 1:
                raise ValueError(
                    f"kv_cache_memory={kv_bytes} bytes holds no block: one block of {bs} tokens "
                    f"needs {per_token * bs} bytes ({per_token} per token); raise kv_cache_memory"
                )
        self.max_model_len = self._max_model_len(loaded.max_position_embeddings, kv_tokens)
        if self.kv_budget is not None and (problem := self.kv_budget.too_small(self.max_model_len)):
            raise ValueError(problem)
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = LoRAManager(config.max_loras, config.max_cpu_loras or config.max_loras, self.read_lora)
        self.scheduler = self._scheduler()
        self.runner = ModelRunner(
            loaded.model,
            self.num_blocks,
            bs,
            config.torch_dtype,
            self.device,
            config.attention_backend,
            lora_slots=(config.max_loras, config.max_lora_rank) if config.enable_lora else None,
            kv_cache_dtype=config.kv_cache_dtype,
            cpu_options=cpu_options(config),
        )
        plan = self.runner.cpu_plan
        # The one line naming what serves this model's steps; a warning where the kernels would run but cannot.
        log.log(logging.WARNING if plan.kernels_reason and "--cpu-kernels off" not in plan.kernels_reason
                else logging.INFO, "%s", plan.describe())  # fmt: skip
        if self.executor is not None:
            self.executor.start_workers(self.num_blocks)
            self.runner.plan_sink = self.executor.broadcast_plan
        self.kv_connector: KVConnector | None = None  # _attach_kv_connector(), on the cache serving uses
        self.prefetching: dict[str, list[Request]] = {}
        for module in config.lora_modules:
            self.add_lora(module.name, module.path)
        if self.device.type == "cuda" and (config.quantization == "int8" or config.kv_cache_dtype == "int8"):
            from plimsoll.runtime.engine import int8_speed

            # An int8 path slower than bf16 on this card says so in the log (int8_speed.py).
            self.int8_speed = int8_speed.check(
                loaded.model, config.quantization, config.kv_cache_dtype, config.attention_backend, config.max_num_seqs
            )
        self.sampler = Sampler(self.tokenizer, seed=config.seed)
        self.speculator: Speculator | None = None
        if config.speculative_config is not None:
            self.speculator = Speculator(config.speculative_config, self)
        self.rng = random.Random(config.seed)
        # The TTFT predictor's inputs (plimsoll.ttft_prediction): this replica's measured rates and its
        # queue, published after every step for the server thread to read.
        self.rate_meter = ServiceRateMeter(config.max_num_seqs)
        self._unmetered: tuple[float, int, int] | None = None  # the last step, timed when the next starts
        self.queue = QueueSnapshot()
        self.deferred_warmup = False  # the largest step and the primitives, still to run (warmup())
        self.rate_probe_due = False  # the rate probe, still to run (measure_rates())
        self._deferred_pieces: Iterator[None] | None = None  # how far run_deferred_warmup got
        self.sleep_state = sleep_mode.SleepState()
        self.groups: dict[str, RequestGroup] = {}
        self.seq_to_group: dict[str, RequestGroup] = {}
        if memory is not None and baseline is not None and self.executor is None:
            self._size_from_device(memory, baseline, weights, per_token)
        else:
            self._capture_cuda_graphs()
        STARTUP.mark("kv_cache_allocated")  # the runner holds the KV tensors now (and the graphs)
        self._attach_kv_connector(loaded)
        log.info(self.kv_cache_line())
        log.info(
            "engine ready: %s, %d KV blocks x %d tokens (%d bytes/token%s), max_model_len %d",
            self.model_path,
            self.num_blocks,
            bs,
            per_token,
            f" per rank, {config.tensor_parallel_size} ranks" if self.executor is not None else "",
            self.max_model_len,
        )

    def _scheduler(self) -> Scheduler:
        c = self.config
        kv = KVCacheManager(self.num_blocks, c.block_size)
        return Scheduler(kv, c.max_num_seqs, c.max_num_batched_tokens, self.max_model_len, c.scheduling_policy, self.lora)

    def _attach_kv_connector(self, loaded: Any) -> None:
        """KV tiers and events (runtime/kv/): the cache manager reports to the connector; requests
        whose blocks may be on disk or in the shared tier wait in ``prefetching`` until fetched.
        Attached to the cache serving uses, after any sizing from the device replaced it."""
        self.kv_connector = build_connector(
            self.config, self.runner.kv_caches, loaded.model, loaded.hf_config, self.max_model_len,
            kv=self.scheduler.kv,
        )
        if self.kv_connector is not None:
            kv = self.scheduler.kv
            kv.connector = self.kv_connector
            kv.pool.on_evicted = self.kv_connector.on_evicted
            kv.pool.on_cleared = self.kv_connector.on_cleared

    def _draft_bytes_per_token(self) -> int:
        draft = getattr(self.speculator, "draft", None)
        return int(draft.bytes_per_token) if draft is not None else 0

    def _size_from_device(self, memory: DeviceMemory, baseline: kv_sizing.Baseline, weights: int, per_token: int) -> None:
        """Run what serving will run — the largest step, the largest sampled batch, the CUDA graphs —
        over the provisional cache; size the real cache from the device's figures; swap it in."""
        memory.empty_cache()  # what start-up checks freed (int8_speed) is not this profile's peak
        memory.reset_peak_memory_stats()
        self._run_largest_step()
        kv_sizing.profile_sampler(
            self.sampler, self.config.max_logit_rows, int(self.hf_config.vocab_size), self.device
        )
        self._capture_cuda_graphs()
        draft = getattr(self.speculator, "draft", None)
        provisional = self.runner.kv_cache_bytes() + (draft.runner.kv_cache_bytes() if draft is not None else 0)
        budget = kv_sizing.measure(
            memory,
            baseline,
            self.config.gpu_memory_utilization,
            weights,
            provisional,
            per_token + self._draft_bytes_per_token(),
            self.config.block_size,
        )
        # As with an explicit size, a cache that cannot hold one sequence of max_model_len is refused.
        problem = budget.too_small(self.max_model_len)
        if problem is not None:
            raise ValueError(problem)
        self.kv_budget = budget
        self.runner.decode_graphs = None  # they point into the provisional cache
        self.runner.verify_graphs = None
        self.runner.allocate_kv_cache(0)
        if draft is not None:
            draft.resize(0)
        gc.collect()  # the graphs' memory pool goes only with the last reference to them
        memory.empty_cache()
        self.num_blocks = budget.num_blocks
        self.runner.allocate_kv_cache(self.num_blocks)
        if draft is not None:
            draft.resize(self.num_blocks)
        self.scheduler = self._scheduler()
        if self.speculator is not None:
            self.speculator.max_model_len = self.max_model_len
        self._capture_cuda_graphs(compile_forward=False)

    def kv_cache_line(self) -> str:
        """The start-up line (as vLLM's): KV bytes and where they came from, tokens, blocks, concurrency."""
        bs = self.config.block_size
        if self.kv_budget is not None:
            source = self.kv_budget.how()
            kv_bytes = self.kv_budget.kv_bytes
        elif self.config.kv_cache_memory is not None:
            source, kv_bytes = "kv_cache_memory", self.config.kv_cache_memory
        else:
            source, kv_bytes = "the CPU default; set --kv-cache-memory-bytes", DEFAULT_CPU_KV_CACHE_MEMORY
        return str(kv_cache_line(kv_bytes, self.num_blocks, bs, self.max_model_len, source))

    def _capture_cuda_graphs(self, compile_forward: bool = True) -> None:
        """Compile the forward (``--compilation-config`` mode 3, the default on CUDA:
        engine/compilation.py), then, on CUDA with the Triton backend, capture the graphs that
        uniform decode and verify steps replay (cuda_graphs.py). ``compile_forward=False``
        recaptures the graphs only (the compiled forward takes the KV cache as an argument, so a
        resized cache keeps it)."""
        config = self.config
        compilation = config.compilation_config
        if compilation.cache_dir is not None:
            log.info("compile caches in %s", use_cache_dir(compilation.cache_dir))
        graphs_off = ineligible_reason(
            self.device,
            config.attention_backend,
            config.enforce_eager,
            tensor_parallel=self.executor is not None,
        )
        mode = compilation.resolved_mode(self.device.type)
        if mode == 3 and self.executor is not None:
            log.info("the forward runs eagerly: tensor parallelism is not compiled")
        elif mode == 3 and compile_forward:
            # CUDA-graph capture compiles each graph as it warms up; otherwise compile now.
            self.runner.enable_compile(warm_up=graphs_off is not None)
        if graphs_off is not None:
            if self.device.type == "cuda":
                log.info("steps run without CUDA graphs: %s", graphs_off)
            return
        spec = config.speculative_config
        self.runner.enable_cuda_graphs(
            config.max_num_seqs,
            self.max_model_len,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            sizes=compilation.cudagraph_capture_sizes,
        )

    def compile_report(self) -> dict[str, Any]:
        """What start-up spent compiling and capturing, and the compile caches' counters."""
        runner = self.runner
        compiled = runner.compiled
        graphs = [g for g in (runner.decode_graphs, runner.verify_graphs) if g is not None]
        return {
            "compiled": compiled is not None,
            "compile_seconds": round(compiled.compile_seconds, 3) if compiled is not None else 0.0,
            "compiled_graphs": compiled.graphs if compiled is not None else 0,
            "cuda_graph_capture_seconds": round(sum(g.capture_s for g in graphs), 3),
            "cuda_graph_sizes": {g.query_len: g.sizes for g in graphs},
            "cache_counters": cache_counters(),
        }

    def close(self) -> None:
        """Stop the tensor-parallel workers and the KV tiers' threads, if any."""
        if self.executor is not None:
            self.executor.close()
        connector = getattr(self, "kv_connector", None)
        if connector is not None:
            connector.close()

    def _max_model_len(self, model_max: int, kv_tokens: int | None) -> int:
        """The longest sequence served; ``kv_tokens`` None: the cache is not sized yet (it is then
        checked against this length once it is)."""
        cfg = self.hf_config
        window = getattr(cfg, "sliding_window", None)
        if getattr(cfg, "use_sliding_window", True) is False:
            window = None
        asked = self.config.max_model_len
        limits = {"the model's max_position_embeddings": model_max}
        if kv_tokens is not None:
            limits["the KV cache"] = kv_tokens
        if window:
            limits["the model's sliding_window (not implemented)"] = int(window)
        if asked is None:
            # Like vLLM: a KV budget that cannot hold one sequence of the default length is
            # refused at start, not silently turned into a tiny max_model_len.
            default = int(min(DEFAULT_MAX_MODEL_LEN_CAP, *(v for k, v in limits.items() if k != "the KV cache")))
            if kv_tokens is not None and kv_tokens < default:
                bs = self.config.block_size
                kv_bytes = self.config.kv_cache_memory or DEFAULT_CPU_KV_CACHE_MEMORY
                per_token = kv_bytes // max(kv_tokens, 1) if kv_tokens else 0
                need = -(-default // bs) * bs
                raise ValueError(
                    f"the KV cache holds {kv_tokens} tokens ({self.num_blocks} blocks of {bs}, "
                    f"kv_cache_memory={kv_bytes} bytes), less than one sequence of "
                    f"max_model_len {default} ({need} tokens"
                    + (f", about {need * per_token} bytes" if per_token else "")
                    + "); raise kv_cache_memory, or set max_model_len explicitly "
                    f"to at most {kv_tokens}"
                )
            return default
        for what, limit in limits.items():
            if asked > limit:
                raise ValueError(
                    f"max_model_len={asked} exceeds {what} ({limit} tokens); lower max_model_len"
                    + (" or raise kv_cache_memory" if what == "the KV cache" else "")
                )
        return int(asked)

    @property
    def model_name(self) -> str:
        return str(self.config.display_name)

    # -- LoRA adapters (--enable-lora) -----------------------------------------------------

    def read_lora(self, name: str, path: str) -> Any:
        """Read and check a PEFT adapter against this model; raises ``LoRAAdapterError``. Any thread."""
        from plimsoll.runtime.models.lora import read_peft_adapter

        return read_peft_adapter(name, path, self.hf_config, self.config.max_lora_rank, self.config.torch_dtype)

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this server; start it with --enable-lora")
        return self.lora

    def add_lora(self, name: str, path: str, weights: Any = None) -> LoRARequest:
        """Register an adapter (``weights`` already read, or read now); nothing changes on error."""
        manager = self._lora_manager()
        if name == self.model_name:
            raise ValueError(f"'{name}' is the base model's name; give the adapter another lora_name")
        if name in manager.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded; unload it first.")
        lora = manager.add(name, path, weights if weights is not None else self.read_lora(name, path))
        log.info("LoRA adapter %s loaded from %s", name, path)
        return lora

    def remove_lora(self, name: str) -> None:
        """Unregister an adapter; refused (``LoRAInUseError``) while a request uses it."""
        self._lora_manager().remove(name, self.scheduler.requests.values())
        log.info("LoRA adapter %s unloaded", name)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.lora.adapters.values()) if self.lora is not None else []

    # -- intake -------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(prompt).input_ids)
        vocab = int(self.hf_config.vocab_size)
        if not prompt or any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(
                f"a token-id prompt must be a non-empty list of ints in [0, {vocab}), this model's vocabulary"
            )
        return None, list(prompt)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        prompt_token_ids: list[int] | None = None,
        lora_name: str | None = None,
        *,
        priority: int = 0,
        fairness_id: str | None = None,
        continuation: Continuation | None = None,
        cache_salt: str | None = None,
        ttft_deadline: TTFTDeadline | None = None,
    ) -> None:
        """Validate and queue; raises ``ValueError`` (nothing queued) on bad input.

        ``prompt_token_ids`` skips tokenising a text prompt that the caller already tokenised;
        ``lora_name`` runs it under that adapter (``LoRANotFoundError`` if none is loaded by that name).
        ``priority`` (lower first) and ``fairness_id`` (the tenant) are the request's scheduling
        attributes, read by ``--scheduling-policy priority`` only, as vLLM's ``add_request`` takes them.
        ``continuation`` picks the request up after output it already produced elsewhere (see
        ``Continuation``): its tokens are prefilled with the prompt (a prefix-cache hit where the
        blocks are cached) and sampling goes on from the next position.
        ``cache_salt`` (vLLM's per-request field; the server folds the tenant into it) starts the
        prefix-cache hash chain: requests with different salts never share a cached block.
        ``ttft_deadline``: the TTFT bound it was admitted under; until it starts it may be refused
        from the queue (:meth:`refuse_late`).
        """
        vocab = int(self.hf_config.vocab_size)
        params.validate(vocab)  # every id a request carries indexes the logits on the device
        if self.sleep_state.level:
            raise sleep_mode.SleepModeError(
                f"the engine is asleep (level {self.sleep_state.level}); POST /wake_up first"
            )
        lora = self._lora_manager().get(lora_name) if lora_name is not None else None
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use; use a unique id")
        if prompt_token_ids is not None:
            text, ids = (prompt if isinstance(prompt, str) else None), list(prompt_token_ids)
        else:
            text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty; send at least one token")
        if prompt_token_ids is not None and not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_token_ids must be ints in [0, {vocab}), this model's vocabulary")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}, which must "
                "also leave room for at least one generated token; shorten the prompt"
            )
        if continuation is not None:
            self._check_continuation(continuation, ids, params)
        transfer = self._kv_transfer_of(params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        if self.config.enable_prefix_caching:
            salt: str | None = f"salt:{cache_salt}" if cache_salt else ""
        else:
            # Caching off: siblings of one n>1 request still share their prompt blocks.
            salt = f"group:{request_id}:{id(params)}" if params.n > 1 else None
        if lora is not None and salt is not None:
            # The adapter changes every layer's K and V: its blocks are its own (block 0's salt
            # starts the hash chain, so every later block differs too).
            salt = f"lora:{lora.lora_int_id}:{salt}"
        seqs = []
        for i in range(params.n):
            seq_id = request_id if params.n == 1 else f"{request_id}#{i}"
            seq = Request(
                seq_id, request_id, i, ids, params, self.eos_token_ids, arrival,
                cache_salt=salt, priority=priority, fairness_id=fairness_id,
            )
            seq.ttft_deadline = ttft_deadline
            seq.lora = lora  # a seeded sequence's generator is made on the logits' device when it first samples
            seq.kv_transfer = transfer
            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, ids, params.stop, params.skip_special_tokens
            )
            if continuation is not None:
                seq.continue_from(continuation.token_ids)
                seq.detokenizer.prime(continuation.token_ids, continuation.num_chars)
            seqs.append(seq)
        group = RequestGroup(request_id, text, ids, seqs, arrival)
        for seq in seqs:
            self.seq_to_group[seq.request_id] = group
        self.groups[request_id] = group
        if self._start_prefetch(seqs[0]):
            self.prefetching[request_id] = seqs  # scheduled once its blocks are fetched (or not found)
            return
        for seq in seqs:
            self.scheduler.add_request(seq)

    def _kv_transfer_of(self, params: SamplingParams) -> RemoteDecode | RemoteSource | None:
        """What the request's ``kv_transfer_params`` ask (``ValueError`` if this replica's role forbids it).

        Without ``--kv-transfer-config`` they are ignored, as vLLM does: the request runs here in full.
        """
        remote = self.kv_connector.remote if self.kv_connector is not None else None
        if remote is None or not params.kv_transfer_params:
            return None
        return remote.parse(params.kv_transfer_params, params.n)

    def _start_prefetch(self, seq: Request) -> bool:
        connector = self.kv_connector
        if connector is None or seq.cache_salt is None:
            return False
        pool = self.scheduler.kv.pool
        if isinstance(seq.kv_transfer, RemoteSource):
            # Prefilled on another replica: pull what this one lacks, then schedule it.
            return bool(connector.start_remote_pull(seq, seq.kv_transfer, lambda h: pool.get_cached_block(h) is not None))
        if not connector.wants_prefetch():
            return False
        seq.update_block_hashes(self.config.block_size)
        return connector.start_prefetch(seq, lambda h: pool.get_cached_block(h) is not None)

    def apply_kv_releases(self) -> None:
        """Free blocks a producer held for pulls that are done or expired (engine thread)."""
        if self.kv_connector is not None and self.kv_connector.remote is not None:
            self.kv_connector.remote.apply_releases()

    def _admit_prefetched(self) -> None:
        """Hand requests whose prefetch finished to the scheduler, in arrival order."""
        assert self.kv_connector is not None
        for request_id in list(self.prefetching):
            if self.kv_connector.prefetch_ready(request_id):
                for seq in self.prefetching.pop(request_id):
                    self.scheduler.add_request(seq)

    def _check_continuation(self, cont: Continuation, ids: list[int], params: SamplingParams) -> None:
        """A continuation must leave room to generate, for one sequence, in this vocabulary."""
        vocab = int(self.hf_config.vocab_size)
        if params.n != 1:
            raise ValueError(f"a continuation continues one sequence; send n=1, not n={params.n}")
        if not cont.token_ids or any(not 0 <= t < vocab for t in cont.token_ids):
            raise ValueError(f"continuation.token_ids must be a non-empty list of ints in [0, {vocab})")
        if params.max_tokens is not None and len(cont.token_ids) >= params.max_tokens:
            raise ValueError(
                f"the continuation already holds {len(cont.token_ids)} tokens and max_tokens is "
                f"{params.max_tokens}: nothing is left to generate; the request is complete"
            )
        if len(ids) + len(cont.token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt ({len(ids)} tokens) and the continuation ({len(cont.token_ids)}) fill "
                f"max_model_len {self.max_model_len}: nothing is left to generate"
            )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Abort now; its blocks are freed at once. Returns the final output, or None if unknown."""
        group = self.groups.get(request_id)
        if group is None:
            return None
        if self.prefetching.pop(request_id, None) is not None:
            assert self.kv_connector is not None
            self.kv_connector.cancel_prefetch(request_id)
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq.request_id)
                group.finished_seqs.add(seq.index)
        return self._finish_group_output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # -- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.monotonic()
        connector = self.kv_connector
        if connector is not None and connector.remote is not None:
            connector.remote.apply_releases()
        if self.prefetching:
            self._admit_prefetched()
        sched = self.scheduler.schedule()
        touched: dict[str, RequestGroup] = {}
        if sched.lora_loads:
            self._load_lora_slots(sched)
        if connector is not None:
            # Evicted blocks leave before anything overwrites them; tier hits arrive before they are read.
            connector.before_forward(self.runner.kv_caches)
        if sched.is_empty and self.prefetching and connector is not None:
            connector.wait_prefetch(0.01)  # only fetches are outstanding: wait for one, do not spin
        if not sched.is_empty:
            prompt_chunks = [(r, n) for r, n in sched.scheduled if r.num_new_output_tokens == 0]
            reqs, logits = self.runner.execute(sched)  # a failure here is the engine's: it propagates
            if connector is not None:
                connector.after_forward(self.runner.kv_caches)
            sampled = self._sample(reqs, logits)
            now = time.monotonic()
            for r, n in prompt_chunks:
                r.prefill_chunks.append((t0, now, n))  # for the trace's prefill-chunk spans
            for req, result in zip(reqs, sampled, strict=True):
                group = self.seq_to_group.get(req.request_id)
                if group is None or group.finished:
                    continue  # a sibling failed earlier in this step and took the group with it
                touched[req.group_id] = group
                try:
                    if isinstance(result, Exception):
                        raise result
                    for token, logprobs in result:  # several when proposals were accepted
                        self._append(req, token, logprobs, now)
                        if req.is_finished:
                            break
                except Exception as exc:
                    self._fail_group(group, req, exc)
            if self.speculator is not None:
                self.speculator.after_step(reqs, self.scheduler.running)
        if connector is not None and sched.is_empty:
            connector.flush_events()
        outputs = []
        for g in touched.values():
            out = self._make_output(g)
            outputs.append(out)
            if g.finished:
                self._retire(g, out)
        elapsed = time.monotonic() - t0
        self._meter_step(t0, elapsed, sched)
        self.publish_queue()
        if self.observer is not None:
            self.observer.on_step(self._step_stats(sched, elapsed))
        return outputs

    def _meter_step(self, t0: float, elapsed: float, sched: Any) -> None:
        """Feed the rate meter the cadence steps really run at: from one step's start to the next while
        work remains (the loop's own costs between steps included), else the step's own time."""
        last, self._unmetered = self._unmetered, None
        if last is not None:
            start, prefill, decode = last
            self.rate_meter.observe(prefill, decode, t0 - start, end=t0)
        if sched.is_empty:
            return
        if self.has_unfinished_requests():
            self._unmetered = (t0, sched.num_prefill_tokens, sched.num_decode_tokens)
        else:
            self.rate_meter.observe(sched.num_prefill_tokens, sched.num_decode_tokens, elapsed, end=t0 + elapsed)

    def publish_queue(self) -> None:
        """Snapshot the queue for readers on other threads (the server's admission and metrics)."""
        limit = self.max_model_len

        def remaining(r: Request) -> int:
            cap = limit - r.num_tokens
            wanted = r.params.max_tokens - r.num_output_tokens if r.params.max_tokens is not None else cap
            return max(1, min(wanted, cap))

        sched = self.scheduler
        running = list(sched.running)
        waiting = [r for r in list(sched.waiting) if not r.is_finished]
        waiting += [s for seqs in list(self.prefetching.values()) for s in seqs]
        self.queue = QueueSnapshot(
            running=tuple((max(0, r.num_tokens - 1 - r.num_computed_tokens), remaining(r)) for r in running),
            waiting=tuple((max(1, r.num_tokens - r.num_computed_tokens), remaining(r)) for r in waiting),
        )

    def _load_lora_slots(self, sched: Any) -> None:
        """Copy this step's newly slotted adapters to the device. An adapter whose files went bad
        since it was registered fails its own requests only; they leave the step."""
        assert self.lora is not None
        for slot, lora in sched.lora_loads:
            try:
                self.runner.load_lora(slot, self.lora.weights(lora))
            except Exception as exc:
                self.lora.slot_lora[slot] = None
                for req, _ in list(sched.scheduled):
                    group = self.seq_to_group.get(req.request_id)
                    if req.lora == lora and group is not None and not group.finished:
                        self._fail_group(group, req, exc)
                alive = self.scheduler.requests
                sched.scheduled = [(r, n) for r, n in sched.scheduled if r.request_id in alive]

    def _sample(self, reqs: list[Request], logits: torch.Tensor) -> list[Any]:
        """Per request ``[(token, logprobs), ...]`` (several when proposals were accepted), or the
        exception that request's sampling raised: one bad request fails only itself."""
        if not reqs:
            return []
        if self.speculator is not None:
            return list(self.speculator.sample(reqs, logits, self.sampler))
        return [s if isinstance(s, Exception) else [s] for s in sample_each(self.sampler, reqs, logits)]

    def refuse_late(self) -> dict[str, TTFTDeadlineRefusal]:
        """Abort the waiting requests that can no longer meet their TTFT bound (``late_refusal.py``)
        and return why, per request id: the caller answers each with its refusal. A request with a
        sequence that has started is never refused."""
        waiting = [r for r in list(self.scheduler.waiting) if not r.is_finished]
        if not any(r.ttft_deadline is not None for r in waiting):
            return {}
        self.publish_queue()
        refused = late_refusals(self.queue, waiting, self.rate_meter.rates(), time.monotonic())
        for request_id, refusal in list(refused.items()):
            group = self.groups.get(request_id)
            if group is None or not all(unstarted(s) for s in group.seqs):  # a sibling has started
                del refused[request_id]
                continue
            log.info("request %s refused from the queue: %s", request_id, refusal)
            self.abort_request(request_id)
        if refused:
            self.publish_queue()
        return refused

    def _fail_group(self, group: RequestGroup, req: Request, exc: Exception) -> None:
        """Fail one request (all its sequences) and free its blocks; the engine carries on."""
        log.error("request %s failed in the engine: %r", group.request_id, exc, exc_info=exc)
        group.error = f"{type(exc).__name__}: {exc}"
        for seq in group.seqs:
            if not seq.is_finished:
                self.scheduler.finish(seq, "error")
            group.finished_seqs.add(seq.index)

    def _append(self, req: Request, token: int, logprobs: Any, now: float) -> None:
        p = req.params
        req.append_token(token)
        if req.first_token_time is None:
            req.first_token_time = now
        req.last_token_time = now
        if req.logprobs is not None and logprobs is not None:
            req.logprobs.append(logprobs)
        assert req.detokenizer is not None
        new_text = req.detokenizer.append(token)
        reason: str | None = None
        stop_reason: str | int | None = None
        n_out = req.num_output_tokens
        if token in p.stop_token_ids and n_out >= p.min_tokens:
            reason, stop_reason = "stop", token
        elif token in req.eos_token_ids and not p.ignore_eos and n_out >= p.min_tokens:
            reason = "stop"
        elif n_out >= p.min_tokens and (stop := req.detokenizer.find_stop(len(new_text))) is not None:
            reason, stop_reason = "stop", stop
        elif (p.max_tokens is not None and n_out >= p.max_tokens) or req.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            if isinstance(req.kv_transfer, RemoteDecode):
                # The prefill half of a split: its prompt blocks wait for the decode replica's pull.
                assert self.kv_connector is not None and self.kv_connector.remote is not None
                req.kv_transfer_params = self.kv_connector.remote.hold(req)
            self.scheduler.finish(req, reason, stop_reason)
            self.seq_to_group[req.request_id].finished_seqs.add(req.index)

    def _make_output(self, g: RequestGroup) -> RequestOutput:
        return make_request_output(g)

    def _finish_group_output(self, g: RequestGroup) -> RequestOutput:
        out = self._make_output(g)
        self._retire(g, out)
        return out

    def _retire(self, g: RequestGroup, out: RequestOutput) -> None:
        self.groups.pop(g.request_id, None)
        for s in g.seqs:
            self.seq_to_group.pop(s.request_id, None)
            s.generator = None  # the engine keeps nothing per finished request
            self.sampler.release(s.request_id)
        if self.observer is not None:
            self.observer.on_request_finished(out)

    def _step_stats(self, sched: Any, step_time: float) -> StepStats:
        return StepStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            batch_size=len(sched.scheduled),
            num_scheduled_tokens=sched.num_scheduled_tokens,
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            num_preemptions=len(sched.preempted),
            num_kv_allocation_failures=sched.num_kv_allocation_failures,
            prefix_cache_queries=sched.prefix_cache_queries,
            prefix_cache_hits=sched.prefix_cache_hits,
            kv_cache_usage=self.scheduler.kv.usage(),
            lora_swaps=len(sched.lora_loads),
            step_path="" if sched.is_empty else self.runner.last_path,
            step_time_s=step_time,
            **self._spec_stats(sched),
        )

    def _spec_stats(self, sched: Any) -> dict[str, Any]:
        if self.speculator is None or sched.is_empty:
            return {}
        s = self.speculator.step_stats
        return {
            "spec_num_drafts": s.num_drafts,
            "spec_num_draft_tokens": s.num_draft_tokens,
            "spec_num_accepted_tokens": s.num_accepted_tokens,
            "spec_num_accepted_tokens_per_pos": s.num_accepted_tokens_per_pos,
        }

    def stats(self) -> EngineStats:
        kv = self.scheduler.kv
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=kv.usage(),
            num_blocks=self.num_blocks,
            num_free_blocks=kv.num_free_blocks,
            block_size=self.config.block_size,
            enable_prefix_caching=self.config.enable_prefix_caching,
            prefill_backlog_tokens=self._prefill_backlog(),
            kv_bytes_per_token=self.kv_bytes_per_token,
            kv_cache_memory_bytes=self.runner.kv_cache_bytes(),
            kv_cache_resident_bytes=self.runner.kv_cache_resident_bytes(),
            gpu_memory_utilization=self.config.gpu_memory_utilization if self.kv_budget is not None else None,
            **self._lora_stats(),
        )

    def _prefill_backlog(self) -> int:
        """Prompt tokens admitted and not computed yet (read off-thread: copies of the queues)."""
        queued = [*self.scheduler.waiting, *self.scheduler.running]
        queued += [s for seqs in list(self.prefetching.values()) for s in seqs]
        return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in queued)

    def _lora_stats(self) -> dict[str, Any]:
        if self.lora is None:
            return {}
        return {
            "max_loras": self.lora.max_loras,
            "running_lora_adapters": self.lora.names_in(list(self.scheduler.running)),  # copies: read off-thread
            "waiting_lora_adapters": self.lora.names_in(list(self.scheduler.waiting)),
        }

    def warmup(self, defer_rest: bool = False) -> None:
        """Warm up: what the first request needs now; with ``defer_rest``, the rest after Ready.

        First one tiny request through every stage, so the first real request pays no first-call
        costs. Then the rate probe (:meth:`measure_rates`), the largest step this engine can take
        and the CPU matmul primitives of every step shape (:meth:`run_deferred_warmup`): they serve
        TTFT prediction and bound memory growth, not the first answer, so a server runs them once
        it is Ready and idle, giving way to any request that arrives. (The largest step before the
        primitives: its buffers, freed, set glibc's heap up for the steps after it, see
        kernels/host_memory.py.)
        """
        self.warmup_first_request()
        STARTUP.mark("warmup_done")
        self.deferred_warmup = True
        if not defer_rest:
            self.measure_rates()
            self.run_deferred_warmup()

    def warmup_first_request(self) -> None:
        """One tiny request through every stage (not traffic: no metrics). It pays the first-call
        costs, so its steps are not rates: the meter starts afresh after it, and the rate probe is
        due (:meth:`measure_rates`)."""
        observer, self.observer = self.observer, None
        try:
            self._run_to_completion("__warmup__", [int(self.tokenizer.bos_token_id or 0)], max_tokens=2)
        finally:
            self.observer = observer
        self.rate_meter = ServiceRateMeter(self.config.max_num_seqs)
        self.rate_probe_due = True

    def measure_rates(self) -> bool:
        """The rate probe, if due: a prompt of ``RATE_PROBE_TOKENS`` and its decode steps seed the
        prefill rate and the decode step, so SLO admission, the router and the autoscaler can
        predict TTFT before traffic teaches them (not traffic: no metrics). A server runs it once
        its engine idles after Ready (``AsyncEngine``); requests served before then measure the
        rates themselves, and when they measured both the probe is skipped. Until either, the
        replica has no rates and admits every request (``serving/slo_admission.py``). Returns
        whether the probe ran."""
        if not self.rate_probe_due:
            return False
        self.rate_probe_due = False
        if self.rate_meter.rates() is not None:
            return False
        probe = min(RATE_PROBE_TOKENS, self.max_model_len - 4, (self.num_blocks - 1) * self.config.block_size)
        if probe < MIN_PREFILL_TOKENS:
            return False
        vocab = int(self.hf_config.vocab_size)
        prompt = [(11 * i + 3) % vocab for i in range(probe)]
        observer, self.observer = self.observer, None
        try:
            self._run_to_completion("__warmup_rates__", prompt, max_tokens=3)
        finally:
            self.observer = observer
        return True

    def _run_to_completion(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0))
        while self.has_unfinished_requests():
            self.step()

    @property
    def deferred_warmup_started(self) -> bool:
        """Whether the deferred warm-up ran its first piece (the largest step) already."""
        return self._deferred_pieces is not None

    def run_deferred_warmup(self, busy: Callable[[], bool] | None = None) -> bool:
        """The rest of the warm-up (see :meth:`warmup`); ``True`` once all of it ran. With ``busy``,
        it stops between two pieces as soon as ``busy()`` says work arrived, and a later call goes
        on from there: each piece is one matmul, or the largest step."""
        if not self.deferred_warmup:
            return True
        if self._deferred_pieces is None:
            self._deferred_pieces = self._deferred_warmup_pieces()
        for _ in self._deferred_pieces:
            if busy is not None and busy():
                return False
        self._deferred_pieces = None
        self.deferred_warmup = False
        return True

    def _deferred_warmup_pieces(self) -> Iterator[None]:
        if self._store_weights is not None:  # the weight cache missed at load: written now, once
            store, self._store_weights = self._store_weights, None
            store()
            yield
        # The largest step this engine can take (as vLLM's profile run does), so the heap reaches
        # the size serving needs now (kernels/host_memory.py keeps it) rather than growing with the
        # first long prompts; it also measures the prefill rate. Its blocks go back at once.
        self._run_largest_step()
        yield
        # oneDNN's matmul primitives for every padded row count a step can have, built now rather
        # than as request shapes first appear (each costs ~1 MiB: models/dense.py); small pieces,
        # so a request arriving meanwhile waits for one matmul at most.
        primed = 0
        tokens = self.config.max_num_batched_tokens
        for _ in self.runner.model.prime_matmul_steps(tokens, self.config.max_logit_rows):
            primed += 1
            yield
        draft = getattr(self.speculator, "draft", None)
        if draft is not None:  # a draft model proposes one row per sequence at a time
            for _ in draft.runner.model.prime_matmul_steps(tokens, self.config.max_num_seqs):
                primed += 1
                yield
        log.debug("warm-up primed %d matmul shapes", primed)

    def _run_largest_step(self) -> None:
        """One prefill of the most tokens a step can hold, not counted as traffic (its blocks go
        back to the pool at once): the warm-up's, and the profile that sizes the KV cache."""
        largest = min(
            self.config.max_num_batched_tokens,
            self.max_model_len - 1,
            (self.num_blocks - 1) * self.config.block_size,
        )
        if largest > 1:
            vocab = int(self.hf_config.vocab_size)
            observer, self.observer = self.observer, None
            try:
                self.add_request(
                    "__warmup_largest__",
                    [(7 * i) % vocab for i in range(largest)],
                    SamplingParams(max_tokens=1, temperature=0),
                )
                while self.has_unfinished_requests():
                    self.step()
            finally:
                self.observer = observer

    # -- sleep mode (--enable-sleep-mode; engine/sleep_mode.py) ---------------------------

    @property
    def sleep_level(self) -> int:
        return self.sleep_state.level

    def sleep(self, level: int) -> int:
        """Free the KV cache (and move or drop the weights); returns the bytes freed."""
        if level == 2:
            self._store_weights = None  # the weights it would write are dropped: the next start builds them
        return sleep_mode.sleep(self, level).freed_bytes

    def wake_up(self) -> float:
        """Back from sleep; returns the seconds waking took."""
        return sleep_mode.wake_up(self)

    def recapture_cuda_graphs(self) -> None:
        """Capture the decode (and verify) graphs again: the tensors they read have moved."""
        if self.runner.decode_graphs is None:
            return
        self.runner.decode_graphs = self.runner.verify_graphs = None
        self._capture_cuda_graphs()

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams],
        lora_names: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion (each under its adapter in ``lora_names``); outputs in prompt order."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(
                f"got {len(plist)} SamplingParams for {len(prompts)} prompts; pass one or one per prompt"
            )
        base = f"gen-{self.rng.getrandbits(48):x}"
        ids = [f"{base}-{i}" for i in range(len(prompts))]
        loras = lora_names if lora_names is not None else [None] * len(prompts)
        for rid, prompt, p, lora in zip(ids, prompts, plist, loras, strict=True):
            self.add_request(rid, prompt, p, lora_name=lora)  # type: ignore[arg-type]  # list invariance
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]
