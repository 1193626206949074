"""Attention over the paged KV cache: a pure-JAX path (`xla`), a native CPU kernel (`cpu`)
and Pallas kernels."""

from llmjax.attention.backend import BACKENDS, AttentionBackend, get_attention_backend

__all__ = ["BACKENDS", "AttentionBackend", "get_attention_backend"]
