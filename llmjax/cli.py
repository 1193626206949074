"""`llmjax` command line: `generate`, `serve`, `bench`, `router`.

Engine flags follow vLLM's names (`--max-num-batched-tokens`, `--max-num-seqs`, `--block-size`,
`--max-model-len`, `--enable-prefix-caching/--no-enable-prefix-caching`, ...).
"""

from __future__ import annotations

import argparse
import sys

from llmjax.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    parser.add_argument("model", nargs="?", default=None,
                        help="'smollm2' (default, the embedded model), a preset (tiny-gqa, ...), a .gguf file or a HF folder")
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching)
    parser.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                        default=d.enable_chunked_prefill)
    parser.add_argument("--kv-cache-memory", type=int, default=None, dest="kv_cache_memory_bytes",
                        help="KV cache budget in bytes (default: 1 GiB on CPU)")
    parser.add_argument("--scheduling-policy", choices=["continuous", "static", "dynamic"], default=d.scheduling_policy)
    parser.add_argument("--queue-order", choices=["fcfs", "lpm"], default=d.queue_order)
    parser.add_argument("--batch-size", type=int, default=d.batch_size, help="static/dynamic batch size")
    parser.add_argument("--max-delay", type=float, default=d.max_delay, help="dynamic batching timeout (s)")
    parser.add_argument("--attention-backend", choices=["xla", "pallas", "pallas-interpret"], default=None)
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (GPU default)")
    parser.add_argument("--seed", type=int, default=0)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        block_size=args.block_size, max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, scheduling_policy=args.scheduling_policy,
        queue_order=args.queue_order, batch_size=args.batch_size, max_delay=args.max_delay,
        attention_backend=args.attention_backend, dtype=args.dtype, seed=args.seed,
    )


def cmd_generate(args: argparse.Namespace) -> None:
    from llmjax.llm import LLM
    from llmjax.sampling_params import SamplingParams

    llm = LLM(args.model, seed=args.seed, engine_config=engine_config_from_args(args))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, top_p=args.top_p)
    prompt = args.prompt if args.raw else [{"role": "user", "content": args.prompt}]
    try:
        [out] = llm.generate([prompt], params)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    print(out.text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="llmjax", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer one prompt (chat template applied unless --raw)")
    add_engine_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.set_defaults(func=cmd_generate)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
