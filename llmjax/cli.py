"""`llmjax` command line: `generate`, `serve`, `bench`, `router`, `cluster`.

Engine flags follow vLLM's names (`--max-num-batched-tokens`, `--max-num-seqs`, `--block-size`,
`--max-model-len`, `--enable-prefix-caching/--no-enable-prefix-caching`, ...).

Bad input ends the command with `error: MESSAGE` and a non-zero status, never a traceback: a flag
argparse refuses on its own (`llmjax/cli_types.py`) or with the others (each subcommand's `checks`,
before anything starts: status 2), or a model, file or setting found unusable while the engine is
built (status 1).
"""

from __future__ import annotations

import argparse
import sys

from llmjax import cli_types
from llmjax.cli_types import UsageError
from llmjax.config import ConfigError, EngineConfig
from llmjax.engine_args import add_engine_args, engine_config_from_args, exit_on_user_error
from llmjax.serve.server import add_address_args, add_http_args, add_serve_args


def check_engine_args(args: argparse.Namespace) -> None:
    """UsageError unless the engine flags make a valid `EngineConfig`."""
    try:
        engine_config_from_args(args)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def check_generate_args(args: argparse.Namespace) -> None:
    """UsageError for an engine flag that would have no effect on one whole answer: the stream
    interval (nothing is streamed), the queue order and the batching policy (one request never
    queues behind another, and its batch is itself)."""
    default = EngineConfig()
    if args.scheduling_policy != default.scheduling_policy:
        raise UsageError("--scheduling-policy has no effect on generate: its one request is its whole batch")
    if args.stream_interval != default.stream_interval:
        raise UsageError("--stream-interval has no effect on generate: its answer is not streamed")
    if args.queue_order != default.queue_order:
        raise UsageError("--queue-order has no effect on generate: its one request never waits behind another")


def check_single_host(args: argparse.Namespace) -> None:
    """UsageError for the multi-host flags on a server: only the host that receives a request would run
    its steps, and the others' engines wait for them forever (docs/parallelism.md)."""
    default = EngineConfig()
    if args.coordinator_address != default.coordinator_address or args.num_processes != default.num_processes:
        raise UsageError("--coordinator-address and --num-processes are for generate and the LLM API: a server "
                         "runs on one host (run one tensor-parallel engine per host behind the router)")


def check_server_policy(args: argparse.Namespace) -> None:
    """UsageError for static batching on a server (see `async_engine.STATIC_ON_SERVER`)."""
    from llmjax.serve.async_engine import STATIC_ON_SERVER

    if args.scheduling_policy == "static":
        raise UsageError(STATIC_ON_SERVER)


GENERATE_DEFAULTS = {"temperature": 0.0, "max_tokens": 128}  # greedy, unless the model or a flag says otherwise


def sampling_params_from_args(args: argparse.Namespace, model_defaults: dict | None = None):
    """`llmjax generate`'s `SamplingParams`: its flags over the model's generation-config defaults
    (`LLMEngine.generation_defaults`) over `GENERATE_DEFAULTS`. UsageError naming the flag for an
    invalid value, and for `--top-p` under greedy decoding, where it could have no effect."""
    from llmjax.sampling_params import SamplingParams, SamplingParamsError

    flags = {name: getattr(args, name) for name in ("temperature", "top_p", "max_tokens")
             if getattr(args, name) is not None}
    try:
        params = SamplingParams(**{**GENERATE_DEFAULTS, **(model_defaults or {}), **flags})
    except SamplingParamsError as exc:
        flag = f"--{exc.param.replace('_', '-')}: " if exc.param else ""
        raise UsageError(f"{flag}{exc}") from None
    # before the model is loaded (`model_defaults` None), only a greedy --temperature given with it
    if "top_p" in flags and params.greedy and (model_defaults is not None or "temperature" in flags):
        raise UsageError("--top-p has no effect at temperature 0 (greedy decoding takes the likeliest token): "
                         "give --temperature above 0")
    return params


