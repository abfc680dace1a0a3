"""The LLMService spec (``plimsoll.dev/v1alpha1``): what a user asks for.

Every field here becomes part of the generated CRD schema (``crd.py``) and so of
`kubectl explain llms.spec`. Cross-field rules live twice on purpose: as CEL
``x-kubernetes-validations`` so the API server refuses a bad spec at
`kubectl apply` time, and as pydantic validators so the operator refuses the same
spec (Ready=False, reason InvalidSpec) if the CRD in the cluster is older.
This module does no I/O and knows nothing about Deployments.
"""

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from plimsoll.operator.api.base import APIModel, FreeForm, Quantity, cel, defaulted
from plimsoll.operator.api.disaggregation import DisaggregationSpec
from plimsoll.operator.api.model_uri import (
    ADAPTER_URI_PATTERN,
    MODEL_URI_PATTERN,
    parse_adapter_uri,
    parse_model_uri,
)
from plimsoll.operator.api.variants import MAX_VARIANTS, MixSpec, VariantSpec

EngineKind = Literal["plimsoll", "vllm", "sglang"]
CapacityMode = Literal["Profile", "Manual"]
Reprofile = Literal["Auto", "OnAnnotation"]
AutoscalingMode = Literal["builtin", "hpa", "keda", "off"]
RouterPolicy = Literal["least-in-flight", "prefix-affinity", "precise-prefix"]
RouterMode = Literal["plimsoll", "inferencePool"]
# Volume names the builders use themselves; a user volume may not take one.
RESERVED_VOLUME_NAMES = ("model", "model-cache", "shm", "tmp", "home-cache", "engine-compile-cache")
# Adapter claims other than the model's are mounted as volumes named lora-<hash>.
RESERVED_VOLUME_PREFIX = "lora-"
# --max-loras when LoRA is on and engine.maxLoras is unset (vLLM's own default, 1, swaps on every mix).
DEFAULT_MAX_LORAS = 4
# The admission limits the operator gives plimsoll replicas unless engine.args sets them.
DEFAULT_MAX_WAITING = 512
DEFAULT_REQUEST_TIMEOUT_SECONDS = 600

DEFAULT_CONCURRENCY_LEVELS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
# A capacity profile measures each level for at least three minutes and at least 100 requests
# (bench's max(100, 4 × c)): the low end of the 3–5 minutes a level is advised to run, so p95s are
# stable and queues have settled. Ten levels then take half an hour; lower it for a first look.
DEFAULT_MIN_SECONDS_PER_LEVEL = 180

PositiveInt = Annotated[int, Field(ge=1)]


class SecretKeyRef(APIModel):
    """One key of a Secret in the LLMService's namespace (Kubernetes SecretKeySelector shape)."""

    name: str = Field(
        min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", description="Secret name."
    )
    key: str = Field(
        "token", min_length=1, pattern=r"^[-._a-zA-Z0-9]+$", description="Key in the Secret (default token)."
    )


class HostPathCache(APIModel):
    """A directory on the node (Kubernetes HostPathVolumeSource's ``path``): a node-local model cache."""

    path: str = Field(
        min_length=2,
        max_length=1024,
        pattern=r"^/.*[^/]$",
        description="Absolute directory on the node, e.g. /var/lib/plimsoll/models (created if missing; "
        "must be writable by the image's user, uid 1000).",
    )

    @model_validator(mode="after")
    def _plain_path(self) -> "HostPathCache":
        if ".." in self.path.split("/"):
            raise ValueError(
                f"model.cache.hostPath.path {self.path!r} may not contain '..'; give the directory itself"
            )
        return self


