"""The engine: requests, scheduler, paged KV cache, model runner, sampler and the step loop.

It sits below serving (HTTP) and above models and attention; it never imports serving.
"""
