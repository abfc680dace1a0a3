"""KV blocks beyond the engine's own cache: identity, transfer, offload tiers and KV events.

One block-identity rule (``blocks.py``) serves every part: the host and disk tiers, the
tier shared by replicas, the KV events the router indexes, and moving blocks between
engines. It sits beside the engine (which calls it) and below serving; the router imports
``blocks`` and ``events`` only (neither needs torch).
"""
