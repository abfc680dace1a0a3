"""Tensor-parallel communication: the process group of one replica's ranks and its collectives.

It sits below models (whose sharded layers all-reduce through it) and beside attention;
it knows nothing of requests, scheduling or HTTP.
"""
