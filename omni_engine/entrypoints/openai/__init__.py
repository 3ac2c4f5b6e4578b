"""Serving a pipeline with vLLM's own OpenAI-compatible server."""