def cmd_generate(args: argparse.Namespace) -> None:
    from llmjax.llm import LLM

    with exit_on_user_error():
        llm = LLM(args.model, seed=args.seed, engine_config=engine_config_from_args(args))
    try:
        params = sampling_params_from_args(args, llm.engine.generation_defaults)
    except UsageError as exc:
        sys.exit(f"error: {exc}")
    try:
        if args.raw:
            [out] = llm.generate(args.prompt, params)
        else:
            [out] = llm.chat([{"role": "user", "content": args.prompt}], params)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    if out.error:  # the engine failed it (its log says why)
        sys.exit(f"error: {out.error}")
    print(out.outputs[0].text)


def cmd_serve(args: argparse.Namespace) -> None:
    from llmjax.serve.server import run_server

    run_server(args)


def cmd_bench(args: argparse.Namespace) -> None:
    from llmjax.bench import BenchError, run_bench

    try:
        summary = run_bench(args)
    except BenchError as exc:
        sys.exit(f"error: {exc}")
    if not summary["completed"]:
        sys.exit(f"error: all {summary['failed']} requests failed")


def cmd_router(args: argparse.Namespace) -> None:
    from llmjax.serve.router import serve_router

    serve_router(args.workers, args)


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
    gen.add_argument("--max-tokens", type=int, default=None,
                     help="default: the model's generation config's max_new_tokens, else "
                          f"{GENERATE_DEFAULTS['max_tokens']}")
    gen.add_argument("--temperature", type=float, default=None,
                     help="default: the model's generation config's, else 0 (greedy)")
    gen.add_argument("--top-p", type=float, default=None, help="default: the model's generation config's, else 1")
    gen.set_defaults(func=cmd_generate, checks=(check_engine_args, check_generate_args, sampling_params_from_args))

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    add_engine_args(serve)
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve, checks=(check_engine_args, check_single_host, check_server_policy))

    from llmjax.bench import add_bench_args, check_bench_args

    bench = sub.add_parser("bench", help="benchmark a running server (like `vllm bench serve`)")
    add_bench_args(bench)
    bench.set_defaults(func=cmd_bench, checks=(check_bench_args,))

    from llmjax.serve.routing import add_router_args, check_router_args

    router = sub.add_parser("router", help="route requests over several `llmjax serve` replicas")
    router.add_argument("--workers", type=cli_types.server_urls, required=True,
                        help="comma-separated replica URLs: http://h1:8000,http://h2:8000")
    add_address_args(router, "the router's")
    add_http_args(router)
    add_router_args(router)
    router.set_defaults(func=cmd_router, checks=(check_router_args,))

    from llmjax.serve.cluster import check_cluster_args

    cluster = sub.add_parser("cluster", help="N `llmjax serve` replicas and the router on this machine")
    add_engine_args(cluster)
    cluster.add_argument("--replicas", type=cli_types.positive_int, required=True)
    add_address_args(cluster, "the router's")
    cluster.add_argument("--replica-base-port", type=cli_types.port, default=None,
                         help="replica i listens on 127.0.0.1:(this + i) (default: --port + 1)")
    cluster.add_argument("--replica-startup-timeout", type=cli_types.positive_seconds, default=900.0,
                         help="seconds every replica has to answer /health with 200 (default: %(default)s)")
    add_serve_args(cluster, address=False)  # the replicas' flags
    add_router_args(cluster)
    cluster.set_defaults(func=cmd_cluster, checks=(check_engine_args, check_single_host, check_server_policy,
                                                   check_router_args, check_cluster_args))

    args = parser.parse_args(argv)
    try:
        for check in args.checks:
            check(args)
    except UsageError as exc:
        sub.choices[args.command].error(str(exc))
    try:
        args.func(args)
    except KeyboardInterrupt:  # Ctrl-C outside a server's own shutdown (loading, warm-up, a benchmark)
        sys.exit(130)


if __name__ == "__main__":
    main()
