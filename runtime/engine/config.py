"""The engine's one validated config object.

What it is: every knob the engine reads (model, limits, KV budget, policies),
checked once at the edge. What it is not: HTTP/server settings (those belong to
the server) or model hyper-parameters (those come from the model's own config).
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

# Re-exported: callers that build an EngineConfig by hand parse sizes the same way.
from plimsoll.byte_size import parse_bytes
from plimsoll.kv_memory import DEFAULT_GPU_MEMORY_UTILIZATION
from plimsoll.runtime.engine.compilation_config import CompilationConfig
from plimsoll.runtime.engine.spec_decode.config import SpeculativeConfig
from plimsoll.runtime.kv.events import KVEventsConfig
from plimsoll.runtime.kv.shared_url import redacted_url
from plimsoll.runtime.kv.transfer_config import KVTransferConfig

DEFAULT_MAX_MODEL_LEN_CAP = 4096
DEFAULT_CPU_KV_CACHE_MEMORY = 1024**3  # on a CPU the cache size is explicit; this when none is given


class LoRAModule(BaseModel):
    """One ``--lora-modules`` entry: the name clients send as ``model`` and a PEFT directory."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    path: str = Field(min_length=1)
    base_model_name: str | None = None  # vLLM's JSON form may carry it; informational only


