"""`AsyncEngine`: one thread owns the `LLMEngine`; asyncio code talks to it through queues.

Threads and ownership:
- The loop thread (`start`) is the only code that touches the engine. It runs commands from a
  thread-safe command queue between steps, steps while any request is unfinished, and when idle
  blocks on the command queue (no spinning).
- Handlers on the asyncio event loop submit commands (`call`, `abort`) and read their requests'
  outputs from an `OutputStream`, which the loop thread fills through `loop.call_soon_threadsafe`,
  once per event loop per step for all of that step's outputs. A stream merges a request's new
  delta into its output still waiting to be read, so a consumer that falls behind reads one output
  per request with every new token.
- `stats` is an immutable snapshot the loop thread replaces after every step and when idle;
  any thread may read it (the Prometheus collector does).
- `on_finished(output)` runs on the loop thread for each finished request (metrics observe it).
- Heartbeat: the loop thread records when the step in progress started (`step_started`, None
  between steps). `health()` reads it and the thread's state from any thread without waiting
  for the loop, so it answers at once even during a long step.

A command that raises fails only its caller (an exception other than `RequestError` and
`SamplingParamsError` also counts in `EngineStats.num_engine_errors`, as does each request the
engine finished with an `error`). If the loop itself raises
(a step that the engine could not contain), the engine is dead: every open stream receives the
exception, later commands fail with `EngineDeadError`, `health()` reports it, and `on_dead()`
runs once on the loop thread (the server uses it to exit, so a supervisor restarts it).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from llmjax.config import ConfigError
from llmjax.engine import LLMEngine, RequestError, RequestOutput
from llmjax.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError

log = logging.getLogger(__name__)


def _put_all(batch: list[tuple[OutputStream, RequestOutput]]) -> None:
    """On an event loop: put each output into its stream, in order."""
    for stream, output in batch:
        stream.put(output)

STALL_WAIT_S = 0.01  # when a step scheduled nothing (a dynamic batch not yet formed)
STEP_TIMEOUT_S = 600.0  # a step running longer than this makes `health()` fail (a hung device)


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an error; no request can be served."""


