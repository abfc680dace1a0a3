"""Speculative decoding: proposers (n-gram, draft model), verification, rejection sampling."""
