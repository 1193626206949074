"""`llmjax cluster --replicas N [serve flags]`: N supervised replicas and the router on one machine.

Replica i is `llmjax serve` (`run_server`) with the same model, engine and serve flags on
127.0.0.1:(`--replica-base-port` + i) (default base: `--port` + 1), each in its own child process
(multiprocessing "spawn": a JAX runtime per replica). The launcher waits until every replica's
`/health` answers 200 (SystemExit if one exits or `--replica-startup-timeout` passes), then runs
the router on `--host:--port` in this process.

The router's port and every replica's are bound and released before anything starts, so a port
in use is an `error:` at once (not a replica that loads the model, fails to bind and restarts
forever while another server answers its health checks).

Supervision (`Supervisor`, a background thread): a replica process that dies (SIGKILL, or its
engine loop died: status 1) is reaped and started again after a backoff (1 s, doubling up to 30 s;
back to 1 s once a replica has stayed up for 60 s). One that exits with status 0, or is ended by
SIGINT or SIGTERM, was stopped on purpose (Ctrl-C in a terminal, and systemd's stop, signal the whole
process group) and is not restarted (`STOPPED`). The router's health checks take a replica out while it is down and bring it back once its
`/health` answers 200. When the router stops (Ctrl-C, SIGTERM) or startup fails, supervision stops
and the replicas get SIGTERM, then SIGKILL after 30 s; every child is joined, so none is left
`<defunct>`. A launcher that is killed outright (SIGKILL, the OOM killer) runs none of that: on
Linux each replica asks the kernel for SIGTERM when its launcher dies (`exit_with_parent`), so
none is left serving on its port.

GPUs: on a machine with NVIDIA GPUs, replica i gets its own `--tensor-parallel-size` of them (GPUs
i*tp .. (i+1)*tp - 1 of those `CUDA_VISIBLE_DEVICES` lists, or else of `nvidia-smi`'s), set as its
`CUDA_VISIBLE_DEVICES` before its JAX runtime starts, as SGLang's data-parallel launcher gives each
replica its own; more replicas than that fills is a usage error. With `JAX_PLATFORMS` naming no GPU
platform, or no GPU found, nothing is assigned (replicas on the CPU share its cores).

Replicas on other machines need no launcher: start `llmjax serve` there and give their URLs to
`llmjax router --workers`.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from llmjax.cli_types import UsageError
from llmjax.serve.server import bind_socket, run_server

STOP_TIMEOUT_S = 30.0
POLL_S = 0.5
BACKOFF_MIN_S, BACKOFF_MAX_S, STABLE_S = 1.0, 30.0, 60.0
# exit statuses of a replica stopped on purpose: a clean stop, or SIGINT / SIGTERM's default action
STOPPED = frozenset({0, -signal.SIGINT, -signal.SIGTERM})
PR_SET_PDEATHSIG = 1  # prctl(2)


def replica_args(args: argparse.Namespace, port: int) -> argparse.Namespace:
    """`args` as `llmjax serve` reads them, for the replica on 127.0.0.1:`port`."""
    return argparse.Namespace(**{**vars(args), "host": "127.0.0.1", "port": port, "func": None})


def exit_with_parent(parent_pid: int) -> None:
    """Linux: have this process get SIGTERM when the thread that started it exits (prctl's
    `PR_SET_PDEATHSIG`), or at once when `parent_pid` is no longer its parent (it died before the
    call). Elsewhere a no-op."""
    if not sys.platform.startswith("linux"):
        return
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def visible_gpus() -> list[str]:
    """The NVIDIA GPUs the replicas share out (ids as `CUDA_VISIBLE_DEVICES` takes them): its own
    entries when it is set, else the indices `nvidia-smi` lists; none when `JAX_PLATFORMS` names no
    GPU platform or no GPU is found."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu"} & {p.strip().lower() for p in platforms.split(",")}:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d.strip() for d in visible.split(",") if d.strip()]
        return [] if ids[:1] == ["-1"] else ids  # CUDA's "-1": no device
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):  # a driver that does not answer: no usable GPU
        return []
    return [line.strip() for line in listed.splitlines() if line.strip()]


def replica_gpus(gpus: list[str], replicas: int, tensor_parallel_size: int) -> list[str | None]:
    """Each replica's `CUDA_VISIBLE_DEVICES`: its own `tensor_parallel_size` of `gpus` in order (None
    for all when there are no GPUs). UsageError when the replicas need more GPUs than there are."""
    if not gpus:
        return [None] * replicas
    if replicas * tensor_parallel_size > len(gpus):
        raise UsageError(f"{replicas} replicas of --tensor-parallel-size {tensor_parallel_size} need "
                         f"{replicas * tensor_parallel_size} GPUs; {len(gpus)} visible ({','.join(gpus)})")
    return [",".join(gpus[i * tensor_parallel_size:(i + 1) * tensor_parallel_size]) for i in range(replicas)]


def serve_replica(args: argparse.Namespace, launcher_pid: int, gpus: str | None) -> None:
    """A replica process: `run_server` until stopped, or until the launcher dies (`exit_with_parent`);
    interrupted (Ctrl-C reaches the whole process group) while it loads or warms up, it exits with
    status 0 (stopped on purpose), without a traceback. `gpus`: its `CUDA_VISIBLE_DEVICES` (set before
    JAX starts its runtime, which reads it), None to leave it as inherited."""
    exit_with_parent(launcher_pid)
    if gpus is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus
    try:
        run_server(args)
    except KeyboardInterrupt:
        sys.exit(0)


