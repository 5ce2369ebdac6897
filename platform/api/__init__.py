"""OpenAI-compatible REST endpoints, API keys and usage."""
