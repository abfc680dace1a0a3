"""The HTTP layer: the OpenAI-compatible API, request validation and admission, SSE, metrics and drain.

It drives the engine through its client interface; nothing below it imports it.
"""
