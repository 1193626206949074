"""The engine's command-line flags (vLLM's names) and the `EngineConfig` they build.

`add_engine_args(parser)` defines one flag per `EngineConfig` field (its `dest` is the field's
name) plus the positional model; `engine_config_from_args(args)` builds the config from every
field of the dataclass, so a field without a flag is an error here, not a silent default.
`exit_on_user_error()` turns the errors of building an engine from them that are the user's
(a bad flag, model path or file) into `error: ...` exits.
Shared by `llmjax generate | serve | cluster` and the experiments.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from typing import Iterator

from llmjax.attention.backend import BACKENDS
from llmjax.cli_types import non_empty
from llmjax.config import (BATCHING_FIELDS, DEFAULT_BATCH_SIZE, DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_MAX_DELAY,
                           DEFAULT_MAX_NUM_BATCHED_TOKENS, DTYPES, KV_CACHE_DTYPES, ConfigError, EngineConfig)

# The flags of the fields only some batching policies read (`BATCHING_FIELDS`); default None, so that
# giving one to another policy, where it would have no effect, is an error naming the flag.
POLICY_FLAGS = {"batch_size": "--batch-size", "max_delay": "--max-delay"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    parser.add_argument("model", nargs="?", type=non_empty, default=None,
                        help="'smollm2' (default, the embedded model), a preset (tiny-gqa, ...), a .gguf file "
                             "or a HF folder")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help=f"tokens per step (default: {DEFAULT_MAX_NUM_BATCHED_TOKENS}; without chunked prefill "
                             "max_model_len when that is larger, so a whole prompt fits a step, as in vLLM)")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len,
                        help="longest prompt + output in tokens (default %(default)s, capped at the model's context; "
                             "a larger value set by hand is an error)")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=d.enable_prefix_caching)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=d.enable_chunked_prefill)
    parser.add_argument("--kv-cache-memory", type=int, default=d.kv_cache_memory_bytes, dest="kv_cache_memory_bytes",
                        help="KV cache budget in bytes (default: 1 GiB on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                        help="share of what JAX's allocator may take on an accelerator (its bytes_limit) for "
                        "weights, activations and KV cache "
                        f"(default {DEFAULT_GPU_MEMORY_UTILIZATION}); instead of --kv-cache-memory; not on CPU")
    parser.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=(*KV_CACHE_DTYPES, "auto"),
                        help="KV cache dtype (default, or auto: --dtype)")
    parser.add_argument("--scheduling-policy", choices=["continuous", "static", "dynamic"], default=d.scheduling_policy)
    parser.add_argument("--queue-order", choices=["fcfs", "lpm"], default=d.queue_order)
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"static/dynamic batching: sequences per batch (a request with n samples counts n; "
                             f"one whose n is larger is refused), at most --max-num-seqs "
                             f"(default: {DEFAULT_BATCH_SIZE}, or --max-num-seqs when smaller)")
    parser.add_argument("--max-delay", type=float, default=None,
                        help=f"dynamic batching: seconds a batch waits to fill (default: {DEFAULT_MAX_DELAY})")
    parser.add_argument("--attention-backend", choices=BACKENDS, default=d.attention_backend,
                        help="default: 'cpu' (the native attention kernel) on CPU when it compiles, else 'xla' "
                             "(see docs/architecture.md, 'Choosing an implementation')")
    parser.add_argument("--dtype", default=d.dtype, choices=(*DTYPES, "auto"),
                        help="default (or auto): bfloat16 on a GPU and on a CPU with AVX512-BF16 or AMX-BF16, "
                             "float32 on other CPUs")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--generation-config", choices=("auto", "vllm"), default=d.generation_config,
                        help="auto: a model folder's generation_config.json sets the default temperature, "
                             "top_p, top_k, min_p, repetition_penalty and max_tokens (a cap) of requests that "
                             "do not set them; vllm: ignore it")
    parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=d.async_scheduling,
                        help="dispatch each step before the previous one's tokens reach the host")
    parser.add_argument("--stream-interval", type=int, default=d.stream_interval,
                        help="a streamed request gets an output every this many tokens (and its first and last)")
    parser.add_argument("--compilation-cache-dir", default=d.compilation_cache_dir,
                        help="JAX's persistent compilation cache (default: $LLMJAX_COMPILATION_CACHE, "
                             "else ~/.cache/llmjax/jax)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                        help="shard the model over this many devices (docs/parallelism.md)")
    parser.add_argument("--coordinator-address", default=d.coordinator_address,
                        help="host:port of process 0 in a multi-host run (jax.distributed; generate and the LLM "
                             "API only)")
    parser.add_argument("--num-processes", type=int, default=d.num_processes,
                        help="processes in a multi-host run (generate and the LLM API only)")
    parser.add_argument("--process-id", type=int, default=d.process_id,
                        help="this process's rank in a multi-host run (generate and the LLM API only)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """`EngineConfig` from the parsed flags: one per dataclass field (AttributeError if one is missing).
    `ConfigError` for an invalid config, and for a `POLICY_FLAGS` flag given to a policy that does not
    read it. A flag not given keeps the field's default (`--max-num-batched-tokens`: None here)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)}
    if values["max_num_batched_tokens"] is None:
        del values["max_num_batched_tokens"]
    for name, flag in POLICY_FLAGS.items():
        policies = BATCHING_FIELDS[name]
        if values[name] is not None and values["scheduling_policy"] not in policies:
            raise ConfigError(f"{flag} applies to --scheduling-policy {' or '.join(policies)} only, "
                              f"not {values['scheduling_policy']}")
    return EngineConfig(**values)


@contextlib.contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Exit with `error: MESSAGE` (status 1) when the block fails on the user's input: `ConfigError`
    (a configuration llmjax cannot serve, an attention backend not usable on this machine, a KV
    budget too small), `WeightLoadError` (weights that do not match their config) or `OSError` (a
    model path that does not exist or cannot be read). Other exceptions are bugs and propagate."""
    from llmjax.models.loader import WeightLoadError

    try:
        yield
    except (ConfigError, WeightLoadError, OSError) as exc:
        sys.exit(f"error: {exc}")
