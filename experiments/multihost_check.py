"""Multi-host tensor parallelism on one machine: N processes on 127.0.0.1 play N hosts.

Each worker process gets its own CPU devices (`--devices-per-process`), joins the run through
`jax.distributed` (a coordinator on 127.0.0.1), and serves the same greedy requests with
`tensor_parallel_size` = all devices of all processes. The launcher then computes the same requests
in one process on one device and checks that every worker produced the same tokens.

    python experiments/multihost_check.py                  # 2 processes x 2 CPU devices, tiny-gqa and tiny-mla
    python experiments/multihost_check.py --processes 2 --devices-per-process 1 --preset tiny-mla

Exit status 0 when all outputs agree.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], list(range(10, 43)), [200, 100, 50, 25, 12, 6, 3, 1, 9, 81, 64]]
MAX_TOKENS = 12


def generate(preset: str, **engine_args) -> list[list[int]]:
    """Greedy continuations of PROMPTS on a tiny engine."""
    from llmjax.config import EngineConfig
    from llmjax.engine import LLMEngine
    from llmjax.outputs import OutputAccumulator
    from llmjax.sampling_params import SamplingParams

    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=8, max_model_len=128,
                          kv_cache_memory_bytes=2 << 20, attention_backend="xla", **engine_args)
    engine = LLMEngine.from_config(preset, config, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = OutputAccumulator()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            done.add(delta)
    return [done.outputs[i].outputs[0].token_ids for i in ids]


def worker(args: argparse.Namespace) -> None:
    """One "host": joins the run, generates, prints one JSON line per preset."""
    import jax

    for preset in args.preset:
        tp = args.processes * args.devices_per_process
        tokens = generate(preset, tensor_parallel_size=tp, coordinator_address=args.coordinator,
                          num_processes=args.processes, process_id=args.process_id)
        print(json.dumps(dict(preset=preset, process=jax.process_index(), processes=jax.process_count(),
                              devices=jax.device_count(), local_devices=jax.local_device_count(),
                              tokens=tokens)), flush=True)


def launch(args: argparse.Namespace) -> int:
    from common import free_port  # experiments/common.py

    coordinator = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices_per_process}",
               JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    common = [sys.executable, __file__, "--worker", "--coordinator", coordinator, "--processes", str(args.processes),
              "--devices-per-process", str(args.devices_per_process)] + [f"--preset={p}" for p in args.preset]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(common + ["--process-id", str(i)], env=env, stdout=subprocess.PIPE, text=True)
             for i in range(args.processes)]
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=args.timeout)
        if proc.returncode:
            print(f"worker failed with exit status {proc.returncode}")
            return 1
        results += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    print(f"{args.processes} processes x {args.devices_per_process} CPU devices: {time.perf_counter() - t0:.1f} s")

    sys.path.insert(0, str(ROOT))
    ok = True
    for preset in args.preset:
        expected = generate(preset)
        for r in (r for r in results if r["preset"] == preset):
            same = r["tokens"] == expected
            ok &= same
            print(f"{preset}: process {r['process']}/{r['processes']} ({r['local_devices']} of {r['devices']} devices, "
                  f"tensor_parallel_size {r['devices']}): {'same tokens as one device' if same else 'DIFFERENT tokens'}")
            if not same:
                print(f"  got      {r['tokens']}\n  expected {expected}")
    return 0 if ok else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=2)
    parser.add_argument("--preset", action="append", help="tiny model preset (repeatable; default tiny-gqa, tiny-mla)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--process-id", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.preset = args.preset or ["tiny-gqa", "tiny-mla"]
    if args.worker:
        worker(args)
    else:
        sys.exit(launch(args))


if __name__ == "__main__":
    main()
