"""How many KV blocks a memory budget holds.

The pool is sized from bytes, never from a count of requests: num_blocks =
budget // (block_size * kv_bytes_per_token), one of which is the null block.
"""

from __future__ import annotations


def kv_bytes_per_token_gqa(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """GQA family (MHA: num_kv_heads == num_heads, MQA: 1): K and V per layer, 2 * Hkv * D * layers * dtype."""
    _check_positive(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype_bytes=dtype_bytes)
    return 2 * num_kv_heads * head_dim * num_layers * dtype_bytes


def kv_bytes_per_token_mla(num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype_bytes: int) -> int:
    """MLA: the latent and the shared RoPE key per layer, (kv_lora_rank + rope_dim) * layers * dtype."""
    _check_positive(num_layers=num_layers, kv_lora_rank=kv_lora_rank, dtype_bytes=dtype_bytes)
    if qk_rope_head_dim < 0:
        raise ValueError(f"qk_rope_head_dim must be >= 0, got {qk_rope_head_dim}")
    return (kv_lora_rank + qk_rope_head_dim) * num_layers * dtype_bytes


def num_blocks_from_budget(budget_bytes: int, block_size: int, kv_bytes_per_token: int) -> int:
    """Blocks (null block included) that fit in `budget_bytes`.

    ValueError when the budget holds fewer than 2 blocks (the null block and one usable block).
    """
    _check_positive(block_size=block_size, kv_bytes_per_token=kv_bytes_per_token)
    block_bytes = block_size * kv_bytes_per_token
    num_blocks = max(budget_bytes, 0) // block_bytes
    if num_blocks < 2:
        raise ValueError(
            f"KV budget of {budget_bytes} bytes holds {num_blocks} blocks of {block_bytes} bytes "
            f"({block_size} tokens x {kv_bytes_per_token} bytes/token); at least 2 are needed "
            f"(the null block and one usable block): raise the budget to >= {2 * block_bytes} bytes"
        )
    return num_blocks


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
