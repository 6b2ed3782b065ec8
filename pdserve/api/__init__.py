"""The OpenAI-compatible HTTP API (completions, chat completions, models, health, metrics)."""
