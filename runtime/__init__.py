"""plimsoll.runtime: the inference engine and OpenAI-compatible server."""