class ModelCacheSpec(APIModel):
    """The volume an hf:// model is downloaded to before the engine starts."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "[has(self.claimName), has(self.sizeLimit), has(self.hostPath)].filter(x, x).size() <= 1",
                    "model.cache takes one of claimName (a PVC), sizeLimit (an emptyDir) or hostPath (a node-local "
                    "directory)",
                ),
                cel(
                    "!(has(self.prefill) && self.prefill) || has(self.hostPath)",
                    "model.cache.prefill fills a node-local cache: set model.cache.hostPath too",
                ),
            ]
        }
    )

    claim_name: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="PersistentVolumeClaim holding the cache: downloaded once, kept across restarts "
        "(ReadWriteMany lets replicas share it; a local PersistentVolume makes it node-local).",
    )
    size_limit: Quantity | None = Field(
        None,
        description="Size of the per-pod emptyDir cache used when no claim is named, e.g. 40Gi "
        "(each new pod downloads again).",
    )
    host_path: HostPathCache | None = Field(
        None,
        description="A directory on each node that replicas share: a pod that starts where the model is "
        "already present and verified downloads nothing.",
    )
    prefill: bool = Field(
        False,
        description="Fill the hostPath cache ahead on every node the replicas may run on (a DaemonSet "
        "<name>-model-cache), so a replica that starts there, even from zero, finds the weights in place.",
    )

    @model_validator(mode="after")
    def _one_volume(self) -> "ModelCacheSpec":
        given = [n for n, v in (("claimName", self.claim_name), ("sizeLimit", self.size_limit),
                                ("hostPath", self.host_path)) if v is not None]  # fmt: skip
        if len(given) > 1:
            raise ValueError(
                f"model.cache takes one of claimName (a PVC), sizeLimit (an emptyDir) or hostPath (a node-local "
                f"directory), not {' and '.join(given)}"
            )
        if self.prefill and self.host_path is None:
            raise ValueError(
                "model.cache.prefill fills a node-local cache ahead: set model.cache.hostPath.path too "
                "(a claim is filled once by the first replica; an emptyDir lives and dies with its pod)"
            )
        return self


class ModelSpec(APIModel):
    """Which model to serve and under which name."""

    uri: str = Field(
        pattern=MODEL_URI_PATTERN,
        description="Where the weights come from: pvc://<claim>[/path], hf://<org>/<name>[@revision], "
        "file:///<path in the image> or embedded://smollm2-135m.",
    )
    served_name: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="Model name clients pass in requests; defaults to the LLMService name.",
    )
    token_secret_ref: SecretKeyRef | None = Field(
        None,
        description="Secret key holding a Hugging Face token for gated or private hf:// repositories "
        "(given to the download step as HF_TOKEN, never to the engine).",
    )
    cache: ModelCacheSpec = defaulted(
        ModelCacheSpec,
        "Where hf:// weights are downloaded: an emptyDir, a PVC (claimName) or a node-local "
        "directory (hostPath, optionally filled ahead with prefill).",
    )


class EnvVar(APIModel):
    """An environment variable for the engine container (Kubernetes EnvVar shape)."""

    name: str = Field(min_length=1, description="Variable name.")
    value: str | None = Field(None, description="Literal value.")
    value_from: FreeForm | None = Field(None, description="A Kubernetes EnvVarSource, passed through.")


class AdapterSpec(APIModel):
    """One LoRA adapter served on the base model's replicas, selected by a request's model field."""

    name: str = Field(
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$",
        description="Model name clients pass to use this adapter (vLLM's lora_name).",
    )
    uri: str = Field(
        pattern=ADAPTER_URI_PATTERN,
        description="Where the PEFT adapter directory is: pvc://<claim>[/path] or file:///<path> (loaded and "
        "unloaded on running replicas without a restart; a claim other than the model's is mounted, which "
        "rolls the pods once), or hf://<org>/<name>[@revision] (downloaded when a pod starts, so adding or "
        "removing one rolls the pods).",
    )


class EngineSpec(APIModel):
    """The inference engine each replica runs and its batching/KV settings."""

    kind: EngineKind = Field(
        "plimsoll",
        description="plimsoll (this project's runtime), vllm or sglang (their upstream images, with "
        "the equivalent flags; SGLang runs with --enable-metrics).",
    )
    image: str | None = Field(
        None, description="Container image; defaults to the operator's image for each kind."
    )
    args: list[str] = Field(default_factory=list, description="Extra engine arguments, appended verbatim.")
    env: list[EnvVar] = Field(default_factory=list, description="Extra environment variables.")
    max_num_seqs: PositiveInt | None = Field(None, description="Most sequences in one batch.")
    max_num_batched_tokens: PositiveInt | None = Field(None, description="Token budget per engine step.")
    max_model_len: PositiveInt | None = Field(
        None, description="Longest context (prompt + output) in tokens."
    )
    kv_cache_memory: Quantity | None = Field(
        None, description="KV-cache byte budget, e.g. 8Gi; unset on GPUs: sized by gpuMemoryUtilization."
    )
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="--gpu-memory-utilization on GPU replicas: the share of each GPU the engine may hold; "
        "the KV cache gets what the weights, the largest step and the CUDA graphs leave (vLLM's default).",
    )
    block_size: PositiveInt | None = Field(None, description="Tokens per KV-cache block.")
    prefix_caching: bool | None = Field(None, description="Reuse KV blocks of shared prompt prefixes.")
    tensor_parallel_size: PositiveInt | None = Field(
        None,
        description="--tensor-parallel-size: ranks one model is split across; default resources.gpu.count "
        "(a --tensor-parallel-size in args wins over both).",
    )
    profiling: bool = Field(
        False,
        description="plimsoll: start replicas with --enable-profiling, so the plimsoll.dev/profile "
        "annotation (or `plimsoll profile`) can take a profile of one.",
    )
    scheduling_policy: Literal["continuous", "static", "priority"] | None = Field(
        None,
        description="--scheduling-policy: priority serves a request's lower `priority` first, with fair "
        "share across x-gateway-inference-fairness-id tenants (plimsoll); vLLM knows fcfs and priority.",
    )
    enable_lora: bool | None = Field(
        None,
        description="--enable-lora; unset: on when spec.adapters is not empty. Set true to add the first "
        "adapter later without a restart (turning LoRA on changes the engine's flags, so it rolls the pods).",
    )
    max_loras: PositiveInt | None = Field(
        None, description=f"--max-loras: adapters batched in one step (default {DEFAULT_MAX_LORAS})."
    )
    max_lora_rank: PositiveInt | None = Field(
        None, description="--max-lora-rank: the largest adapter rank accepted (the engine's default if unset)."
    )
    lora_allowed_roots: list[Annotated[str, Field(pattern=r"^/")]] = Field(
        default_factory=list,
        description="plimsoll: directories in the image that file:// adapters may be loaded from at run time "
        "(--lora-allowed-roots; the operator adds its own mount points). Changing it rolls the pods.",
    )
    api_key_secret_ref: SecretKeyRef | None = Field(
        None,
        description="The API key clients send (`Authorization: Bearer`), from a Secret: the engine reads it "
        "from its environment (PLIMSOLL_API_KEY or VLLM_API_KEY, never its arguments), the router checks "
        "clients against it, the profile Job sends it.",
    )
    max_waiting: PositiveInt = Field(
        DEFAULT_MAX_WAITING,
        description="plimsoll --max-waiting: waiting requests beyond which new ones get 429 (a replica's "
        "queue is bounded by default).",
    )
    request_timeout_seconds: PositiveInt = Field(
        DEFAULT_REQUEST_TIMEOUT_SECONDS,
        description="plimsoll --request-timeout: seconds after which a request is aborted with 504.",
    )
    max_new_tokens: PositiveInt | None = Field(
        None,
        description="max_tokens for requests that send none, and the most any request gets (larger ones are "
        "lowered to it): plimsoll --max-new-tokens, vLLM --override-generation-config max_new_tokens. "
        "Unset: a request without max_tokens may fill the rest of the context.",
    )


class GPUSpec(APIModel):
    """GPUs per replica."""

    count: int = Field(1, ge=0, description="GPUs per replica (0 runs on CPU).")
    resource_name: str = Field(
        "nvidia.com/gpu",
        pattern=r"^[A-Za-z0-9.-]+/[A-Za-z0-9._-]+$",
        description="Extended resource that counts GPUs on the nodes.",
    )


class ResourcesSpec(APIModel):
    """Compute each replica requests."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.nodes) || self.nodes == 1 || (has(self.gpu) && has(self.gpu.count) "
                    "&& self.gpu.count >= 1)",
                    "resources.nodes above 1 needs resources.gpu.count of at least 1 (GPUs on each node)",
                ),
            ]
        }
    )

    gpu: GPUSpec = defaulted(GPUSpec, "GPUs per pod (per node of a replica).")
    nodes: int = Field(
        1,
        ge=1,
        description="Nodes (pods) one replica spans; above 1 each replica is a LeaderWorkerSet group "
        "(leaderworkerset.x-k8s.io must be installed), the leader serving.",
    )
    cpu: Quantity | None = Field(None, description="CPU request and limit, e.g. 4.")
    memory: Quantity | None = Field(None, description="Memory request and limit, e.g. 32Gi.")


