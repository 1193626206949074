"""llmjax: an LLM serving engine in JAX, Flax and Pallas.

`from llmjax import LLM, SamplingParams` for offline generation. The names are imported lazily,
so plain-Python parts (`llmjax.kv`, `llmjax.scheduler`) load without JAX.
"""

from typing import Any

__all__ = ["LLM", "SamplingParams", "LLMEngine", "EngineConfig"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from llmjax.llm import LLM

        return LLM
    if name == "SamplingParams":
        from llmjax.sampling_params import SamplingParams

        return SamplingParams
    if name == "LLMEngine":
        from llmjax.engine import LLMEngine

        return LLMEngine
    if name == "EngineConfig":
        from llmjax.config import EngineConfig

        return EngineConfig
    raise AttributeError(f"module 'llmjax' has no attribute {name!r}")
