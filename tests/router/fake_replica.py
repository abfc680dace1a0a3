"""A stand-in OpenAI replica for router tests, run as its own process so a test can SIGKILL it.

What it is: real HTTP (Starlette on uvicorn, 127.0.0.1) with the runtime's
surface: /v1/completions and /v1/chat/completions (JSON or SSE), /v1/models,
/health, /ready, and a Prometheus /metrics with the plimsoll running/waiting
gauges and prefix-cache counters. Its knobs make behaviour a router must
react to: a per-token delay (a slow replica), a concurrency limit (a waiting
queue), and a prefix cache of chained hashes over fixed-size character blocks
whose hits shorten time to first token. What it is not: a model; text is
made up, and "tokens" are characters.

Usage: python fake_replica.py --port P [--token-delay S] [--max-running N] [--engine vllm] ...
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from plimsoll import metric_names as m


def error(status: int, message: str, kind: str, param: str | None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


class PrefixCache:
    """Chained hashes of full `block` -character blocks, LRU-bounded like a paged KV cache."""

    def __init__(self, block: int, capacity: int) -> None:
        self.block, self.capacity = block, capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def lookup_and_insert(self, text: str) -> int:
        """Characters of `text` already cached as a prefix; then cache all of its full blocks."""
        parent, hit, missed = b"", 0, False
        for start in range(0, len(text) - self.block + 1, self.block):
            parent = hashlib.blake2b(parent + text[start:start + self.block].encode(), digest_size=16).digest()
            if not missed and parent in self.blocks:
                hit += self.block
            else:
                missed = True
            self.blocks[parent] = None
            self.blocks.move_to_end(parent)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)
        return hit


def build(args: argparse.Namespace) -> Starlette:
    registry = CollectorRegistry()
    names = m.ENGINE_FAMILIES[args.engine]
    running = Gauge(names.running, "running", registry=registry)
    waiting = Gauge(names.waiting, "waiting", registry=registry)
    queries = Counter(names.prefix_queries.removesuffix("_total"), "queries", registry=registry)
    hits = Counter(names.prefix_hits.removesuffix("_total"), "hits", registry=registry)
    served = Counter("fake_requests_served", "requests this replica answered", registry=registry)
    slots = asyncio.Semaphore(args.max_running)
    cache = PrefixCache(args.block_chars, args.cache_blocks)

    def prompt_of(body: dict[str, Any], chat: bool) -> str | JSONResponse:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return error(400, "messages must be a non-empty list", "BadRequestError", "messages")
            return "".join(f"{x.get('role')}:{x.get('content')}\n" for x in messages if isinstance(x, dict))
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or not prompt:
            return error(400, "prompt must be a non-empty string", "BadRequestError", "prompt")
        return prompt

    async def generate(request: Request) -> Response:
        chat = request.url.path.endswith("chat/completions")
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error(400, "request body is not valid JSON", "BadRequestError", None)
        if not isinstance(body, dict):
            return error(400, "request body must be a JSON object", "BadRequestError", None)
        if body.get("model") != args.model:
            return error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError", "model")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return error(400, "max_tokens must be a positive integer", "BadRequestError", "max_tokens")
        prompt = prompt_of(body, chat)
        if isinstance(prompt, JSONResponse):
            return prompt
        kind = "chat.completion" if chat else "text_completion"

        async def tokens() -> AsyncIterator[str]:
            waiting.inc()
            try:
                await slots.acquire()
            finally:
                waiting.dec()
            running.inc()
            try:
                hit = cache.lookup_and_insert(prompt)
                queries.inc(len(prompt))
                hits.inc(hit)
                await asyncio.sleep(args.ttft_base + (len(prompt) - hit) * args.prefill_per_char)
                for i in range(max_tokens):
                    if i:
                        await asyncio.sleep(args.token_delay)
                    yield f"t{i} "
                served.inc()
            finally:
                running.dec()
                slots.release()

        def chunk(text: str, finish: str | None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": text} if text else {}
            else:
                choice["text"] = text
            return {"id": "fake-1", "object": kind + (".chunk" if chat else ""), "created": int(time.time()),
                    "model": args.model, "choices": [choice]}

        if body.get("stream"):
            async def events() -> AsyncIterator[bytes]:
                async for text in tokens():
                    yield f"data: {json.dumps(chunk(text, None))}\n\n".encode()
                yield f"data: {json.dumps(chunk('', 'length'))}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        text = "".join([t async for t in tokens()])
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        usage = {"prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                 "total_tokens": len(prompt) + max_tokens}
        return JSONResponse({"id": "fake-1", "object": kind, "created": int(time.time()), "model": args.model,
                             "choices": [choice], "usage": usage})

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": args.model, "object": "model", "owned_by": "fake"}]})

    async def ok(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route("/v1/completions", generate, methods=["POST"]),
        Route("/v1/chat/completions", generate, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", ok),
        Route("/metrics", metrics),
    ]
    if args.engine == "plimsoll":  # vLLM has no /ready; its /health is all a prober gets
        routes.append(Route("/ready", ok))
    return Starlette(routes=routes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="fake")
    parser.add_argument("--token-delay", type=float, default=0.005)
    parser.add_argument("--ttft-base", type=float, default=0.005)
    parser.add_argument("--prefill-per-char", type=float, default=0.00002)
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--block-chars", type=int, default=16)
    parser.add_argument("--cache-blocks", type=int, default=4096)
    parser.add_argument("--engine", choices=sorted(m.ENGINE_FAMILIES), default="plimsoll",
                        help="Metric names (and probe endpoints) to expose: plimsoll's or vLLM's.")
    args = parser.parse_args()
    uvicorn.run(build(args), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