class EngineConfig(BaseModel):
    """Validated engine settings. ``LLM(**fields)`` and ``plimsoll serve`` both build one."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())

    model: str = Field(
        "smollm2-135m",
        description="HF-format directory, path to a .gguf file, or 'smollm2-135m' (embedded default)",
    )
    served_model_name: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="'auto' (or left out): float32 on CPU, bfloat16 on an accelerator, as `serve --dtype auto`"
    )
    device: str = "cpu"

    @model_validator(mode="before")
    @classmethod
    def _auto_dtype(cls, data: object) -> object:
        """``dtype`` left out or ``"auto"``: float32 on CPU (no fast bf16 matmul there), bfloat16 on
        CUDA and other accelerators (vLLM takes bfloat16 for float32 checkpoints on a GPU)."""
        if isinstance(data, dict) and data.get("dtype", "auto") in ("auto", None):
            device = str(data.get("device", "cpu"))
            data = {**data, "dtype": "float32" if device.startswith("cpu") else "bfloat16"}
        return data
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: int | None = Field(None, ge=2)
    kv_cache_memory: int | None = Field(
        None,
        description="bytes for the paged KV cache (all layers, K and V; vLLM's --kv-cache-memory-bytes). "
        "None: on CUDA, sized from the device by gpu_memory_utilization; on CPU, 1 GiB",
    )
    gpu_memory_utilization: float = Field(
        DEFAULT_GPU_MEMORY_UTILIZATION,
        gt=0.0,
        le=1.0,
        description="vLLM's --gpu-memory-utilization: the share of the device this engine may hold; the KV "
        "cache gets what the weights, the largest step and the CUDA graphs leave (when kv_cache_memory is None)",
    )
    block_size: int = Field(16, ge=1, le=1024)
    enable_prefix_caching: bool = True
    attention_backend: Literal["torch", "triton"] = "torch"
    enforce_eager: bool = Field(
        False,
        description="vLLM's --enforce-eager: never replay CUDA graphs (on CUDA with the Triton backend, "
        "decode steps replay graphs captured at start; engine/cuda_graphs.py)",
    )
    compilation_config: CompilationConfig = Field(
        default_factory=CompilationConfig,
        description="vLLM's --compilation-config: mode 3 compiles the forward with torch.compile (the default "
        "on CUDA), 0 runs it eagerly; cache_dir keeps the compile caches (engine/compilation_config.py)",
    )

    @field_validator("compilation_config", mode="before")
    @classmethod
    def _parse_compilation_config(cls, value: object) -> object:
        return CompilationConfig.parse(value)

    scheduling_policy: Literal["continuous", "static", "priority"] = "continuous"
    seed: int = 0
    quantization: Literal["int8", "fp8"] | None = Field(
        None,
        description="vLLM's --quantization: 'int8' weight-only (a scale and offset per 32 inputs of a row) or "
        "'fp8' (e4m3 weights with a scale per output channel, activations scaled per token at run time; "
        "compute capability 8.9+ on CUDA), both computed at load; an FP8 checkpoint is served as fp8 without it",
    )
    kv_cache_dtype: Literal["auto", "int8"] = Field(
        "auto",
        description="KV cache storage: 'auto' = the model dtype, 'int8' = int8 with a float32 scale per "
        "token and KV head (vLLM's --kv-cache-dtype; attention/kv_int8.py)",
    )
    speculative_config: SpeculativeConfig | None = Field(
        None, description="vLLM's --speculative-config: ngram prompt lookup or a draft model"
    )

    # CPU execution (models/cpu_plan.py): chosen once at load and named in one start-up line.
    cpu_kernels: Literal["auto", "avx512", "avx2", "plain", "off"] = Field(
        "auto",
        description="which build of the C++ CPU kernels this process runs: auto (the best this CPU runs), a "
        "build by name, or off (torch's ops alone); the builds are compiled at install (setup.py)",
    )
    cpu_packed_weights: bool = Field(
        True,
        description="float32 projections and head packed once in column panels (a second copy of them) for "
        "the fused decode step, the glued layers and the head; off: one copy, plain rows",
    )
    cpu_fused_decode: bool = Field(True, description="every layer of a decode step in one native call")
    cpu_glued_layers: bool = Field(
        True, description="steps the fused step leaves as oneDNN or packed matmuls with native glue between"
    )
    cpu_kernel_parallel: Literal["auto", "openmp", "pool", "threads"] = Field(
        "auto",
        description="how a kernel call splits over threads: auto (torch's OpenMP team where it is libgomp, else "
        "the kernels' own pool), or one of those; threads (started per call) is for A/B timing only",
    )
    keep_freed_memory: bool = Field(
        True,
        description="keep a step's freed activation memory in the process (glibc malloc thresholds raised, "
        "kernels/host_memory.py); off where another allocator or MALLOC_* settings should rule",
    )

    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="vLLM's --tensor-parallel-size: ranks (one process each) that split heads and MLP "
        "columns; kv_cache_memory is per rank",
    )
    tensor_parallel_timeout_s: float = Field(
        120.0, gt=0, description="longest wait in one collective before a rank gives up (no hang)"
    )

    @model_validator(mode="after")
    def _check_tensor_parallel(self) -> "EngineConfig":
        if self.tensor_parallel_size > 1 and self.quantization is not None:
            raise ValueError(
                f"quantization={self.quantization!r} with tensor_parallel_size={self.tensor_parallel_size} is "
                "not supported yet; drop one of them"
            )
        return self

    enable_sleep_mode: bool = Field(
        False,
        description="answer POST /sleep?level=1|2 and POST /wake_up (vLLM's --enable-sleep-mode): level 1 frees "
        "the KV cache and moves the weights to host memory, level 2 drops them too",
    )

    @model_validator(mode="after")
    def _check_sleep_mode(self) -> "EngineConfig":
        if self.enable_sleep_mode and self.tensor_parallel_size > 1:
            raise ValueError(
                "enable_sleep_mode with tensor_parallel_size > 1 is not supported yet; drop one of them"
            )
        return self

    enable_lora: bool = Field(False, description="serve LoRA adapters (vLLM's --enable-lora)")
    lora_modules: list[LoRAModule] = Field(default_factory=list, description="adapters loaded at start")
    max_loras: int = Field(1, ge=1, description="adapters in one step's device slots (vLLM's --max-loras)")
    max_lora_rank: int = Field(16, ge=1, description="largest adapter rank accepted (vLLM's --max-lora-rank)")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="adapters kept in host memory, LRU (vLLM's --max-cpu-loras; default --max-loras)"
    )

    @model_validator(mode="after")
    def _check_lora(self) -> "EngineConfig":
        if not self.enable_lora:
            if self.lora_modules:
                raise ValueError("lora_modules needs enable_lora (pass --enable-lora with --lora-modules)")
            return self
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})"
            )
        if self.quantization is not None:
            raise ValueError("LoRA adapters on an int8-quantised model are not supported; drop --quantization")
        if self.speculative_config is not None:
            raise ValueError("LoRA adapters with speculative decoding are not supported; drop one of them")
        if self.tensor_parallel_size > 1:
            raise ValueError(
                "LoRA adapters with tensor_parallel_size > 1 are not supported yet (adapter slots are not "
                "sharded); drop --enable-lora or --tensor-parallel-size"
            )
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names) or self.display_name in names:
            raise ValueError(f"LoRA module names must be unique and differ from the base model's: {names}")
        return self

    # KV tiers (runtime/kv/): vLLM's offloading flags, the tier shared by replicas, KV events.
    kv_offloading_backend: Literal["native"] | None = Field(
        None, description="vLLM's --kv-offloading-backend: 'native' keeps evicted blocks in host memory"
    )
    kv_offloading_size: float | None = Field(
        None, gt=0, description="vLLM's --kv-offloading-size: GiB of host memory for evicted KV blocks"
    )
    kv_offloading_store_threshold: int = Field(
        0, ge=0, description="store an evicted block only once lookups asked for it this often (vLLM's "
        "store_threshold; below 2: every evicted block)",
    )
    kv_offloading_disk_path: str | None = Field(None, description="directory of a disk tier below the host tier")
    kv_offloading_disk_size: float | None = Field(None, gt=0, description="GiB of the disk tier")
    kv_shared_url: str | None = Field(
        None, description="redis://HOST:PORT[/DB] of a Valkey or Redis server the replicas share KV blocks through"
    )
    kv_shared_password: SecretStr | None = Field(
        None,
        description="the shared tier's server password (Valkey/Redis AUTH), kept out of logs and reprs; "
        "the CLI reads it from PLIMSOLL_KV_SHARED_PASSWORD",
    )
    kv_shared_timeout_s: float = Field(
        0.25, gt=0, description="socket timeout of one shared-tier call (no retry; then the request recomputes)"
    )
    kv_events_config: KVEventsConfig | None = Field(None, description="vLLM's --kv-events-config")
    kv_transfer_config: KVTransferConfig | None = Field(
        None,
        description="vLLM's --kv-transfer-config: prefill on one replica, decode on another (runtime/kv/)",
    )

    @field_validator("kv_events_config", mode="before")
    @classmethod
    def _parse_kv_events_config(cls, value: object) -> object:
        return KVEventsConfig.parse(value)

    @field_validator("kv_transfer_config", mode="before")
    @classmethod
    def _parse_kv_transfer_config(cls, value: object) -> object:
        return KVTransferConfig.parse(value)

    @model_validator(mode="after")
    def _check_kv_transfer(self) -> "EngineConfig":
        if self.kv_transfer_config is None:
            return self
        if not self.enable_prefix_caching:
            raise ValueError(
                "--kv-transfer-config moves blocks named by their prefix-cache hashes; drop --no-enable-prefix-caching"
            )
        if self.tensor_parallel_size > 1:
            raise ValueError(
                "--kv-transfer-config is not supported with tensor_parallel_size > 1 yet; drop one of them"
            )
        return self

    @model_validator(mode="after")
    def _check_kv_tiers(self) -> "EngineConfig":
        if self.kv_offloading_size is not None and self.kv_offloading_backend is None:
            self.kv_offloading_backend = "native"
        if self.kv_offloading_backend is not None and self.kv_offloading_size is None:
            raise ValueError("--kv-offloading-backend needs --kv-offloading-size GiB (e.g. --kv-offloading-size 4)")
        if self.kv_offloading_disk_path is not None and (
            self.kv_offloading_disk_size is None or self.kv_offloading_size is None
        ):
            raise ValueError(
                "a disk tier (--kv-offloading-disk-path) needs --kv-offloading-disk-size GiB and a host tier "
                "(--kv-offloading-size GiB) above it"
            )
        tiers = self.kv_offloading_size is not None or self.kv_shared_url is not None
        if tiers and not self.enable_prefix_caching:
            raise ValueError("KV offloading and the shared KV tier need prefix caching; drop --no-enable-prefix-caching")
        if tiers and self.tensor_parallel_size > 1:
            raise ValueError(
                "KV offloading and the shared KV tier are not supported with tensor_parallel_size > 1 yet; "
                "drop one of them"
            )
        if self.kv_shared_url is not None and not self.kv_shared_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(
                f"--kv-shared-url {redacted_url(self.kv_shared_url)!r} is not a redis:// URL; pass "
                "redis://HOST:PORT (Valkey or Redis)"
            )
        return self

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _parse_speculative_config(cls, value: object) -> object:
        return SpeculativeConfig.parse(value)  # type: ignore[arg-type]

    @field_validator("kv_cache_memory", mode="before")
    @classmethod
    def _parse_kv_cache_memory(cls, value: object) -> int | None:
        if value is None:
            return None
        if isinstance(value, str | int | float):
            return parse_bytes(value)
        raise ValueError(f"kv_cache_memory must be bytes or a size like '2GiB', got {value!r}")

    @property
    def sizes_kv_from_device(self) -> bool:
        """No explicit cache size on an accelerator: measure the device (``kv_sizing.py``)."""
        return self.kv_cache_memory is None and not self.device.startswith("cpu")

    @property
    def torch_dtype(self) -> "torch.dtype":  # type: ignore[name-defined]  # noqa: F821
        import torch

        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]

    @property
    def max_logit_rows(self) -> int:
        """The most rows one step computes logits for: each sequence's next token and, with
        speculative decoding, one per proposed token."""
        spec = self.speculative_config
        return self.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))

    @property
    def display_name(self) -> str:
        """The name clients use for this model (OpenAI ``model`` field)."""
        return self.served_model_name or self.model
