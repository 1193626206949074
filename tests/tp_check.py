"""Tensor-parallel engine runs for `tests/test_tensor_parallel.py`, in a process of its own.

JAX fixes its CPU device count when it starts, so the test runs this script with
`XLA_FLAGS=--xla_force_host_platform_device_count=4`: `python tests/tp_check.py PRESET TP...`.
It prints one JSON object: per tensor-parallel size, how the greedy outputs compare with a dense
no-cache reference (computed on one device), the shardings of the weights and cache, the
collectives in the compiled step, the compilations of a second identical run, and (GQA) the Pallas
fresh-prefill attention run per device.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dataclasses  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from tests.engine_helpers import (GREEDY, assert_greedy_matches, dense_greedy, dense_logits,  # noqa: E402
                                  run_to_completion, tiny_engine)

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


def prompt_logprob_error(engine, reference: np.ndarray) -> float:
    """Largest difference of the prompt logprobs of `PROMPTS[2]` (over several chunks) from the
    one-device dense `reference` log-softmax."""
    prompt = PROMPTS[2]
    [out] = run_to_completion(engine, [prompt], dataclasses.replace(GREEDY, prompt_logprobs=2))
    entries = out.prompt_logprobs
    assert len(entries) == len(prompt), len(entries)
    return max(abs(e.logprob - reference[t - 1, i]) for t in range(1, len(prompt)) for i, e in entries[t].items())


def collectives(hlo: str) -> dict[str, int]:
    return {c: len(re.findall(rf"\b{c}(-start)?\(", hlo)) for c in COLLECTIVES}


def flash_prefill_check(tp: int) -> dict:
    """The Pallas backend's fresh-prefill attention (interpret mode) under `parallel.sharded_attention`,
    on query and KV heads split over `tp` devices: the collectives of the compiled call (per device,
    none) and its largest difference from the unsharded call."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from llmjax import parallel
    from llmjax.attention.backend import get_attention_backend
    from pallas_kernels import prefill_segment_starts

    mesh = parallel.make_mesh(tp)
    backend = get_attention_backend("pallas-interpret")
    sharded = parallel.sharded_attention(backend, mesh).prefill
    q, k, v = (jax.numpy.asarray(RNG.standard_normal((32, h, 32)), np.float32) for h in (8, 4, 4))
    plan = prefill_segment_starts(jax.numpy.asarray([0, 10, 32], np.int32), 32)
    heads = NamedSharding(mesh, P(None, parallel.TP, None))
    call = jax.jit(lambda q, k, v, plan: sharded.attend(q, k, v, plan, sm_scale=0.125),
                   in_shardings=(heads, heads, heads, NamedSharding(mesh, P())), out_shardings=heads)
    error = np.abs(call(q, k, v, plan) - backend.prefill.attend(q, k, v, plan, sm_scale=0.125)).max()
    return dict(collectives=collectives(call.lower(q, k, v, plan).compile().as_text()), error=float(error))


def check(preset: str, tp: int, reference, prompt_reference) -> dict:
    engine = tiny_engine(preset, tensor_parallel_size=tp)
    runner = engine.runner
    first = run_to_completion(engine, PROMPTS)
    compiles = runner.num_compiles
    donated = runner.cache[0]
    assert engine.kv.reset_prefix_cache()  # so the rerun has the same shapes
    second = run_to_completion(engine, PROMPTS)
    recompiles = runner.num_compiles - compiles
    error = prompt_logprob_error(engine, prompt_reference)  # compiles the prompt variants
    hlo = runner.lower(64, 4, 8).compile().as_text()
    return dict(
        devices=jax.device_count(),
        tokens=[o.outputs[0].token_ids for o in first],
        mismatch=mismatch(first, reference),
        second_run_equal=[o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first],
        second_run_compiles=recompiles,
        cache_donated=donated.is_deleted(),
        params={"/".join(path): spec(v.get_value()) for path, v in nnx.to_flat_state(runner.params)},
        cache=[spec(c) for c in runner.cache],
        cache_shard_shape=list(runner.cache[0].addressable_shards[0].data.shape),
        collectives=collectives(hlo),
        prompt_logprob_error=float(error),
        flash_prefill=flash_prefill_check(tp) if tp > 1 and engine.model_config.attention != "mla" else None,
    )


def main() -> None:
    preset, sizes = sys.argv[1], [int(n) for n in sys.argv[2:]]
    one = tiny_engine(preset)
    reference = [dense_greedy(one, p, GREEDY.max_tokens) for p in PROMPTS]
    prompt_reference = np.asarray(jax.nn.log_softmax(dense_logits(one, PROMPTS[2]), axis=-1))
    print(json.dumps({tp: check(preset, tp, reference, prompt_reference) for tp in sizes}))


if __name__ == "__main__":
    main()
