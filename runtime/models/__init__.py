"""Llama-family decoder models for the runtime."""