class SchedulingSpec(APIModel):
    """Where replicas may run (passed to the pod spec unchanged)."""

    node_selector: dict[str, str] = Field(default_factory=dict, description="Node labels a replica needs.")
    tolerations: list[FreeForm] = Field(default_factory=list, description="Kubernetes tolerations.")
    affinity: FreeForm | None = Field(None, description="Kubernetes affinity.")
    priority_class_name: str | None = Field(None, description="PriorityClass of the replicas.")


class ScalingSpec(APIModel):
    """Bounds every autoscaler (built-in, HPA, KEDA) keeps replicas within."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("self.min <= self.max", "scaling.min must not exceed scaling.max"),
            ]
        }
    )

    min: int = Field(1, ge=0, description="Fewest replicas; 0 scales to zero after idleSeconds (the router holds "
                     "requests meanwhile).")
    max: int = Field(ge=1, description="Most replicas.")
    idle_seconds: int = Field(
        600, ge=1, description="With min 0: seconds without a request before the replicas go to zero."
    )
    drain_seconds: int = Field(
        120, ge=0, description="Built-in scale-down: the longest a replica chosen for removal is drained "
        "(no new requests, in-flight ones finish) before the count is lowered."
    )

    @model_validator(mode="after")
    def _min_not_above_max(self) -> "ScalingSpec":
        if self.min > self.max:
            raise ValueError(f"scaling.min ({self.min}) must not exceed scaling.max ({self.max})")
        return self


# What spec.slo means when it sets no objective (slo.preset): users grow impatient past a
# 3 s first token and leave past 5 s, so an interactive service holds TTFT p95 to 3 s.
SLO_PRESETS: dict[str, dict[str, float]] = {"interactive": {"ttft_p95_ms": 3000.0}, "none": {}}
SLOPreset = Literal["interactive", "none"]


class SLOSpec(APIModel):
    """Latency objectives; profiling and the autoscaler keep replicas inside them."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.admission) || self.admission != 'Predicted' || has(self.ttftP95Ms)",
                    "slo.admission Predicted needs slo.ttftP95Ms (the bound a request is admitted against)",
                ),
            ]
        }
    )

    preset: SLOPreset = Field(
        "interactive",
        description="Objectives used when none of ttftP95Ms, tpotP50Ms, e2eP95Ms is set: interactive "
        "(TTFT p95 3000 ms) or none. The operator says in status.slo and an SLODefaulted Event when it "
        "applies them.",
    )
    ttft_p95_ms: float | None = Field(None, gt=0, description="95th percentile time to first token, ms.")
    tpot_p50_ms: float | None = Field(None, gt=0, description="Median time per output token, ms.")
    e2e_p95_ms: float | None = Field(
        None, gt=0, alias="e2eP95Ms", description="95th percentile end-to-end latency, ms."
    )
    admission: Literal["Off", "Predicted"] = Field(
        "Off",
        description="Predicted: each replica (plimsoll engine) and the router refuse, with 429 and Retry-After, a "
        "request whose predicted TTFT exceeds ttftP95Ms (or its own x-slo-ttft-ms) instead of queueing it past "
        "its objective; the refusals count as misses in the attainment. A request's x-slo-ttft-ms is honoured "
        "either way.",
    )

    _defaulted: str | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _admission_needs_ttft(self) -> "SLOSpec":
        # Before the preset: admission needs a bound the user chose, as the CEL rule says.
        if self.admission == "Predicted" and self.ttft_p95_ms is None:
            raise ValueError("slo.admission Predicted needs slo.ttftP95Ms (the bound a request is admitted against)")
        return self

    @model_validator(mode="after")
    def _apply_preset(self) -> "SLOSpec":
        if self.ttft_p95_ms is None and self.tpot_p50_ms is None and self.e2e_p95_ms is None:
            bounds = SLO_PRESETS[self.preset]
            if bounds:
                for name, value in bounds.items():
                    setattr(self, name, value)
                self._defaulted = self.preset
        return self

    @property
    def defaulted_from(self) -> str | None:
        """The preset whose objectives were applied because the spec set none (None: the user's own)."""
        return self._defaulted


class ProfileWorkload(APIModel):
    """The request shape and concurrency sweep a capacity profile measures."""

    input_tokens: PositiveInt = Field(512, description="Prompt length of each benchmark request.")
    output_tokens: PositiveInt = Field(128, description="Output length of each benchmark request.")
    concurrency: list[PositiveInt] = Field(
        default_factory=lambda: list(DEFAULT_CONCURRENCY_LEVELS),
        min_length=1,
        description="Closed-loop concurrency levels swept, in increasing order.",
    )
    requests_per_level: PositiveInt | None = Field(
        None,
        description="Requests measured at each level; unset: bench's own default, max(100, 4 × concurrency) "
        "(fewer measure one or two synchronised waves at high concurrency).",
    )
    min_seconds_per_level: int = Field(
        DEFAULT_MIN_SECONDS_PER_LEVEL,
        ge=0,
        le=1800,
        description="Floor on each level's measured time: a level runs its requests and at least this long "
        "(more requests at the same concurrency), so a fast replica is measured for minutes; 0 turns it off.",
    )


class ProfileSpec(APIModel):
    """How a Profile-mode capacity is measured."""

    workload: ProfileWorkload = defaulted(ProfileWorkload, "What the sweep sends.")


