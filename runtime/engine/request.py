"""Per-sequence state inside the engine: tokens, progress, blocks, status, timestamps.

What it is: one ``Request`` per generated sequence (a request with ``n > 1`` becomes
``n`` sibling sequences sharing a ``group_id``). What it is not: scheduling or KV
logic; the scheduler and the KV cache manager read and update these fields.
"""

import enum
import hashlib
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from plimsoll.runtime.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from plimsoll.runtime.engine.detokenizer import IncrementalDetokenizer
    from plimsoll.runtime.engine.lora_manager import LoRARequest
    from plimsoll.runtime.engine.outputs import Logprob
    from plimsoll.ttft_prediction import TTFTDeadline

# First parent of every hash chain: fixed, so hashes agree across processes and pods.
ROOT_HASH = hashlib.sha256(b"plimsoll-prefix-cache-v1").digest()


@dataclass(frozen=True, slots=True)
class Continuation:
    """Output a request already produced elsewhere (another replica, before it failed).

    ``token_ids`` were generated and delivered to the client; ``num_chars`` is how much of
    their text (Unicode code points) the client has received, which can be less than all
    of it while a multi-byte character or a possible stop string was held back. The
    engine carries on from there as if it had generated them itself: they count towards
    ``max_tokens`` and ``min_tokens``, feed the penalties, are searched for stop strings
    with what follows, set the position seeded sampling draws for, and are reported in
    ``usage.completion_tokens``; they are never sent again.
    """

    token_ids: tuple[int, ...]
    num_chars: int = 0


def position_seed(seed: int, index: int, position: int) -> int:
    """The 63-bit seed of a seeded sequence's draw for its output token ``position``.

    Sampling randomness that depends only on (request seed, sequence index, output
    position) lets a sequence continued elsewhere (``Continuation``) draw exactly what
    it would have drawn uninterrupted; a generator whose state carries over from step
    to step would need its whole history. Samplers seed one generator per step from it.
    """
    packed = struct.pack("<QQQ", seed % 2**64, index % 2**64, position % 2**64)
    return int.from_bytes(hashlib.blake2b(packed, digest_size=8).digest(), "little") >> 1


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


def hash_block(parent: bytes, token_ids: list[int] | tuple[int, ...], salt: str | None) -> bytes:
    """Chained hash of one full block: its tokens, its parent's hash, and an optional salt."""
    h = hashlib.sha256(parent)
    if salt is not None:
        h.update(salt.encode())
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


@dataclass(eq=False)
class Request:
    """One sequence. ``all_token_ids`` = prompt + generated; the scheduler lets
    ``num_computed_tokens`` catch up with ``num_tokens``."""

    request_id: str  # unique per sequence: "<group_id>" or "<group_id>#<index>"
    group_id: str
    index: int  # 0..n-1 within the group
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    arrival_time: float = field(default_factory=time.monotonic)
    # Set when blocks may be shared across requests: None = no sharing (prefix caching
    # off, n == 1); "" = global prefix cache; otherwise only siblings share (n > 1, caching off).
    cache_salt: str | None = ""
    # Scheduling attributes (read only by the priority policy): lower ``priority`` runs
    # first (vLLM's semantics); ``fairness_id`` names the tenant charged for the tokens.
    priority: int = 0
    fairness_id: str | None = None

    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 = not yet scheduled
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: "torch.Generator | None" = None
    generator_position: int = -1  # the output position the generator was last seeded for
    detokenizer: "IncrementalDetokenizer | None" = None
    logprobs: "list[dict[int, Logprob]] | None" = None
    num_emitted_tokens: int = 0  # output tokens already reported to the consumer
    num_emitted_logprobs: int = 0
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)  # (start, end, tokens)
    # Proposed next tokens (speculative decoding), verified by the next step; never in all_token_ids.
    spec_token_ids: list[int] = field(default_factory=list)
    lora: "LoRARequest | None" = None  # the adapter this sequence runs under; None = the base model
    # Prefill/decode disaggregation (runtime/kv/remote_prefill.py): what this request's kv_transfer_params
    # asked (hold its blocks for a decode replica, or pull them from a prefill replica), and, on the
    # prefill side, the parameters handed back for the decode replica when it finished.
    kv_transfer: object = None
    kv_transfer_params: dict[str, object] | None = None
    lora_slot: int = -1  # its device slot while running (lora_manager.py); -1 = none held
    # Output tokens a continuation brought in (generated elsewhere and already delivered); they
    # lead ``output_token_ids`` but this engine neither computed them as output nor reports them.
    num_prior_output_tokens: int = 0
    # An admitted request's TTFT bound (``x-slo-ttft-ms``): until its first token it may be refused
    # from the queue when it can no longer meet it (``late_refusal.py``); None = no bound.
    ttft_deadline: "TTFTDeadline | None" = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_new_output_tokens(self) -> int:
        """Output tokens this engine sampled (a continuation's prior tokens excluded)."""
        return len(self.output_token_ids) - self.num_prior_output_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def continue_from(self, token_ids: tuple[int, ...] | list[int]) -> None:
        """Take a continuation's output tokens as already generated and already reported."""
        assert not self.output_token_ids and self.num_computed_tokens == 0, "only a fresh sequence continues"
        self.output_token_ids = list(token_ids)
        self.all_token_ids = [*self.prompt_token_ids, *token_ids]
        self.num_prior_output_tokens = self.num_emitted_tokens = len(token_ids)

    def update_block_hashes(self, block_size: int) -> None:
        """Extend ``block_hashes`` to cover every full block of known tokens."""
        if self.cache_salt is None:
            return
        num_full = self.num_tokens // block_size
        for i in range(len(self.block_hashes), num_full):
            parent = self.block_hashes[i - 1] if i else ROOT_HASH
            tokens = self.all_token_ids[i * block_size : (i + 1) * block_size]
            salt = (self.cache_salt or None) if i == 0 else None  # the chain carries it onward
            self.block_hashes.append(hash_block(parent, tokens, salt))


@dataclass(eq=False)
class RequestGroup:
    """A user request: ``n`` sibling sequences reported together."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]
    arrival_time: float
    finished_seqs: set[int] = field(default_factory=set)
    error: str | None = None  # why this request failed in the engine, if it did

    @property
    def finished(self) -> bool:
        return len(self.finished_seqs) == len(self.seqs)
