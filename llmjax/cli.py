"""`llmjax` command line: `generate`, `serve`, `bench`, `router`, `cluster`.

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
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                        help="shard the model over this many devices (docs/parallelism.md)")
    parser.add_argument("--coordinator-address", default=None,
                        help="host:port of process 0 in a multi-host run (jax.distributed)")
    parser.add_argument("--num-processes", type=int, default=None, help="processes in a multi-host run")
    parser.add_argument("--process-id", type=int, default=None, help="this process's rank in a multi-host run")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
        block_size=args.block_size, max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching, enable_chunked_prefill=args.enable_chunked_prefill,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, scheduling_policy=args.scheduling_policy,
        queue_order=args.queue_order, batch_size=args.batch_size, max_delay=args.max_delay,
        attention_backend=args.attention_backend, dtype=args.dtype, seed=args.seed,
        tensor_parallel_size=args.tensor_parallel_size, coordinator_address=args.coordinator_address,
        num_processes=args.num_processes, process_id=args.process_id,
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


def cmd_serve(args: argparse.Namespace) -> None:
    import uvicorn

    from llmjax.engine import LLMEngine
    from llmjax.models.loader import resolve_source
    from llmjax.serve.api import build_app

    name = args.served_model_name or resolve_source(args.model).name
    engine = LLMEngine.from_config(args.model, engine_config_from_args(args), seed=args.seed)
    if args.warmup:
        engine.warmup()
    app = build_app(engine, name)
    print(f"serving {name!r} at http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)


def cmd_bench(args: argparse.Namespace) -> None:
    from llmjax.bench import run_bench

    run_bench(args)


def cmd_router(args: argparse.Namespace) -> None:
    from llmjax.serve.router import serve_router

    urls = [u for u in args.workers.split(",") if u]
    if not urls:
        sys.exit("error: --workers needs at least one URL")
    serve_router(urls, args)


def cmd_cluster(args: argparse.Namespace) -> None:
    from llmjax.serve.cluster import run_cluster

    run_cluster(args)


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

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the name clients send (default: the model's)")
    serve.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                       help="compile the common step shapes before accepting requests")
    serve.add_argument("--uvicorn-log-level", default="info",
                       choices=["critical", "error", "warning", "info", "debug", "trace"])
    serve.set_defaults(func=cmd_serve)

    from llmjax.bench import add_bench_args

    bench = sub.add_parser("bench", help="benchmark a running server (like `vllm bench serve`)")
    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench)

    from llmjax.serve.routing import add_router_args

    router = sub.add_parser("router", help="route requests over several `llmjax serve` replicas")
    router.add_argument("--workers", required=True, help="comma-separated replica URLs: http://h1:8000,http://h2:8000")
    router.add_argument("--host", default="127.0.0.1")
    router.add_argument("--port", type=int, default=8000)
    router.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_router_args(router)
    router.set_defaults(func=cmd_router)

    cluster = sub.add_parser("cluster", help="N `llmjax serve` replicas and the router on this machine")
    add_engine_args(cluster)
    cluster.add_argument("--replicas", type=int, required=True)
    cluster.add_argument("--host", default="127.0.0.1", help="the router's address")
    cluster.add_argument("--port", type=int, default=8000, help="the router's port")
    cluster.add_argument("--replica-base-port", type=int, default=None,
                         help="replica i listens on 127.0.0.1:(this + i) (default: --port + 1)")
    cluster.add_argument("--replica-startup-timeout", type=float, default=900.0, help="seconds")
    cluster.add_argument("--served-model-name", default=None, help="the name clients send (default: the model's)")
    cluster.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                         help="replicas compile the common step shapes before accepting requests")
    cluster.add_argument("--uvicorn-log-level", default="info",
                         choices=["critical", "error", "warning", "info", "debug", "trace"])
    add_router_args(cluster)
    cluster.set_defaults(func=cmd_cluster)

    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