class DriftSpec(APIModel):
    """When a replica counts as no longer behaving like its profile (the ProfileDrift condition)."""

    margin: float = Field(
        0.25, gt=0, le=10,
        description="Relative difference from the profile's throughput, TTFT p95 or TPOT p50 that counts as drift.",
    )  # fmt: skip
    window_seconds: PositiveInt = Field(
        600, description="How long drift must hold: every comparison in this window (each over a fifth of it) must be off."
    )
    min_requests: PositiveInt = Field(
        20, description="Finished requests a replica needs in one comparison (a fifth of the window) to be compared."
    )


class CapacitySpec(APIModel):
    """How many concurrent requests one replica should carry."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.mode) || self.mode != 'Manual' || has(self.concurrencyPerReplica)",
                    "capacity.mode Manual needs capacity.concurrencyPerReplica",
                ),
            ]
        }
    )

    mode: CapacityMode = Field(
        "Profile", description="Profile measures it with a benchmark Job; Manual takes concurrencyPerReplica."
    )
    concurrency_per_replica: PositiveInt | None = Field(None, description="Manual per-replica concurrency.")
    profile: ProfileSpec = defaulted(ProfileSpec, "Benchmark used in Profile mode.")
    headroom: float = Field(
        0.75, gt=0, le=1, description="Fraction of the measured knee each replica is loaded to."
    )
    reprofile: Reprofile = Field(
        "Auto", description="Re-measure when the profile goes stale or drifts (Auto) or on request."
    )
    drift: DriftSpec = defaulted(
        DriftSpec, "How far and how long live behaviour may differ from the profile before ProfileDrift."
    )
    verify_seconds: int = Field(
        60,
        ge=0,
        le=1800,
        description="After the sweep, the profile Job holds the recommended concurrency this long, measuring "
        "SLO attainment per window; below 99% or with a growing queue it steps down and holds again. "
        "0 skips the hold.",
    )

    @model_validator(mode="after")
    def _manual_needs_value(self) -> "CapacitySpec":
        if self.mode == "Manual" and self.concurrency_per_replica is None:
            raise ValueError("capacity.mode Manual needs capacity.concurrencyPerReplica")
        return self


class TrendSpec(APIModel):
    """Acting on where in-flight is going as well as where it is (built-in autoscaler)."""

    lookahead_seconds: int = Field(
        0, ge=0, le=600,
        description="Project in-flight this far ahead along its recent slope and scale up for the "
        "projection (about the time a new replica takes to be Ready); 0 turns the trend off.",
    )  # fmt: skip
    window_seconds: int = Field(30, ge=5, le=600, description="Seconds of in-flight the slope is fitted over.")


class StandbySpec(APIModel):
    """Replicas parked asleep beside the active ones (vLLM's sleep mode), woken before new ones start."""

    replicas: int = Field(
        ge=1, le=64, description="Replicas kept parked asleep beyond spec.replicas (the Deployment runs both)."
    )
    level: Literal[1, 2] = Field(
        1,
        description="Sleep level of a parked replica: 1 frees the KV cache and moves the weights to host memory "
        "(fastest wake), 2 drops the weights too (least memory held; they are read again on wake).",
    )
    router_wake: bool = Field(
        True,
        description="With router.enabled: the router wakes a parked replica itself the moment every awake one "
        "would pass its target in flight, and the request that found them full waits for it; the operator then "
        "takes it in as a scale-up. false leaves every wake to the operator's next tick.",
    )


class AutoscalingSpec(APIModel):
    """Which autoscaler drives replicas, and how it behaves."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.mode) || self.mode != 'keda' || has(self.prometheusAddress)",
                    "autoscaling.mode keda needs autoscaling.prometheusAddress (the Prometheus KEDA queries)",
                ),
                cel(
                    "!has(self.standby) || !has(self.mode) || self.mode == 'builtin'",
                    "autoscaling.standby needs autoscaling.mode builtin (the built-in planner wakes and parks)",
                ),
            ]
        }
    )

    mode: AutoscalingMode = Field(
        "builtin",
        description="builtin (the operator), hpa (a HorizontalPodAutoscaler on a Prometheus Adapter "
        "metric), keda (a KEDA ScaledObject with a Prometheus trigger), or off (replicas fixed).",
    )
    prometheus_address: str | None = Field(
        None,
        pattern=r"^https?://[^\s]+$",
        description="Prometheus URL the KEDA trigger queries (keda mode), "
        "e.g. http://prometheus-operated.monitoring:9090.",
    )
    target_in_flight_per_replica: float | None = Field(
        None, gt=0, description="Override of the per-replica in-flight target derived from capacity."
    )
    scale_up_stabilization_seconds: int = Field(
        30, ge=0, description="Overload must persist this long to add replicas."
    )
    scale_down_stabilization_seconds: int = Field(
        600, ge=0, description="Underload must persist this long to remove replicas."
    )
    tolerance: float = Field(
        0.1, ge=0, lt=1, description="Relative deviation from target ignored (HPA's tolerance)."
    )
    interval_seconds: int = Field(5, ge=1, description="Seconds between autoscaler evaluations.")
    trend: TrendSpec = defaulted(
        TrendSpec, "Scale up for the in-flight trend as well as its level (off by default)."
    )
    token_aware: bool = Field(
        True,
        description="With slo.ttftP95Ms, also scale on the replicas' predicted TTFT (their queued prompt tokens "
        "and decode demand over the rates they measured, in seconds), crediting replicas already starting "
        "(built-in autoscaler).",
    )
    standby: StandbySpec | None = Field(
        None,
        description="Keep replicas parked asleep (sleep mode) beside the active ones: a scale-up, or the first "
        "request at zero, wakes one in about a second instead of starting a pod; the surplus is parked instead "
        "of deleted (built-in autoscaler only).",
    )

    @model_validator(mode="after")
    def _standby_needs_builtin(self) -> "AutoscalingSpec":
        if self.standby is not None and self.mode != "builtin":
            raise ValueError(
                f"autoscaling.standby needs autoscaling.mode builtin (got {self.mode}): the built-in planner wakes "
                "and parks replicas"
            )
        return self

    @model_validator(mode="after")
    def _keda_needs_prometheus(self) -> "AutoscalingSpec":
        if self.mode == "keda" and self.prometheus_address is None:
            raise ValueError(
                "autoscaling.mode keda needs autoscaling.prometheusAddress (the Prometheus KEDA queries)"
            )
        return self


class ExpectedLoadSpec(APIModel):
    """Load expected at start, for the initial replica count (Little's law for a rate).

    Used only while ``spec.replicas`` is unset: the operator then writes the
    sized count to ``spec.replicas`` once, and from there the autoscaler (or an
    HPA, or the user) owns it.
    """

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!(has(self.concurrency) && has(self.requestsPerSecond))",
                    "expectedLoad takes concurrency or requestsPerSecond, not both",
                ),
                cel(
                    "!has(self.requestsPerSecond) || has(self.avgLatencySeconds)",
                    "expectedLoad.requestsPerSecond needs avgLatencySeconds (in flight = rate × latency)",
                ),
            ]
        }
    )

    concurrency: float | None = Field(None, ge=0, description="Expected concurrent requests.")
    requests_per_second: float | None = Field(None, ge=0, description="Expected arrival rate.")
    avg_latency_seconds: float | None = Field(
        None, gt=0, description="Mean request latency, to turn a rate into concurrency (L = λW)."
    )

    @model_validator(mode="after")
    def _one_of(self) -> "ExpectedLoadSpec":
        if self.concurrency is not None and self.requests_per_second is not None:
            raise ValueError("expectedLoad takes concurrency or requestsPerSecond, not both")
        if self.requests_per_second is not None and self.avg_latency_seconds is None:
            raise ValueError(
                "expectedLoad.requestsPerSecond needs avgLatencySeconds (in flight = rate × latency)"
            )
        return self


class LocalObjectReference(APIModel):
    """A reference by name to an object in the same namespace."""

    name: str = Field(min_length=1, max_length=253, description="Object name.")


class EndpointPickerRef(APIModel):
    """The Gateway API Inference Extension endpoint picker an InferencePool names (v1 shape)."""

    name: str = Field(min_length=1, max_length=253, description="Name of the endpoint picker's Service.")
    port: int = Field(9002, ge=1, le=65535, description="Its ext_proc gRPC port (the picker's usual 9002).")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        "FailClose", description="What the gateway does when the picker does not answer."
    )


class KVOffloadSpec(APIModel):
    """A host-memory tier for KV blocks evicted from each replica's cache (vLLM's --kv-offloading-size)."""

    size: Quantity = Field(description="Host memory per replica for evicted KV blocks, e.g. 4Gi.")


class KVSharedSpec(APIModel):
    """A KV tier shared by the replicas: a Valkey server the operator deploys, or an existing endpoint."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.passwordSecretRef) || has(self.endpoint)",
                    "kvCache.shared.passwordSecretRef is for an existing endpoint; the Valkey the operator "
                    "deploys gets a random password of its own",
                ),
            ]
        }
    )

    endpoint: str | None = Field(
        None, pattern=r"^rediss?://", description="redis://HOST:PORT of an existing Valkey/Redis server; unset: "
        "the operator deploys one (a Deployment and Service owned by this LLMService) that requires a random "
        "password (kept in the <name>-admin-key Secret)."
    )
    password_secret_ref: SecretKeyRef | None = Field(
        None, description="The existing endpoint's password (AUTH), handed to the replicas from this Secret; "
        "never put it in the endpoint URL, which is stored in plain text."
    )
    size: Quantity = Field("1Gi", description="The deployed server's maxmemory (LRU beyond it), e.g. 8Gi.")
    image: str = Field("valkey/valkey:8.1", description="Image of the deployed server.")
    timeout_seconds: float = Field(0.25, gt=0, description="--kv-shared-timeout of each replica.")

    @model_validator(mode="after")
    def _password_for_an_endpoint(self) -> "KVSharedSpec":
        if self.password_secret_ref is not None and self.endpoint is None:
            raise ValueError(
                "kvCache.shared.passwordSecretRef is for an existing endpoint; the Valkey the operator deploys "
                "gets a random password of its own"
            )
        if self.endpoint is not None and "@" in self.endpoint.split("://", 1)[1].split("/", 1)[0]:
            raise ValueError(
                "kvCache.shared.endpoint holds credentials (user:password@); the spec is stored in plain text: "
                "put the password in a Secret and name it in kvCache.shared.passwordSecretRef"
            )
        return self


