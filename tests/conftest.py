"""Test-suite hooks."""

import gc
import secrets

import numpy as np
import pytest

from llmjax.cli import main
from llmjax.runner import release_compiled_steps


@pytest.fixture
def rng():
    """Fresh random inputs each run; the seed is printed so a failure can be replayed."""
    seed = secrets.randbits(32)
    print(f"test seed: {seed}")
    return np.random.default_rng(seed)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_steps_after_module():
    """After each test module, drop the executables it compiled: one process compiles hundreds of
    them, each holding memory mappings, and past Linux's cap on a process's mappings
    (`vm.max_map_count`) XLA aborts (the whole suite reached ~53,000 of 65,530 halfway through)."""
    yield
    release_compiled_steps()
    gc.collect()


@pytest.fixture
def cli_error(capsys):
    """`cli_error(*argv)`: the error line `llmjax ARGV` ends with, and its exit status (the command
    must exit: `SystemExit`)."""

    def run(*argv: str) -> tuple[str, int]:
        with pytest.raises(SystemExit) as exit_info:
            main(list(argv))
        code = exit_info.value.code
        if isinstance(code, str):  # sys.exit("error: ..."): Python prints it, status 1
            return code, 1
        lines = capsys.readouterr().err.strip().splitlines()
        return lines[-1] if lines else "", code

    return run
