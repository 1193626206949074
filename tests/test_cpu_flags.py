"""llmjax.cpu_flags: only flags the installed jaxlib knows reach XLA_FLAGS, the user's win."""

from llmjax import cpu_flags


def test_known_flags_are_added_unknown_skipped_user_setting_kept(monkeypatch):
    monkeypatch.setattr(cpu_flags, "_backend_started", lambda: False)
    monkeypatch.delenv("LLMJAX_NO_CPU_FLAGS", raising=False)
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
    added = cpu_flags.apply_cpu_flags({"xla_cpu_use_onednn": "false", "xla_cpu_no_such_flag_for_tests": "1",
                                       "xla_cpu_enable_fast_math": "true"})
    assert added == ["--xla_cpu_use_onednn=false"]
    import os
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false --xla_cpu_use_onednn=false"


def test_nothing_once_the_backend_runs(monkeypatch):
    import jax.numpy as jnp

    jnp.zeros(1).block_until_ready()
    monkeypatch.setenv("XLA_FLAGS", "")
    assert cpu_flags.apply_cpu_flags({"xla_cpu_use_onednn": "false"}) is None
    assert cpu_flags.known_flag("xla_cpu_use_onednn") and not cpu_flags.known_flag("xla_cpu_no_such_flag_for_tests")
