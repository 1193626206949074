"""`llmjax cluster --replicas N [serve flags]`: N replicas and the router on one machine.

Replica i is `llmjax serve` with the same model, engine and serve flags on
127.0.0.1:(`--replica-base-port` + i) (default base: `--port` + 1), each in its own child process
(multiprocessing "spawn": a JAX runtime per replica). The launcher waits until every replica's
`/health` answers 200 (SystemExit if one exits or `--replica-startup-timeout` passes), then runs
the router on `--host:--port` in this process. When the router stops (Ctrl-C, SIGTERM) or startup
fails, the replicas get SIGTERM, then SIGKILL after 30 s.

Replicas on other machines need no launcher: start `llmjax serve` there and give their URLs to
`llmjax router --workers`.
"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
import sys
import time

import httpx

STOP_TIMEOUT_S = 30.0


def replica_args(args: argparse.Namespace, port: int) -> argparse.Namespace:
    """`args` as `llmjax serve` reads them, for the replica on 127.0.0.1:`port`."""
    return argparse.Namespace(**{**vars(args), "host": "127.0.0.1", "port": port, "func": None})


def wait_healthy(urls: list[str], procs: list[multiprocessing.Process], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = set(urls)
    while pending:
        for url, proc in zip(urls, procs):
            if not proc.is_alive():
                raise SystemExit(f"replica {url} exited with status {proc.exitcode} during startup")
        for url in sorted(pending):
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    pending.discard(url)
                    print(f"replica {url} is up", flush=True)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise SystemExit(f"replicas not healthy after {timeout:.0f} s: {sorted(pending)}")
        time.sleep(0.5)


def stop(procs: list[multiprocessing.Process]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join()


def run_cluster(args: argparse.Namespace) -> None:
    """Start the replicas, wait for them, serve the router; stop the replicas at the end."""
    from llmjax.cli import cmd_serve
    from llmjax.serve.router import serve_router

    if args.replicas < 1:
        raise SystemExit("--replicas must be at least 1")
    base = args.replica_base_port or args.port + 1
    ports = [base + i for i in range(args.replicas)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    context = multiprocessing.get_context("spawn")
    procs = [context.Process(target=cmd_serve, args=(replica_args(args, p),), name=f"llmjax-replica-{p}")
             for p in ports]
    # SIGTERM unwinds to `finally` (uvicorn re-raises the signal it caught after its shutdown).
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        for proc in procs:
            proc.start()
        wait_healthy(urls, procs, args.replica_startup_timeout)
        serve_router(urls, args)
    finally:
        stop(procs)
        signal.signal(signal.SIGTERM, previous)
