"""Paged KV memory bookkeeping (plain Python): block pool, radix prefix cache, per-request block tables."""

from llmjax.kv.block_pool import NULL_BLOCK, BlockPool
from llmjax.kv.manager import KVCacheManager, KVUsage
from llmjax.kv.radix_cache import PrefixCacheStats, PrefixMatch, RadixCache
from llmjax.kv.sizing import num_blocks_from_budget

__all__ = [
    "NULL_BLOCK",
    "BlockPool",
    "KVCacheManager",
    "KVUsage",
    "PrefixCacheStats",
    "PrefixMatch",
    "RadixCache",
    "num_blocks_from_budget",
]
