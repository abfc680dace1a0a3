"""Paged attention: backend selection (``backends``), the SDPA path, the Triton kernels and the oracle.

``reference.py`` is the readable einsum oracle the fast backends are tested against.
"""
