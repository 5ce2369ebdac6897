"""Continuous batching for generation models: the decode runner, slots, prompt
caching, context fitting, prompts, sampling and chat templates. No ML library."""
