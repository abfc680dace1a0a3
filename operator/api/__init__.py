"""LLMService API models (pydantic). No I/O."""
