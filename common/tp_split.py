"""How a decoder's heads and MLP columns split over tensor-parallel ranks: pure arithmetic, no torch.

What it is: the one rule both the runtime (``runtime/models/tensor_parallel.py``,
which shards the weights) and ``plimsoll plan`` (which sizes memory per GPU) use:
query heads and MLP columns must divide evenly; KV heads are split when the rank
count divides them and replicated when it is a multiple of them (GQA with fewer KV
heads than ranks: each KV head is cached by the ranks whose query heads read it).
The vocabulary is padded up to a multiple of the rank count. What it is not: the sharding itself.
"""


def split_error(heads: int, kv_heads: int, intermediate: int, tp: int) -> str | None:
    """Why these shapes cannot split over ``tp`` ranks, or None when they can."""
    if tp == 1:
        return None
    sizes = f"try a tensor_parallel_size that divides {heads}"
    if heads % tp:
        return f"tensor_parallel_size={tp} does not divide the model's {heads} attention heads; {sizes}"
    if kv_heads % tp and tp % kv_heads:
        return (
            f"tensor_parallel_size={tp} neither divides the model's {kv_heads} KV heads nor is a multiple "
            f"of them (so they can be neither split nor replicated evenly); {sizes} and either divides or "
            f"is a multiple of {kv_heads}"
        )
    if intermediate % tp:
        return f"tensor_parallel_size={tp} does not divide the model's intermediate_size {intermediate}; pick one that does"
    return None


def kv_heads_per_rank(kv_heads: int, tp: int) -> int:
    """KV heads each rank caches: its share, or one replicated head when there are fewer than ranks."""
    return max(1, kv_heads // tp)


def vocab_per_rank(vocab: int, tp: int) -> int:
    """Embedding and LM-head rows per rank (the vocabulary padded to a multiple of ``tp``)."""
    return -(-vocab // tp)
