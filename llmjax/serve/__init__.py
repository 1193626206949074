"""The OpenAI-compatible server: `protocol` (schemas), `async_engine` (the engine loop thread and
its queues), `metrics` (Prometheus), `api` (the FastAPI app). Run it with `llmjax serve`."""
