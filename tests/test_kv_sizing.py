"""The KV budget on an accelerator (vLLM's rule), with a faked device memory report."""

from __future__ import annotations

import pytest

from llmjax.config import ConfigError
from llmjax.kv.sizing import check_fits_host_memory, kv_budget_bytes, num_blocks_from_budget

MIB = 1 << 20


class FakeDevice:
    """An allocator report whose peak grows by `activations` while `profile` runs."""

    def __init__(self, limit, resident, activations):
        self.limit, self.resident, self.activations = limit, resident, activations
        self.profiled = False

    def stats(self):
        peak = self.resident + (self.activations if self.profiled else 0)
        return dict(bytes_limit=self.limit, bytes_in_use=self.resident, peak_bytes_in_use=peak)

    def profile(self):
        self.profiled = True


def test_budget_is_utilization_minus_resident_minus_peak_activations():
    dev = FakeDevice(limit=1000 * MIB, resident=100 * MIB, activations=50 * MIB)
    assert kv_budget_bytes(0.9, dev.stats, dev.profile) == 900 * MIB - 100 * MIB - 50 * MIB
    assert dev.profiled


def test_budget_errors_clearly_when_nothing_is_left():
    dev = FakeDevice(limit=100 * MIB, resident=60 * MIB, activations=30 * MIB)
    with pytest.raises(ValueError, match="no memory left for the KV cache"):
        kv_budget_bytes(0.8, dev.stats, dev.profile)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_bytes(1.5, dev.stats, dev.profile)
    with pytest.raises(ValueError, match="no device memory report"):
        kv_budget_bytes(0.5, lambda: None, dev.profile)


def test_engine_sizes_the_pool_from_the_device_report(monkeypatch):
    """With a device report (faked on CPU) and no explicit budget, the engine profiles the
    largest buckets on a 2-block cache and sizes the pool from what is left."""
    import llmjax.engine as engine_mod
    from llmjax.runner import ModelRunner
    from tests.engine_helpers import tiny_engine

    dev = FakeDevice(limit=64 * MIB, resident=8 * MIB, activations=4 * MIB)
    profiled = []

    def warmup(runner, shapes):
        profiled.append((runner.cache[0].shape[1], shapes))
        dev.profile()

    monkeypatch.setattr(engine_mod, "device_memory_stats", dev.stats)
    monkeypatch.setattr(ModelRunner, "warmup", warmup)
    engine = tiny_engine(kv_cache_memory_bytes=None, gpu_memory_utilization=0.5,
                         max_num_batched_tokens=64, max_num_seqs=8)
    cfg = engine.model_config
    bytes_per_token = cfg.kv_bytes_per_token(engine.runner.cache[0].dtype.itemsize)
    want = num_blocks_from_budget(32 * MIB - 8 * MIB - 4 * MIB, engine.config.block_size,
                                  bytes_per_token)
    assert engine.num_blocks == want
    [(profile_blocks, shapes)] = profiled
    max_blocks = engine.runner.buckets.max_blocks
    assert profile_blocks == 2
    assert (64, 8, max_blocks, False) in shapes and (8, 8, max_blocks, True) in shapes


def test_engine_refuses_gpu_memory_utilization_without_a_device_report():
    """On CPU (no allocator report) a utilization could only be ignored: refused, naming the
    flag that sizes the pool there."""
    from tests.engine_helpers import tiny_engine

    with pytest.raises(ConfigError, match="gpu_memory_utilization .* reports none: size it with kv_cache_memory_bytes"):
        tiny_engine(kv_cache_memory_bytes=None, gpu_memory_utilization=0.5)


def test_a_kv_cache_larger_than_the_hosts_available_memory_is_refused(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       25165824 kB\nMemFree:  1000 kB\nMemAvailable:   1048576 kB\n")  # 1 GiB
    check_fits_host_memory(1 << 30, str(meminfo))
    with pytest.raises(ConfigError, match="would take 1.0 GiB of host memory, but only 1.0 GiB is available"):
        check_fits_host_memory((1 << 30) + 1, str(meminfo))
    check_fits_host_memory(1 << 60, str(tmp_path / "absent"))  # no figure: no check
