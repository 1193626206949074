"""How many KV blocks a memory budget holds, and the budget on an accelerator.

The pool is sized from bytes, never from a count of requests: num_blocks =
budget // (block_size * kv_bytes_per_token), one of which is the null block.
On an accelerator the budget is vLLM's: `gpu_memory_utilization` of the device memory, less
the resident weights and the peak activations of a profiled forward at the largest bucket
(`kv_budget_bytes`; the memory report is injected, so a test can fake a device).
"""

from __future__ import annotations

from typing import Callable

from llmjax.config import ConfigError


def num_blocks_from_budget(budget_bytes: int, block_size: int, kv_bytes_per_token: int) -> int:
    """Blocks (null block included) that fit in `budget_bytes`.

    `ConfigError` (a ValueError) when the budget holds fewer than 2 blocks (the null block and one
    usable block); ValueError for a non-positive block size or bytes per token.
    """
    _check_positive(block_size=block_size, kv_bytes_per_token=kv_bytes_per_token)
    block_bytes = block_size * kv_bytes_per_token
    num_blocks = max(budget_bytes, 0) // block_bytes
    if num_blocks < 2:
        raise ConfigError(
            f"KV budget of {budget_bytes} bytes holds {num_blocks} blocks of {block_bytes} bytes "
            f"({block_size} tokens x {kv_bytes_per_token} bytes/token); at least 2 are needed "
            f"(the null block and one usable block): raise the budget to >= {2 * block_bytes} bytes"
        )
    return num_blocks


def check_fits_host_memory(kv_bytes: int, meminfo: str = "/proc/meminfo") -> None:
    """ConfigError when a KV cache held in host memory (a CPU backend) would take more than the
    host's available memory (`MemAvailable`), where allocating it would fail or wake the OOM
    killer. No check where that figure cannot be read."""
    try:
        with open(meminfo) as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return
    if kv_bytes > available:
        raise ConfigError(f"the KV cache would take {kv_bytes / 2**30:.1f} GiB of host memory, but only "
                          f"{available / 2**30:.1f} GiB is available: lower --kv-cache-memory")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


# --- the budget on an accelerator (vLLM's rule) ---------------------------------------------------
# budget = gpu_memory_utilization x device memory - what is resident before the cache (weights)
#          - the peak activations of the largest step (profiled).

MemoryStats = Callable[[], "dict | None"]


def device_memory_stats(device=None) -> dict | None:
    """The device's allocator report (`bytes_limit`, `bytes_in_use`, `peak_bytes_in_use`), or None
    where JAX has none (CPU)."""
    import jax

    device = device or jax.local_devices()[0]
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001  backends without allocator statistics raise
        return None
    return stats if stats and "bytes_limit" in stats else None


def kv_budget_bytes(utilization: float, memory_stats: MemoryStats, profile: Callable[[], None]) -> int:
    """KV cache bytes left on the device after weights and the largest step's activations.

    `memory_stats()` is read before and after `profile()`, which must place the weights (if not
    yet resident) before it is called and run a forward at the largest bucket. Resident bytes
    before the profile (weights, anything else alive) and the peak's growth during it
    (activations, workspace) are charged against `utilization x bytes_limit`. The allocator's peak
    is a lifetime peak, so an earlier higher peak (weight loading) can only overstate the
    activations: the budget errs small. `ConfigError` (a ValueError) for a utilization outside
    (0, 1], without a memory report, or when nothing is left.
    """
    if not 0 < utilization <= 1:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    before = memory_stats()
    if before is None:
        raise ConfigError("no device memory report: size the KV cache with kv_cache_memory_bytes")
    profile()
    after = memory_stats() or before
    resident = before["bytes_in_use"]
    activations = max(0, after.get("peak_bytes_in_use", 0) - resident)
    budget = int(utilization * before["bytes_limit"]) - resident - activations
    if budget <= 0:
        raise ConfigError(
            f"no memory left for the KV cache: {utilization:.2f} x {before['bytes_limit'] / 2**30:.2f} GiB "
            f"- {resident / 2**30:.2f} GiB resident (weights) - {activations / 2**30:.2f} GiB peak "
            "activations of the largest step <= 0; raise gpu_memory_utilization or lower "
            "max_num_batched_tokens / max_num_seqs")
    return budget