class ShuttingDownError(EngineDeadError):
    """The server is shutting down: a request that came too late, or a non-streamed one cut short
    (a 503, which a router re-sends elsewhere, not a 200 with partial text)."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's gauges and counters (prefix-cache counts are in tokens)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # blocks held by requests / usable blocks
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_engine_errors: int = 0  # requests the engine failed (admission or step exceptions), a dead loop
    num_serving_compiles: int = 0  # step functions compiled outside warm-up (each stalled the engine)
    serving_compile_seconds: float = 0.0  # the time the steps that compiled them took


# Static batching waits for a full batch unless told no more requests come, which a server never
# knows: its last requests would wait forever.
STATIC_ON_SERVER = ("static batching waits for a full batch, so a server's last requests would wait forever: "
                    "use --scheduling-policy dynamic (static with a --max-delay deadline)")


@dataclass(frozen=True)
class _Command:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop | None = None  # with `future`: where to deliver the result
    future: asyncio.Future | None = None


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting handler was cancelled
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_finished: Callable[[RequestOutput], None] | None = None,
                 step_timeout_s: float = STEP_TIMEOUT_S):
        if engine.config.scheduling_policy == "static":
            raise ConfigError(STATIC_ON_SERVER)
        self.engine = engine
        self.on_finished = on_finished
        self.on_dead: Callable[[], None] | None = None
        self.step_timeout_s = step_timeout_s
        self.stats = EngineStats()
        self.error: BaseException | None = None  # set when the loop died
        self.stopping = False  # set by `abort_all`: no new request is taken
        self.step_started: float | None = None  # monotonic start of the step in progress (heartbeat)
        self.num_engine_errors = 0  # loop thread only
        self._commands: queue.Queue[_Command | None] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputStream]] = {}  # loop thread only
        self._thread = threading.Thread(target=self._run, name="llmjax-engine-loop", daemon=True)

    # --- lifecycle (any thread) -------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the loop thread after the commands already queued; unfinished requests are dropped."""
        self._commands.put(None)
        self._thread.join(timeout)

    # --- commands (event loop side) -------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the loop thread between steps; return its result or raise its exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(_Command(lambda: fn(self.engine), loop, future))
        return await future

    async def add(self, prompts: Mapping[str, str | Sequence[int]], params: SamplingParams,
                  namespace: str | None, arrival_time: float, stream: OutputStream) -> None:
        """Queue requests (request id -> prompt) whose outputs go to `stream`, all in one command (one
        wait for the loop thread, however many prompts). Raises `RequestError` when the engine
        refuses one; then none of them stays queued."""
        loop = asyncio.get_running_loop()

        def add(engine: LLMEngine) -> None:
            if self.stopping:
                raise ShuttingDownError("the server is shutting down")
            engine.add_requests([(prompt, params, request_id, namespace) for request_id, prompt in prompts.items()],
                                arrival_time)
            for request_id in prompts:
                self._streams[request_id] = (loop, stream)

        await self.call(add)

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if unknown or finished); its blocks are freed before the next step.
        Safe from any thread; does not wait."""
        self._commands.put(_Command(lambda: self._abort(request_id)))

    def abort_all(self) -> None:
        """Abort every request with a stream (a server shutting down whose grace period is ending), so
        each stream ends with its final output, and take no new request (`stopping`: `add` raises
        `ShuttingDownError`). Safe from any thread; does not wait."""
        self.stopping = True
        self._commands.put(_Command(lambda: [self._abort(request_id) for request_id in list(self._streams)]))

    def open_stream(self) -> OutputStream:
        return OutputStream(self)

    def health(self) -> str | None:
        """None when the loop is alive and no step has run past `step_timeout_s`; otherwise why not.
        Reads the heartbeat only: never waits for the loop thread."""
        if self.error is not None:
            return f"engine loop died: {self.error!r}"
        if not self._thread.is_alive():
            return "engine loop is not running"
        started = self.step_started
        if started is not None and time.monotonic() - started > self.step_timeout_s:
            return f"engine step running for {time.monotonic() - started:.0f} s (limit {self.step_timeout_s:.0f} s)"
        return None

    async def check_kv_invariants(self) -> str | None:
        """None when the KV invariants hold; otherwise the violation. Scans the pool on the loop
        thread between steps (a debug check: its cost grows with the pool)."""
        try:
            await self.call(lambda engine: engine.check_kv_invariants())
        except AssertionError as exc:
            return f"KV invariant violated: {exc}" if str(exc) else "KV invariant violated"
        return None

    # --- the loop thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            stalled = False
            while self._serve_commands(stalled):
                stalled = self.engine.has_unfinished_requests() and not self._step()
        except Exception as exc:  # a bug the engine could not contain: fail everything that waits on it
            log.exception("engine loop failed")
            self._die(exc)

    def _serve_commands(self, stalled: bool) -> bool:
        """Run pending commands. When idle: publish stats, then block for a command; after a step
        that made no progress (`_step`: it neither scheduled work nor completed the step in flight,
        as when a dynamic batch has not formed yet), wait up to STALL_WAIT_S for one instead of
        spinning. Returns False on shutdown."""
        if not self.engine.has_unfinished_requests():
            self._publish()
            wait = None
        else:
            wait = STALL_WAIT_S if stalled else 0
        try:
            command = self._commands.get(timeout=wait) if wait != 0 else self._commands.get_nowait()
            while self._execute(command):
                command = self._commands.get_nowait()
            return False
        except queue.Empty:
            return True

    def _execute(self, command: _Command | None) -> bool:
        """Run one command, delivering its result or exception to its future. False on shutdown."""
        if command is None:
            return False
        result, error = None, None
        try:
            if self.error is not None:
                raise EngineDeadError("the engine loop stopped after an error") from self.error
            result = command.fn()
        except Exception as exc:
            error = exc
            if not isinstance(exc, (RequestError, SamplingParamsError, EngineDeadError)):
                log.error("engine command failed", exc_info=exc)
                self.num_engine_errors += 1
        if command.future is not None:
            command.loop.call_soon_threadsafe(_resolve, command.future, result, error)
        elif error is not None:
            log.error("engine command failed: %r", error)
        return True

    def _step(self) -> bool:
        """One engine step; deliver its outputs. True when it made progress: it scheduled work, or
        it completed the step left in flight (asynchronous scheduling), whose finished requests
        free rows and blocks that waiting requests may take at once."""
        steps, completing = self.engine.num_steps, self.engine.has_step_in_flight
        self.step_started = time.monotonic()
        outputs = self.engine.step()
        self.step_started = None
        self._deliver(outputs)
        self._publish()
        return completing or self.engine.num_steps > steps

    def _abort(self, request_id: str) -> None:
        output = self.engine.abort(request_id)
        if output is not None:
            self._deliver([output])

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        """Hand outputs to their streams, waking each event loop once for all of them (a wake-up
        costs the loop thread about 3 us: with hundreds of streams, one each would be a large part
        of a step's host time)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputStream, RequestOutput]]] = {}
        for output in outputs:
            loop, stream = self._streams[output.request_id]
            batches.setdefault(loop, []).append((stream, output))
            if output.finished:
                del self._streams[output.request_id]
                if output.error is not None:  # the engine failed it (a step's exception)
                    self.num_engine_errors += 1
                if self.on_finished is not None:
                    self.on_finished(output)
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _publish(self) -> None:
        engine = self.engine
        usage, prefix = engine.kv.usage(), engine.kv.stats()
        self.stats = EngineStats(
            num_running=len(engine.scheduler.running), num_waiting=engine.num_waiting,
            kv_usage=usage.usage,
            prefix_queried_tokens=prefix.queried_tokens, prefix_hit_tokens=prefix.hit_tokens,
            num_preemptions=engine.scheduler.num_preemptions, prompt_tokens=engine.num_prompt_tokens,
            generation_tokens=engine.num_generation_tokens, num_engine_errors=self.num_engine_errors,
            num_serving_compiles=engine.runner.num_serving_compiles,
            serving_compile_seconds=engine.runner.serving_compile_seconds,
        )

    def _die(self, error: BaseException) -> None:
        self.error = error
        self.num_engine_errors += 1
        # nothing runs or waits any more, and no KV is held for anyone
        self.stats = dataclasses.replace(self.stats, num_engine_errors=self.num_engine_errors, num_running=0,
                                         num_waiting=0, kv_usage=0.0)
        for loop, stream in self._streams.values():
            loop.call_soon_threadsafe(stream.put, error)
        self._streams.clear()
        if self.on_dead is not None:
            self.on_dead()
        while (command := self._commands.get()) is not None:  # answer later commands until shutdown
            self._execute(command)


class OutputStream:
    """The outputs of one HTTP request's engine requests (one per prompt), for one consumer task.

    Contract: `add` the request's prompts (request id -> prompt) in one call, iterate until every
    request finished, and call `abort()` in a
    `finally` (a no-op for finished requests), so a client that leaves frees its blocks at once.
    Event-loop side only.

    Merging (as vLLM's output collector does): an output for a request whose last output is still
    waiting to be read is folded into that one (`RequestOutput.add`: text and tokens appended,
    logprobs extended, finish state taken from the new one). A consumer that falls behind (a slow
    client, an event loop busy with hundreds of streams) thus reads one output per request with
    every token since its last read, not a backlog of one-token outputs that each cost it an SSE
    event. An output with an `error` is never merged. The outputs a stream is given are its own
    (the engine does not touch a delta once made), so merging mutates the waiting one in place.
    `RequestOutputKind.CUMULATIVE` outputs hold everything so far: a new one replaces the waiting one.
    """

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.unfinished: set[str] = set()
        self._queue: collections.deque[RequestOutput | BaseException] = collections.deque()
        self._waiting: dict[str, RequestOutput] = {}  # request id -> its output in `_queue`
        self._ready = asyncio.Event()
        self._cumulative = False  # the requests' outputs are CUMULATIVE (set by `add`)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Queue an output (merged into the request's waiting one, see above) or an exception (raised
        to the consumer when it reaches it)."""
        if isinstance(item, RequestOutput):
            waiting = self._waiting.get(item.request_id)
            if waiting is not None and item.error is None:
                if self._cumulative:
                    for f in dataclasses.fields(item):
                        setattr(waiting, f.name, getattr(item, f.name))
                else:
                    waiting.add(item)
                return
            self._waiting[item.request_id] = item
        self._queue.append(item)
        self._ready.set()

    async def add(self, prompts: Mapping[str, str | Sequence[int]], params: SamplingParams,
                  namespace: str | None = None, arrival_time: float | None = None) -> None:
        """Queue requests (request id -> prompt); raises `RequestError` (none queued) when the engine
        refuses one."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self._cumulative = params.output_kind is RequestOutputKind.CUMULATIVE
        self.unfinished.update(prompts)  # before awaiting, so a cancelled add is still aborted
        try:
            await self.engine.add(prompts, params, namespace, arrival, self)
        except Exception:
            self.unfinished.difference_update(prompts)
            raise

    async def __aiter__(self):
        """Yield outputs in arrival order (a merged output where its first delta arrived) until every
        added request has finished."""
        while self.unfinished:
            while not self._queue:
                self._ready.clear()
                await self._ready.wait()
            output = self._queue.popleft()
            if isinstance(output, BaseException):
                raise output
            if self._waiting.get(output.request_id) is output:
                del self._waiting[output.request_id]
            if output.finished:
                self.unfinished.discard(output.request_id)
            yield output

    def abort(self) -> None:
        for request_id in self.unfinished:
            self.engine.abort(request_id)
        self.unfinished.clear()
