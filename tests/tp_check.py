"""Tensor-parallel engine runs for `tests/test_tensor_parallel.py`, in a process of its own.

JAX fixes its CPU device count when it starts, so the test runs this script with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`: `python tests/tp_check.py PRESET TP...`.
It prints one JSON object: per tensor-parallel size, how the greedy outputs compare with a dense
no-cache reference (computed on one device), the shardings of the weights and cache, the
collectives in the compiled step, and the compilations of a second identical run.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tests.engine_helpers import GREEDY, assert_greedy_matches, dense_greedy, run_to_completion, tiny_engine  # noqa: E402

RNG = np.random.default_rng(7)
SHARED = RNG.integers(3, 250, size=16).tolist()
# decodes, a prefix-cache hit, and a prompt longer than one step's token budget (chunked prefill)
PROMPTS = [SHARED + [5], SHARED + RNG.integers(3, 250, size=9).tolist(), RNG.integers(3, 250, size=70).tolist(),
           RNG.integers(3, 250, size=2).tolist()]
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")


def mismatch(outputs, reference) -> str | None:
    """None when every output equals the dense reference up to float near-ties, else the reason."""
    try:
        for out, (tokens, logits) in zip(outputs, reference):
            assert_greedy_matches(out.outputs[0].token_ids, tokens, logits)
    except AssertionError as exc:
        return str(exc)
    return None


def spec(array: jax.Array) -> str:
    return str(getattr(array.sharding, "spec", "one device"))


def check(preset: str, tp: int, reference) -> dict:
    engine = tiny_engine(preset, tensor_parallel_size=tp)
    runner = engine.runner
    first = run_to_completion(engine, PROMPTS)
    compiles = runner.num_compiles
    donated = runner.cache[0]
    assert engine.kv.reset_prefix_cache()  # so the rerun has the same shapes
    second = run_to_completion(engine, PROMPTS)
    hlo = runner.lower(64, 4, 8).compile().as_text()
    return dict(
        devices=jax.device_count(),
        tokens=[o.outputs[0].token_ids for o in first],
        mismatch=mismatch(first, reference),
        second_run_equal=[o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first],
        second_run_compiles=runner.num_compiles - compiles,
        cache_donated=donated.is_deleted(),
        params={"/".join(path): spec(v.get_value()) for path, v in nnx.to_flat_state(runner.params)},
        cache=[spec(c) for c in runner.cache],
        cache_shard_shape=list(runner.cache[0].addressable_shards[0].data.shape),
        collectives={c: len(re.findall(rf"\b{c}(-start)?\(", hlo)) for c in COLLECTIVES},
    )


def main() -> None:
    preset, sizes = sys.argv[1], [int(n) for n in sys.argv[2:]]
    reference = [dense_greedy(tiny_engine(preset), p, GREEDY.max_tokens) for p in PROMPTS]
    print(json.dumps({tp: check(preset, tp, reference) for tp in sizes}))


if __name__ == "__main__":
    main()
