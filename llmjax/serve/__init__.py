"""The OpenAI-compatible server: `protocol` (schemas), `async_engine` (the engine loop thread and
its queues), `metrics` (Prometheus), `api` (the FastAPI app), `asgi` (errors, API key, body limit),
`server` (`llmjax serve`'s process); and the cache-aware router: `routing` (policies), `router` (its
app), `cluster` (`llmjax cluster`: replicas plus router). Run it with `llmjax serve`."""