class KVCacheSpec(APIModel):
    """KV cache beyond one replica's memory: offload, a tier shared by the replicas, KV events."""

    offload: KVOffloadSpec | None = Field(None, description="Host-memory offload tier per replica.")
    shared: KVSharedSpec | None = Field(None, description="A KV tier shared by the replicas.")
    events: bool | None = Field(
        None, description="Publish vLLM's KV events (--kv-events-config) on port 5557; unset: on with "
        "router.policy precise-prefix, which subscribes to them."
    )


class RouterSpec(APIModel):
    """What sits in front of the replicas: plimsoll's router, or a Gateway API InferencePool."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.endpointPickerRef) || (has(self.mode) && self.mode == 'inferencePool')",
                    "router.endpointPickerRef needs router.mode inferencePool",
                ),
                cel(
                    "!(has(self.enabled) && self.enabled && has(self.mode) && self.mode == 'inferencePool')",
                    "router.enabled (plimsoll's router) and router.mode inferencePool (a Gateway's picker) "
                    "exclude each other; choose one",
                ),
            ]
        }
    )

    enabled: bool = Field(
        False,
        description="Deploy plimsoll's router and point the endpoint at it (always on with scaling.min 0 "
        "unless mode is inferencePool).",
    )
    policy: RouterPolicy = Field("least-in-flight", description="How the router picks a replica.")
    hold_queue: int = Field(
        64, ge=0, description="Requests the router holds while no replica is Ready; beyond it, 429 with "
        "Retry-After from the measured cold starts."
    )
    hold_timeout_seconds: int | None = Field(
        None, ge=1, le=600, description="Longest a request is held; default twice the measured cold-start p95, "
        "at most 600."
    )
    replicas: int = Field(
        2, ge=1, le=16, description="Router pods: each discovers the replicas itself and routes alike (no "
        "shared state), so with two or more, losing one fails no request a client retries once. A "
        "PodDisruptionBudget keeps all but one up, and the pods prefer different nodes."
    )
    migration_limit: int = Field(
        3, ge=0, le=16, description="--migration-limit: times one request may move to another replica when its "
        "replica fails mid-generation (a stream carries on from the last token the client got); 0: off."
    )
    migration_wait_seconds: float = Field(
        30.0, ge=0, le=600, description="--migration-wait: seconds a request whose replica failed, or that "
        "arrives while replicas are restarting, waits for a ready replica before it gets 503 with Retry-After."
    )
    mode: RouterMode = Field(
        "plimsoll",
        description="plimsoll (the router above, when enabled) or inferencePool: an InferencePool "
        "(inference.networking.k8s.io/v1) selecting the replicas, for a Gateway's endpoint picker; "
        "plimsoll replicas then also export the vllm: series the picker reads.",
    )
    endpoint_picker_ref: EndpointPickerRef | None = Field(
        None, description="The endpoint picker the InferencePool names (inferencePool mode)."
    )
    tenant_keys_secret_ref: LocalObjectReference | None = Field(
        None,
        description="A Secret whose keys are tenant names and values their API keys: the router authenticates "
        "clients with them and sets x-gateway-inference-fairness-id to the tenant (its own token cap and "
        "prefix-cache salt on the replicas).",
    )

    @model_validator(mode="after")
    def _picker_needs_pool(self) -> "RouterSpec":
        if self.endpoint_picker_ref is not None and self.mode != "inferencePool":
            raise ValueError("router.endpointPickerRef needs router.mode inferencePool")
        if self.enabled and self.mode == "inferencePool":
            raise ValueError(
                "router.enabled (plimsoll's router) and router.mode inferencePool (a Gateway's picker) "
                "exclude each other; choose one"
            )
        return self


class NetworkPolicySpec(APIModel):
    """Who may open connections to the replicas (a NetworkPolicy the operator keeps per LLMService)."""

    enabled: bool = Field(
        True,
        description="Keep a NetworkPolicy that lets only the router, the profile Job, the operator, the "
        "metrics scraper and ingressFrom reach the replicas' port (and, for multi-node replicas, every port "
        "only from the same LLMService's pods). Enforced where the cluster's network plugin supports it.",
    )
    ingress_from: list[FreeForm] = Field(
        default_factory=list,
        description="More NetworkPolicyPeer objects allowed on the serving port: the clients when no router is "
        "in front (default then: pods of this namespace), a Gateway and its endpoint picker (inferencePool).",
    )


class TracingSpec(APIModel):
    """OpenTelemetry traces from the replicas and the router."""

    otlp_endpoint: str | None = Field(
        None,
        pattern=r"^https?://",
        description="OTLP/HTTP traces URL (--otlp-traces-endpoint), e.g. http://otel-collector:4318/v1/traces.",
    )


class ObservabilitySpec(APIModel):
    """Where telemetry beyond Prometheus metrics goes."""

    tracing: TracingSpec = defaulted(TracingSpec, "OpenTelemetry tracing.")


class LLMServiceSpec(APIModel):
    """What an LLMService asks for: a model, an engine, GPUs and how to size and scale it."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!has(self.replicas) || !has(self.scaling) "
                    "|| (has(self.autoscaling) && has(self.autoscaling.mode) && self.autoscaling.mode == 'off') "
                    "|| (self.replicas >= self.scaling.min && self.replicas <= self.scaling.max)",
                    "replicas must lie within scaling.min..scaling.max unless autoscaling.mode is off",
                ),
                cel(
                    "!has(self.autoscaling) || !has(self.autoscaling.mode) "
                    "|| !(self.autoscaling.mode in ['hpa', 'keda']) || has(self.scaling)",
                    "autoscaling.mode hpa and keda need scaling.min and scaling.max",
                ),
                cel(
                    "!has(self.variants) || size(self.variants) == 0 "
                    "|| (!has(self.replicas) && !has(self.scaling))",
                    "with variants, each variant's minReplicas and maxReplicas bound its count: "
                    "drop spec.replicas and spec.scaling",
                ),
                cel(
                    "!has(self.variants) || size(self.variants) == 0 || !has(self.autoscaling) "
                    "|| !has(self.autoscaling.mode) || self.autoscaling.mode in ['builtin', 'off']",
                    "variants are mixed by the built-in replica planner: autoscaling.mode builtin (or off, "
                    "each variant at its minReplicas)",
                ),
            ]
        }
    )

    model: ModelSpec = Field(description="The model to serve.")
    engine: EngineSpec = defaulted(EngineSpec, "Inference engine and its settings.")
    resources: ResourcesSpec = defaulted(ResourcesSpec, "Per-replica compute.")
    scheduling: SchedulingSpec = defaulted(SchedulingSpec, "Pod placement.")
    replicas: int | None = Field(
        None,
        ge=0,
        description="Replica count (the scale subresource); autoscalers write it within scaling bounds. "
        "Left unset, the operator writes it once: sized from expectedLoad, else scaling.min for hpa/keda.",
    )
    scaling: ScalingSpec | None = Field(None, description="Replica bounds for autoscaling.")
    slo: SLOSpec = defaulted(SLOSpec, "Latency objectives.")
    capacity: CapacitySpec = defaulted(CapacitySpec, "Per-replica capacity.")
    autoscaling: AutoscalingSpec = defaulted(AutoscalingSpec, "Autoscaler settings.")
    expected_load: ExpectedLoadSpec | None = Field(None, description="Load expected at start.")
    router: RouterSpec = defaulted(RouterSpec, "Router in front of the replicas.")
    observability: ObservabilitySpec = defaulted(ObservabilitySpec, "Traces.")
    kv_cache: KVCacheSpec = defaulted(
        KVCacheSpec, "KV cache beyond one replica: offload tier, shared tier, KV events."
    )
    pod_annotations: dict[str, str] = Field(
        default_factory=dict, description="Extra annotations on every replica pod (e.g. for a service mesh)."
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, description="Secrets for pulling the engine image from a private registry."
    )
    service_account_name: str | None = Field(
        None,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
        description="ServiceAccount the replicas run as (its token is mounted); unset: the namespace's "
        "default, with no token mounted.",
    )
    volumes: list[FreeForm] = Field(
        default_factory=list,
        description="Extra pod volumes (Kubernetes Volume objects), e.g. a ConfigMap or a CSI volume.",
    )
    volume_mounts: list[FreeForm] = Field(
        default_factory=list,
        description="Where the engine container mounts them (Kubernetes VolumeMount objects).",
    )
    network_policy: NetworkPolicySpec = defaulted(
        NetworkPolicySpec, "The replicas' NetworkPolicy (on by default)."
    )
    disaggregation: DisaggregationSpec | None = Field(
        None,
        description="Prefill and decode on separate pools (vLLM's kv_transfer_params protocol): the replicas "
        "above become the decode pool, disaggregation.prefill a pool of its own, the router sends each request "
        "through both; status.disaggregation says whether the split pays.",
    )
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        description="LoRA adapters on the base model: loaded on every Ready replica through the engine's API "
        "(POST /v1/load_lora_adapter), unloaded when removed; status.adapters says where each is loaded.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    variants: list[VariantSpec] = Field(
        default_factory=list,
        max_length=MAX_VARIANTS,
        description="Hardware variants serving this model side by side (one Deployment each, behind the same "
        "Service and router), each profiled on its own; the replica planner runs the cheapest mix that "
        "carries the demand at the SLO. Empty: one Deployment shaped by spec.resources.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    mix: MixSpec = defaulted(
        MixSpec, "How variants are mixed: spot exposure limit, rebalancing, unavailable variants."
    )

    @model_validator(mode="after")
    def _consistent(self) -> "LLMServiceSpec":
        location = parse_model_uri(self.model.uri)
        for volume in self.volumes:
            if not isinstance(volume.get("name"), str) or not volume["name"]:
                raise ValueError("every entry of volumes needs a name")
            if volume["name"] in RESERVED_VOLUME_NAMES or volume["name"].startswith(RESERVED_VOLUME_PREFIX):
                raise ValueError(
                    f"volume name {volume['name']!r} is used by the operator "
                    f"({', '.join(RESERVED_VOLUME_NAMES)}, {RESERVED_VOLUME_PREFIX}*); pick another"
                )
        names = {v["name"] for v in self.volumes}
        for mount in self.volume_mounts:
            if mount.get("name") not in names or not mount.get("mountPath"):
                raise ValueError(
                    f"volumeMounts entry {mount!r} needs a mountPath and the name of an entry in volumes"
                )
        if self.engine.kind != "plimsoll" and self.engine.scheduling_policy == "static":
            raise ValueError(
                f"engine.schedulingPolicy static exists only in plimsoll; use continuous or priority with "
                f"{self.engine.kind}"
            )
        self._check_sglang()
        self._check_parallelism()
        if self.autoscaling.standby is not None and self.engine.kind == "sglang":
            raise ValueError(
                "autoscaling.standby parks replicas with vLLM's sleep interface (POST /sleep, /wake_up), which "
                "engine.kind sglang does not serve: drop autoscaling.standby or use plimsoll or vllm"
            )
        if self.autoscaling.standby is not None and self.resources.nodes > 1:
            raise ValueError(
                "autoscaling.standby parks single-pod replicas; a replica spanning resources.nodes > 1 cannot "
                "sleep as one yet: drop autoscaling.standby or use one node per replica"
            )
        if self.engine.kind != "plimsoll" and location.scheme == "embedded":
            raise ValueError(
                f"engine.kind {self.engine.kind} cannot serve embedded:// models (they live in the plimsoll "
                "image); use engine.kind plimsoll, or point model.uri at hf://, pvc:// or file://"
            )
        self._check_adapters()
        self._check_model_cache(location.scheme)
        self._check_disaggregation()
        self._check_variants()
        if (
            self.replicas is not None
            and self.scaling is not None
            and self.autoscaling.mode != "off"
            and not self.scaling.min <= self.replicas <= self.scaling.max
        ):
            raise ValueError(
                f"replicas ({self.replicas}) must lie within scaling.min..scaling.max "
                f"({self.scaling.min}..{self.scaling.max}) unless autoscaling.mode is off"
            )
        if self.autoscaling.mode in ("hpa", "keda") and self.scaling is None:
            raise ValueError(
                f"autoscaling.mode {self.autoscaling.mode} needs scaling.min and scaling.max "
                "(the external autoscaler's bounds)"
            )
        return self

    def _check_sglang(self) -> None:
        """What an SGLang replica cannot be given through these fields (each error says the SGLang way)."""
        if self.engine.kind != "sglang":
            return
        unsupported = [
            (self.engine.kv_cache_memory is not None, "engine.kvCacheMemory",
             "SGLang sizes its KV pool as a fraction of memory: engine.args [--mem-fraction-static, '0.8'] "
             "or [--max-total-tokens, N]"),
            (self.engine.max_new_tokens is not None, "engine.maxNewTokens",
             "SGLang has no server-side max_tokens default; clients must send max_tokens"),
            (bool(self.adapters), "spec.adapters",
             "adapters load through vLLM's runtime LoRA API; give SGLang engine.args [--lora-paths, name=path]"),
            (self.resources.nodes > 1, "resources.nodes above 1",
             "multi-node SGLang replicas are not built; use engine.kind vllm for replicas across nodes"),
            (self.engine.api_key_secret_ref is not None, "engine.apiKeySecretRef",
             "SGLang takes its key only as --api-key on its command line, where every reader of the pod "
             "spec and /proc sees it; put an authenticating gateway or the router (--api-key) in front"),
        ]  # fmt: skip
        for bad, field, how in unsupported:
            if bad:
                raise ValueError(f"{field} is not available with engine.kind sglang: {how}")

    def _check_parallelism(self) -> None:
        gpus, nodes = self.resources.gpu.count, self.resources.nodes
        if nodes > 1 and gpus < 1:
            raise ValueError(
                "resources.nodes above 1 needs resources.gpu.count of at least 1 (GPUs on each node)"
            )
        if nodes > 1 and self.engine.kind == "plimsoll":
            raise ValueError(
                f"resources.nodes {nodes}: plimsoll's runtime runs tensor parallelism inside one pod; set "
                "resources.nodes 1 with resources.gpu.count up to a node's GPUs, or use engine.kind vllm "
                "for replicas across nodes"
            )
        tp = self.engine.tensor_parallel_size
        if tp is not None and gpus > 0 and tp > gpus:
            raise ValueError(
                f"engine.tensorParallelSize {tp} needs {tp} GPUs per pod, but resources.gpu.count is {gpus}; "
                f"raise resources.gpu.count to {tp}"
            )

    def _check_disaggregation(self) -> None:
        if self.disaggregation is None:
            return
        why = None
        if self.engine.kind != "plimsoll":
            why = "engine.kind plimsoll (its built-in KV transfer; vLLM needs a NIXL setup plimsoll does not make)"
        elif self.engine.prefix_caching is False:
            why = "prefix caching (blocks move under their prefix-cache hashes); drop engine.prefixCaching: false"
        elif self.router.mode != "plimsoll":
            why = "router.mode plimsoll (its router runs the two hops)"
        elif self.tensor_parallel_size() > 1 or self.resources.nodes > 1:
            why = "one GPU (or CPU) per replica for now; drop tensor parallelism and resources.nodes"
        elif self.lora_enabled():
            why = "no LoRA adapters (their blocks are salted per replica); drop the adapters or the split"
        elif self.variants:
            why = (
                "one hardware variant (the pools are sized by one profile each, not mixed across variants); "
                "drop spec.variants or spec.disaggregation"
            )
        if why is not None:
            raise ValueError(f"disaggregation needs {why}")
    def _check_variants(self) -> None:
        if not self.variants:
            return
        names = [v.name for v in self.variants]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"variants: each name once; {', '.join(twice)} appear more than once")
        if self.replicas is not None or self.scaling is not None:
            raise ValueError(
                "with variants, each variant's minReplicas and maxReplicas bound its count: "
                "drop spec.replicas and spec.scaling"
            )
        if self.autoscaling.mode not in ("builtin", "off"):
            raise ValueError(
                f"autoscaling.mode {self.autoscaling.mode}: variants are mixed by the built-in replica planner; "
                "use builtin (or off, each variant at its minReplicas)"
            )
        if self.resources.nodes != 1:
            raise ValueError("variants run one pod per replica: set resources.nodes 1")
        if self.capacity.mode == "Manual":
            missing = [v.name for v in self.variants if v.concurrency_per_replica is None]
            if missing and self.capacity.concurrency_per_replica is None:
                raise ValueError(
                    f"capacity.mode Manual: variants {', '.join(missing)} need concurrencyPerReplica "
                    "(or set spec.capacity.concurrencyPerReplica for all)"
                )

    def tensor_parallel_size(self) -> int:
        """Ranks per pod: engine.tensorParallelSize, else the pod's GPUs (at least 1)."""
        if self.engine.tensor_parallel_size is not None:
            return self.engine.tensor_parallel_size
        return max(1, self.resources.gpu.count)

    def _check_adapters(self) -> None:
        names = [a.name for a in self.adapters]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"adapters: each name once; {', '.join(twice)} appear more than once")
        if self.adapters and self.engine.enable_lora is False:
            raise ValueError("adapters need LoRA: remove engine.enableLora false, or the adapters")
        if self.engine.kind != "plimsoll":
            return
        roots = [r.rstrip("/") + "/" for r in self.engine.lora_allowed_roots]
        for adapter in self.adapters:
            location = parse_adapter_uri(adapter.uri)
            path = location.name.rstrip("/") + "/"
            if location.scheme == "file" and not any(path.startswith(root) for root in roots):
                raise ValueError(
                    f"adapters: {adapter.name} ({adapter.uri}) is outside engine.loraAllowedRoots, so the "
                    "replicas would refuse to load it; add its directory (or a parent) to engine.loraAllowedRoots"
                )

    def _check_model_cache(self, scheme: str) -> None:
        """A node-local cache holds what ``plimsoll fetch`` downloads: hf:// models (and hf:// adapters)."""
        cache = self.model.cache
        if cache.host_path is None:
            return
        if cache.prefill and scheme != "hf":
            raise ValueError(
                f"model.cache.prefill downloads an hf:// model onto the nodes ahead; model.uri is {scheme}://, "
                "which needs no download: drop model.cache.prefill"
            )
        hf_adapters = any(parse_adapter_uri(a.uri).scheme == "hf" for a in self.adapters)
        if scheme != "hf" and not hf_adapters:
            raise ValueError(
                f"model.cache.hostPath caches downloads of hf:// models and adapters; model.uri is {scheme}:// "
                "and no adapter is hf://: drop model.cache, or point model.uri at hf://"
            )

    def lora_enabled(self) -> bool:
        """--enable-lora: asked for, or implied by declared adapters."""
        return bool(self.engine.enable_lora) or (self.engine.enable_lora is None and bool(self.adapters))

    @model_validator(mode="after")
    def _check_precise_prefix(self) -> "LLMServiceSpec":
        if self.router.policy == "precise-prefix":
            scheme = self.model.uri.split("://", 1)[0]
            if scheme == "hf":
                raise ValueError(
                    "router.policy precise-prefix hashes prompts with the model's tokenizer in the router pod; "
                    "serve the model from embedded://, file:// or pvc:// (hf:// downloads only into replica pods)"
                )
            if self.kv_cache.events is False:
                raise ValueError("router.policy precise-prefix reads the replicas' KV events; drop kvCache.events: false")
        return self

    def router_in_front(self) -> bool:
        """The router runs when asked for, always with scaling.min 0 (it holds requests at zero), and on a
        split service (it runs the two hops)."""
        return self.router.enabled or self.disaggregation is not None or (
            self.scaling is not None and self.scaling.min == 0 and self.router.mode == "plimsoll"
        )

    def desired_replicas(self) -> int:
        """Replicas the Deployment gets before any autoscaler decision: spec.replicas, else scaling.min, else 1."""
        if self.replicas is not None:
            return self.replicas
        if self.scaling is not None:
            return self.scaling.min
        return 1
