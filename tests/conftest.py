"""Test-suite hooks."""

import gc

import pytest

from llmjax.runner import release_compiled_steps


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_steps_after_module():
    """After each test module, drop the executables it compiled: one process compiles hundreds of
    them, each holding memory mappings, and past Linux's cap on a process's mappings
    (`vm.max_map_count`) XLA aborts (the whole suite reached ~53,000 of 65,530 halfway through)."""
    yield
    release_compiled_steps()
    gc.collect()