class Replica:
    """One replica's process and restart state. Owned by the `Supervisor` (its lock guards `proc`)."""

    def __init__(self, args: argparse.Namespace, port: int, gpus: str | None = None):
        self.args, self.port, self.gpus = replica_args(args, port), port, gpus
        self.url = f"http://127.0.0.1:{port}"
        self.proc: multiprocessing.Process | None = None
        self.started_at = 0.0
        self.backoff = BACKOFF_MIN_S
        self.restart_at: float | None = None  # when a dead replica is due to start again
        self.restarts = 0

    def start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self.proc = context.Process(target=serve_replica, args=(self.args, os.getpid(), self.gpus),
                                    name=f"llmjax-replica-{self.port}")
        self.proc.start()
        self.started_at, self.restart_at = time.monotonic(), None


class Supervisor:
    """Restarts replicas that exit, with backoff, until `stop()`; `stop()` then ends them all."""

    def __init__(self, replicas: list[Replica]):
        self.replicas = replicas
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llmjax-cluster-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping.wait(POLL_S):
            with self._lock:
                if not self._stopping.is_set():
                    for replica in self.replicas:
                        self._check(replica)

    def _check(self, replica: Replica) -> None:
        now = time.monotonic()
        if replica.restart_at is None:
            if replica.proc.is_alive():  # also reaps an exited child (waitpid)
                if now - replica.started_at > STABLE_S:
                    replica.backoff = BACKOFF_MIN_S
                return
            replica.proc.join()
            if replica.proc.exitcode in STOPPED:  # stopped on purpose: stays down
                replica.restart_at = math.inf
                print(f"replica {replica.url} stopped (status {replica.proc.exitcode}); not restarted",
                      file=sys.stderr, flush=True)
                return
            replica.restart_at = now + replica.backoff
            print(f"replica {replica.url} exited with status {replica.proc.exitcode}; restarting in "
                  f"{replica.backoff:.0f} s", file=sys.stderr, flush=True)
            replica.backoff = min(2 * replica.backoff, BACKOFF_MAX_S)
        elif now >= replica.restart_at:
            replica.restarts += 1
            replica.start()
            print(f"replica {replica.url} restarted (pid {replica.proc.pid}, restart {replica.restarts})", file=sys.stderr, flush=True)

    def stop(self) -> None:
        """Stop supervising; SIGTERM every replica, SIGKILL those alive after STOP_TIMEOUT_S; join all."""
        self._stopping.set()
        with self._lock:
            procs = [r.proc for r in self.replicas if r.proc is not None]
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self._thread.is_alive():
            self._thread.join()


def replica_pids(cluster_pid: int) -> list[int]:
    """The replica processes of a running `llmjax cluster` (its "spawn" children, not its
    multiprocessing resource tracker), read from /proc (Linux); for tests and experiments that
    kill one. A zombie (an exited, unreaped child) has no command line and is not listed."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == cluster_pid and b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(int(entry))
    return sorted(pids)


def wait_healthy(replicas: list[Replica], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending = {r.url for r in replicas}
    while pending:
        for r in replicas:
            if not r.proc.is_alive():
                raise SystemExit(f"error: replica {r.url} exited with status {r.proc.exitcode} during startup")
        for url in sorted(pending):
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    pending.discard(url)
                    print(f"replica {url} is up", flush=True)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise SystemExit(f"error: replicas not healthy after {timeout:.0f} s: {sorted(pending)}")
        time.sleep(POLL_S)


def replica_ports(args: argparse.Namespace) -> range:
    """The replicas' ports: `--replicas` of them from `--replica-base-port` (default: `--port` + 1)."""
    base = args.port + 1 if args.replica_base_port is None else args.replica_base_port
    return range(base, base + args.replicas)


def check_cluster_args(args: argparse.Namespace) -> None:
    """UsageError unless every replica port is in 1..65535 and none is the router's `--port`, and the
    replicas' GPUs, if any, are enough (`replica_gpus`)."""
    ports = replica_ports(args)
    if args.replica_base_port is None and args.port == 0:
        raise UsageError("--port 0 (any free port) leaves the replicas' ports unknown: give --replica-base-port")
    if ports[0] < 1 or ports[-1] > 65535:
        raise UsageError(f"the replicas' ports {ports[0]}..{ports[-1]} (one per replica from --replica-base-port, "
                         "default --port + 1) must be in 1..65535")
    if args.port in ports:
        raise UsageError(f"--port {args.port} is also a replica's port ({ports[0]}..{ports[-1]})")
    replica_gpus(visible_gpus(), args.replicas, args.tensor_parallel_size)


def run_cluster(args: argparse.Namespace) -> None:
    """Start the replicas, wait for them, serve the router while supervising them; stop them at the end.
    The flags (`check_cluster_args`, the model path) and the ports are checked before any replica starts."""
    from llmjax.engine_args import exit_on_user_error
    from llmjax.models.loader import resolve_source
    from llmjax.serve.router import serve_router

    with exit_on_user_error():
        resolve_source(args.model)  # a bad path fails here once, not in every replica
    for host, port in [(args.host, args.port), *(("127.0.0.1", p) for p in replica_ports(args))]:
        bind_socket(host, port).close()  # SystemExit `error: cannot listen on ...` for a port in use
    replicas = [Replica(args, port, gpus) for port, gpus in
                zip(replica_ports(args), replica_gpus(visible_gpus(), args.replicas, args.tensor_parallel_size))]
    supervisor = Supervisor(replicas)
    # SIGTERM unwinds to `finally` (uvicorn re-raises the signal it caught after its shutdown).
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        for replica in replicas:
            replica.start()
        wait_healthy(replicas, args.replica_startup_timeout)
        supervisor.start()
        serve_router([r.url for r in replicas], args)
    finally:
        supervisor.stop()
        signal.signal(signal.SIGTERM, previous)
