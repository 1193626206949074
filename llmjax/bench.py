"""`llmjax bench`: load an OpenAI-compatible server and report latencies, like `vllm bench serve`.

Workloads (`--dataset`):
- `random`: input and output lengths uniform in `len * [1 - r, 1 + r]` (`--random-input-len`,
  `--random-output-len`, `--random-range-ratio r`), random token ids.
- `sharegpt`: lengths synthesised to ShareGPT's published means (input 161, output 338 tokens) by
  `llmjax.workloads` (log-normal, prompts capped at 1024 tokens, prompt + output at the model
  length). No dataset is read.
- `prefix`: `--prefix-groups G` groups; a request is its group's shared system prompt
  (`--prefix-len` tokens) plus a random suffix of `--random-input-len` tokens.
- `multiturn`: `--num-prompts` conversations of `--turns` turns; each turn resends the whole
  history (earlier prompts and the model's replies, as text) plus a new user message. A
  conversation stops at a failed turn or at a turn that would no longer fit the model; the turns
  it did not send are reported (`unsent_turns`). A new message's default length is 256 tokens, so
  the default 4 turns fit a 2048-token model.

Arrivals: a Poisson process at `--request-rate` (inf: all at once), and at most
`--max-concurrency` requests in flight. Every request is a streamed `/v1/completions` call
with `ignore_eos`, so output lengths are as drawn, each on a connection of its own;
prompts are token-id lists, or text (`--prompt-format text`, the ids rendered by the server's
`/detokenize`, cut until the server's `/tokenize` counts at most the tokens drawn). A request's
lengths are cut to fit `max_model_len` (its output to at most half of it); the run says how many
were (`capped_requests`).

Reports TTFT, TPOT (per output token after the first), ITL (between streamed chunks) and
end-to-end latency (mean, p50, p90, p99, in ms), request and token throughput over the run (the
first request sent to the last one finished), streamed chunks (SSE events) per request (fewer than
its tokens with `--stream-interval` above 1), and goodput (requests per second meeting every
`--goodput` SLO, e.g. `--goodput ttft:500 tpot:50`). Token counts are the server's (its usage chunk;
a stream without one fails), not the text re-tokenized. A request's end is the end of its stream
(`data: [DONE]`, or the body's end); vLLM's client ends its latency at the last chunk with a choice, and
llmjax's server sends the usage chunk and `[DONE]` right after that one, with no engine step between.
A request fails alone (its error listed) when its stream breaks or is malformed, or when it takes
more than `--request-timeout` seconds (vLLM's 6 h by default). Prints a table (and the distinct
errors of failed requests); `--result-file` writes the same as JSON, with the run's settings and
`llmjax.provenance` (an infinite request rate as "inf", as vLLM writes it).
`BenchError` when the server cannot be used (unreachable, no model card with a `max_model_len` at
`/v1/models`, a `/detokenize` or `/tokenize` that gives no answer); the command line then exits with `error: ...`, as it
does when every request failed. `--api-key` (default `$OPENAI_API_KEY`) is sent with every request.

The streams go through aiohttp, whose C parsers spend about a third of the CPU per SSE event that
httpx does: on a machine the client shares with the server, a costlier client would take CPU from
the server and understate its throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

import aiohttp
import httpx
import numpy as np
from tqdm import tqdm

from llmjax.cli_types import (UsageError, fraction, non_empty, non_negative_int, positive_int,
                              positive_number, positive_seconds, server_url)
from llmjax.provenance import provenance
from llmjax.sampling_params import SamplingParams, SamplingParamsError
from llmjax.workloads import SHAREGPT, lognormal_lengths

SLO_NAMES = ("ttft", "tpot", "e2el")
VLLM_REQUEST_TIMEOUT = 6 * 3600.0  # seconds: `vllm bench serve`'s limit on one request
RANDOM_LENGTHS = ("random", "prefix", "multiturn")  # the datasets whose lengths --random-*-len draw
# The flags only some datasets read: name -> (flag, default, those datasets). Their parser default is
# None, so that one given with another dataset, where it would have no effect, is an error naming it.
DATASET_FLAGS = {
    "random_input_len": ("--random-input-len", 1024, RANDOM_LENGTHS),
    "random_output_len": ("--random-output-len", 128, RANDOM_LENGTHS),
    "random_range_ratio": ("--random-range-ratio", 0.0, RANDOM_LENGTHS),
    "prefix_groups": ("--prefix-groups", 4, ("prefix",)),
    "prefix_len": ("--prefix-len", 512, ("prefix",)),
    "turns": ("--turns", 4, ("multiturn",)),
    "prompt_format": ("--prompt-format", "ids", ("random", "sharegpt", "prefix")),  # multiturn sends text
}
# A dataset's own defaults: a multiturn turn's new message is shorter, so that a conversation's
# default 4 turns (each with its 128-token reply) fit a 2048-token model
DATASET_DEFAULTS = {"multiturn": {"random_input_len": 256}}


def with_dataset_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of `args` whose `DATASET_FLAGS` not given take their (dataset's) defaults."""
    own = DATASET_DEFAULTS.get(args.dataset, {})
    return argparse.Namespace(**{**vars(args), **{name: own.get(name, default)
                                                  for name, (_, default, _) in DATASET_FLAGS.items()
                                                  if getattr(args, name) is None}})


class BenchError(Exception):
    """The benchmark cannot run against this server; the message says why."""


@dataclass
class RequestResult:
    """One streamed request as the client saw it (seconds, from the client's monotonic clock)."""

    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    last_event: float | None = None  # when the last chunk with a choice arrived
    events: int = 0  # the stream's JSON events (`add_event` calls), the usage chunk included

    usage_seen: bool = False

    def add_event(self, chunk: dict, start: float) -> None:
        """Fold in one SSE event, a parsed completion chunk received now (`start`: when the request
        was sent): the first chunk with a choice gives the TTFT, each later one an ITL (one per
        chunk, as vLLM's client times them; the text is the first choice's, as the benchmark asks
        for one); the usage chunk gives the token counts.
        Raises KeyError / TypeError for a chunk not shaped like a completion chunk."""
        now = time.perf_counter()
        self.events += 1
        choices = chunk.get("choices")
        if choices:
            if self.last_event is None:
                self.ttft = now - start
            else:
                self.itl.append(now - self.last_event)
            self.last_event = now
            self.text += choices[0].get("text") or ""
        if chunk.get("usage"):
            self.prompt_tokens = int(chunk["usage"]["prompt_tokens"])
            self.output_tokens = int(chunk["usage"]["completion_tokens"])
            self.usage_seen = True

    @property
    def tpot(self) -> float:
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def error_text(error) -> str:
    """What a stream's error event says: its `message`, else the whole error as JSON."""
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return json.dumps(error)


async def stream_completion(session: aiohttp.ClientSession, payload: dict) -> RequestResult:
    """POST a streamed `/v1/completions` request (usage included) through `session` (its base URL
    is the server's) and time its chunks up to `data: [DONE]`. A stream that breaks, carries an
    error event or an event that is not a completion chunk, or ends without output or usage, fails
    this request alone (`error` says why)."""
    payload = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    result, start = RequestResult(), time.perf_counter()
    try:
        async with session.post("/v1/completions", json=payload) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {(await response.text())[:200]}"
                return result
            async for line in response.content:  # the body's lines, each ending in a newline
                if line.startswith(b"data: [DONE]"):
                    break
                if not line.startswith(b"data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = error_text(chunk["error"])
                    return result
                result.add_event(chunk, start)
    except aiohttp.ClientError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # JSON or a chunk of another shape
        result.error = f"malformed stream event ({type(exc).__name__}: {exc})"
        return result
    except TimeoutError:  # the session's limit on a whole request (a read timeout is a ClientError above)
        result.error = "timed out: the request took longer than its timeout"
        return result
    except Exception as exc:  # anything else (a line over the read limit): this request only
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.ok = result.last_event is not None and result.usage_seen
    result.error = "" if result.ok else "no output" if result.last_event is None else "no usage in the stream"
    return result


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The header a server started with `--api-key` asks for (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def stream_session(base_url: str, read_timeout: float | None = None, api_key: str | None = None,
                   request_timeout: float | None = None) -> aiohttp.ClientSession:
    """A session for `stream_completion`: no limit on connections, a connection per request (reusing
    one the server is about to close as idle, uvicorn's 5 s keep-alive, fails the request, which a
    client that lags behind its 256 streams runs into after a wave of requests that finish in the
    same step). A request that takes longer than `request_timeout` seconds in all, or waits longer
    than `read_timeout` for its next bytes, fails (None: no limit). Lines up to 2 MiB (twice the
    1 MiB read buffer: a chunk with logprobs or an echoed prompt); a longer one fails its request.
    With `api_key`, every request carries it."""
    timeout = aiohttp.ClientTimeout(total=request_timeout, sock_read=read_timeout)
    return aiohttp.ClientSession(base_url, timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                 read_bufsize=1 << 20, headers=auth_headers(api_key))


def percentiles(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean, p50, p90, p99 of `values` times `scale` (seconds to ms by default); zeros if empty."""
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * scale
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


# --- workloads ---------------------------------------------------------------------------------------
Job = Callable[[Callable[[dict], Awaitable[RequestResult]]], Awaitable[None]]


class Workload:
    """Builds the list of jobs (one request, or one conversation) from the arguments."""

    def __init__(self, args: argparse.Namespace, max_model_len: int, to_text: Callable[[list[int]], str]):
        self.args = with_dataset_defaults(args)
        self.max_len = max_model_len
        self.rng = np.random.default_rng(args.seed)
        self.to_text = to_text  # `text_prompter`'s
        self.unsent_turns = 0  # multiturn: turns of conversations that stopped early
        self.capped = 0  # requests whose drawn lengths were cut to fit max_model_len

    def _ids(self, n: int) -> list[int]:
        lo, hi = self.args.token_range
        return self.rng.integers(lo, hi, n).tolist()

    def _uniform(self, mean: int) -> int:
        r = self.args.random_range_ratio
        return int(self.rng.integers(max(1, math.floor(mean * (1 - r))), math.ceil(mean * (1 + r)) + 1))

    def _fit(self, n_in: int, n_out: int) -> tuple[int, int]:
        """A request's drawn lengths cut to fit `max_model_len`; called once per request (it counts
        the requests cut)."""
        fit_out = max(1, min(n_out, self.max_len // 2))
        fit_in = max(1, min(n_in, self.max_len - fit_out))
        self.capped += (fit_in, fit_out) != (n_in, n_out)
        return fit_in, fit_out

    def _prompt(self, ids: list[int]) -> list[int] | str:
        return self.to_text(ids) if self.args.prompt_format == "text" else ids

    def _drawn_lengths(self, n: int) -> list[tuple[int, int]]:
        """(input, output) lengths of n requests as drawn, before `_fit`."""
        if self.args.dataset == "sharegpt":
            inputs = lognormal_lengths(self.rng, n, SHAREGPT.mean_prompt, SHAREGPT.sigma_prompt,
                                       min(1024, self.max_len - 1))
            # the caps `_fit` applies, so that the solved mean is the mean sent (`_fit` cuts none of these)
            output_caps = np.minimum(self.max_len // 2, self.max_len - inputs)
            outputs = lognormal_lengths(self.rng, n, SHAREGPT.mean_output, SHAREGPT.sigma_output, output_caps)
            return [(int(i), int(o)) for i, o in zip(inputs, outputs)]
        return [(self._uniform(self.args.random_input_len), self._uniform(self.args.random_output_len))
                for _ in range(n)]

    def jobs(self) -> tuple[list[Job], int]:
        """The jobs, and how many requests they make in all (for the progress bar)."""
        a = self.args
        if a.dataset == "multiturn":
            return [self._conversation() for _ in range(a.num_prompts)], a.num_prompts * a.turns
        prefixes = [self._ids(a.prefix_len) for _ in range(a.prefix_groups)]
        jobs = []
        for i, (n_in, n_out) in enumerate(self._drawn_lengths(a.num_prompts)):
            head = prefixes[i % a.prefix_groups] if a.dataset == "prefix" else []
            n_in, n_out = self._fit(len(head) + n_in, n_out)
            ids = (head + self._ids(n_in))[:n_in]
            jobs.append(self._single(self._prompt(ids), n_out))
        return jobs, a.num_prompts

    def _payload(self, prompt: list[int] | str, n_out: int) -> dict:
        return {"model": self.args.model, "prompt": prompt, "max_tokens": n_out, "ignore_eos": True,
                "temperature": self.args.temperature}

    def _single(self, prompt, n_out: int) -> Job:
        async def job(send):
            await send(self._payload(prompt, n_out))
        return job

    def _conversation(self) -> Job:
        turns = [self._fit(n_in, n_out) for n_in, n_out in self._drawn_lengths(self.args.turns)]
        users = [self.to_text(self._ids(n_in)) for n_in, _ in turns]

        async def job(send):
            history, used = "", 0
            for sent, (user, (n_in, n_out)) in enumerate(zip(users, turns)):
                if used + n_in + n_out > self.max_len:  # the conversation no longer fits the model
                    self.unsent_turns += len(turns) - sent
                    return
                prompt = f"{history}{user}"
                result = await send(self._payload(prompt, n_out))
                if not result.ok:
                    self.unsent_turns += len(turns) - sent - 1
                    return
                history, used = prompt + result.text, result.prompt_tokens + result.output_tokens
        return job


# --- running --------------------------------------------------------------------------------------------
async def run_jobs(session: aiohttp.ClientSession, jobs: list[Job], total: int, request_rate: float,
                   max_concurrency: int | None, seed: int) -> tuple[list[RequestResult], float]:
    """Start jobs at Poisson arrivals; returns every request's result and the wall time. Arrival k is due
    at the start plus the first k gaps (a late wake-up of the busy event loop delays that arrival, not
    every later one), so the rate sent is the rate asked for."""
    results: list[RequestResult] = []
    limit = asyncio.Semaphore(max_concurrency or 1 << 30)
    rng = np.random.default_rng(seed + 1)
    bar = tqdm(total=total, desc="requests", unit="req")

    async def send(payload: dict) -> RequestResult:
        async with limit:
            result = await stream_completion(session, payload)
        results.append(result)
        bar.update(1)
        return result

    start = time.perf_counter()
    due = start
    tasks = []
    for i, job in enumerate(jobs):
        if i and math.isfinite(request_rate):  # the gap before each arrival after the first
            due += rng.exponential(1.0 / request_rate)
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.create_task(job(send)))
    await asyncio.gather(*tasks)
    bar.close()
    return results, time.perf_counter() - start


def summarize(results: list[RequestResult], duration: float, slos: dict[str, float]) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)

    def good(r: RequestResult) -> bool:
        values = {"ttft": r.ttft, "tpot": r.tpot, "e2el": r.latency}
        return all(values[name] * 1000 <= limit for name, limit in slos.items())

    summary = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": percentiles([r.ttft for r in ok]),
        "tpot_ms": percentiles([r.tpot for r in ok if r.output_tokens > 1]),
        "itl_ms": percentiles([x for r in ok for x in r.itl]),
        "e2el_ms": percentiles([r.latency for r in ok]),
        "stream_events_per_request": sum(len(r.itl) + 1 for r in ok) / len(ok) if ok else 0.0,
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }
    if slos:
        summary["goodput_slos_ms"] = slos
        summary["request_goodput"] = sum(map(good, ok)) / duration
    return summary


def format_table(summary: dict) -> str:
    lines = [f"{'Successful requests:':<36}{summary['completed']:>12}",
             f"{'Failed requests:':<36}{summary['failed']:>12}",
             f"{'Benchmark duration (s):':<36}{summary['duration_s']:>12.2f}",
             f"{'Total input tokens:':<36}{summary['total_input_tokens']:>12}",
             f"{'Total generated tokens:':<36}{summary['total_output_tokens']:>12}",
             f"{'Request throughput (req/s):':<36}{summary['request_throughput']:>12.2f}",
             f"{'Output token throughput (tok/s):':<36}{summary['output_throughput']:>12.2f}",
             f"{'Total token throughput (tok/s):':<36}{summary['total_token_throughput']:>12.2f}"]
    lines.append(f"{'Stream events per request:':<36}{summary['stream_events_per_request']:>12.2f}")
    if "unsent_turns" in summary:
        lines.append(f"{'Turns not sent (stopped early):':<36}{summary['unsent_turns']:>12}")
    if "request_goodput" in summary:
        lines.append(f"{'Request goodput (req/s):':<36}{summary['request_goodput']:>12.2f}")
    lines.append(f"{'(ms)':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E")):
        s = summary[key]
        lines.append(f"{label:<10}{s['mean']:>10.2f}{s['p50']:>10.2f}{s['p90']:>10.2f}{s['p99']:>10.2f}")
    lines += [f"failed: {error}" for error in summary["errors"]]
    return "\n".join(lines)


def parse_slo(item: str) -> tuple[str, float]:
    """`NAME:MS` (NAME in SLO_NAMES, MS a number of milliseconds > 0) -> (NAME, MS); the type of
    `--goodput`'s items (argparse.ArgumentTypeError otherwise)."""
    name, _, value = item.partition(":")
    try:
        ms = float(value)
    except ValueError:
        ms = math.nan
    if name not in SLO_NAMES or not 0 < ms < math.inf:
        raise argparse.ArgumentTypeError(f"expected NAME:MS with NAME in {SLO_NAMES} and MS > 0, got {item!r}")
    return name, ms


async def model_card(session: aiohttp.ClientSession, base_url: str) -> dict:
    """The first model card of the server's `/v1/models`; BenchError when there is none to read."""
    try:
        async with session.get("/v1/models") as response:
            if response.status != 200:
                text = (await response.text())[:200]
                raise BenchError(f"GET {base_url}/v1/models answered {response.status}: {text}")
            body = await response.json(content_type=None)
    except aiohttp.ClientConnectionError as exc:
        raise BenchError(f"cannot connect to {base_url}: {exc}") from None
    except ValueError:  # not JSON
        raise BenchError(f"GET {base_url}/v1/models did not answer JSON: is it an OpenAI-compatible server?") from None
    try:
        return body["data"][0]
    except (KeyError, IndexError, TypeError):
        raise BenchError(f"GET {base_url}/v1/models lists no model: {str(body)[:200]}") from None


def text_prompter(base_url: str, api_key: str | None) -> Callable[[list[int]], str]:
    """`to_text(ids)`: a text prompt of at most len(ids) tokens as the server counts them. The ids' text
    (the server's `/detokenize`) re-tokenizes differently (the server adds its BOS, BPE merges across
    the ids' boundaries), so ids are dropped from the end until the server's `/tokenize` count fits,
    as vLLM's benchmark re-encodes and truncates. BenchError when either endpoint gives no answer."""
    def post(path: str, body: dict, key: str):
        try:
            response = httpx.post(f"{base_url}{path}", json=body, headers=auth_headers(api_key))
            if response.status_code == 200:
                return response.json()[key]
            problem = f"answered {response.status_code}: {response.text[:200]}"
        except httpx.HTTPError as exc:
            problem = f"failed: {exc}"
        except (ValueError, KeyError, TypeError):
            problem = f"answered no {key}: {response.text[:200]}"
        raise BenchError(f"POST {base_url}{path} {problem}")

    def to_text(ids: list[int]) -> str:
        budget = len(ids)
        while True:
            text = post("/detokenize", {"tokens": ids}, "prompt")
            excess = len(post("/tokenize", {"prompt": text}, "tokens")) - budget
            if excess <= 0 or len(ids) <= 1:
                return text
            ids = ids[: max(1, len(ids) - excess)]
    return to_text


async def _bench(args: argparse.Namespace) -> dict:
    slos = dict(args.goodput)
    async with stream_session(args.base_url, api_key=args.api_key, request_timeout=args.request_timeout) as session:
        card = await model_card(session, args.base_url)
        args.model = args.model or card["id"]
        max_model_len = card.get("max_model_len")
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise BenchError(f"the model card of {args.base_url}/v1/models gives no max_model_len (vLLM's and "
                             f"llmjax's do): {str(card)[:200]}")
        # called while the jobs are built, before any request runs
        workload = Workload(args, max_model_len, text_prompter(args.base_url, args.api_key))
        jobs, total = workload.jobs()
        if workload.capped:
            print(f"note: {workload.capped} requests' drawn lengths were cut to fit max_model_len {max_model_len} "
                  "(the output to at most half of it)", file=sys.stderr, flush=True)
        results, duration = await run_jobs(session, jobs, total, args.request_rate, args.max_concurrency, args.seed)
    summary = summarize(results, duration, slos)
    summary["capped_requests"] = workload.capped
    if args.dataset == "multiturn":
        summary["unsent_turns"] = workload.unsent_turns
    summary["settings"] = settings(workload.args)
    return summary


def settings(args: argparse.Namespace) -> dict:
    """The run's settings as the result file records them (the API key left out)."""
    names = ("base_url", "model", "dataset", "num_prompts", *DATASET_FLAGS, "token_range", "temperature",
             "request_rate", "max_concurrency", "request_timeout", "seed")
    return {name: getattr(args, name) for name in names} | {"goodput": dict(args.goodput)}


def _json_number(value):
    """`json.dump`'s `default` is not asked about floats: infinity goes out as "inf" (vLLM's result
    files write an infinite request rate so) by this walk instead of as JSON's invalid `Infinity`."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_number(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_number(v) for v in value]
    return value


def run_bench(args: argparse.Namespace) -> dict:
    """Run the benchmark of the flags (`add_bench_args`), print the table, write `--result-file`;
    the summary. BenchError when the server cannot be used."""
    summary = asyncio.run(_bench(args))
    print(format_table(summary))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(_json_number({**summary, "provenance": provenance()}), f, indent=2, allow_nan=False)
    return summary


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", type=server_url, default="http://127.0.0.1:8000",
                        help="the server's root URL (default: %(default)s)")
    parser.add_argument("--model", type=non_empty, default=None, help="served model name (default: the server's first)")
    parser.add_argument("--api-key", type=non_empty, default=os.environ.get("OPENAI_API_KEY") or None,
                        help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY, else none)")
    parser.add_argument("--dataset", choices=["random", "sharegpt", "prefix", "multiturn"], default="random")
    parser.add_argument("--num-prompts", type=positive_int, default=100,
                        help="requests, or conversations for multiturn")

    def dataset_flag(name: str, text: str, **kwargs) -> None:
        flag, default, datasets = DATASET_FLAGS[name]
        own = "".join(f", {d}: {v[name]}" for d, v in DATASET_DEFAULTS.items() if name in v)
        parser.add_argument(flag, default=None, help=f"{text} (default {default}{own}; {', '.join(datasets)} only)",
                            **kwargs)

    dataset_flag("random_input_len", "mean prompt length (prefix: after the shared prefix)", type=positive_int)
    dataset_flag("random_output_len", "mean output length", type=positive_int)
    dataset_flag("random_range_ratio", "lengths are uniform in len * [1 - r, 1 + r], r in [0, 1]", type=fraction)
    dataset_flag("prefix_groups", "groups of requests sharing a prefix", type=positive_int)
    dataset_flag("prefix_len", "tokens of each group's shared prefix", type=non_negative_int)
    dataset_flag("turns", "turns per conversation", type=positive_int)
    dataset_flag("prompt_format", "prompts as token ids or as text", choices=["ids", "text"])
    parser.add_argument("--token-range", type=non_negative_int, nargs=2, default=[3, 98], metavar=("LO", "HI"),
                        help="random prompt token ids are drawn from [LO, HI)")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--request-rate", type=positive_number, default=math.inf,
                        help="Poisson arrivals per second (default: inf, every request at once)")
    parser.add_argument("--max-concurrency", type=positive_int, default=None)
    parser.add_argument("--goodput", type=parse_slo, nargs="+", default=[], metavar="SLO:MS",
                        help="e.g. ttft:500 tpot:50 e2el:5000")
    parser.add_argument("--request-timeout", type=positive_seconds, default=VLLM_REQUEST_TIMEOUT,
                        help="seconds one request may take in all before it fails (default %(default)g, vLLM's)")
    parser.add_argument("--result-file", type=non_empty, default=None,
                        help="write the summary, the settings and where the run came from as JSON")
    parser.add_argument("--seed", type=non_negative_int, default=0)


def check_bench_args(args: argparse.Namespace) -> None:
    """UsageError for a dataset's flag given with another dataset (`DATASET_FLAGS`: it would have no
    effect), a `--temperature` the server would refuse (the engine's own check), an empty
    `--token-range`, an SLO given twice, or a `--result-file` that could not be written (checked
    before the run, not after it)."""
    for name, (flag, _, datasets) in DATASET_FLAGS.items():
        if getattr(args, name) is not None and args.dataset not in datasets:
            raise UsageError(f"{flag} has no effect with --dataset {args.dataset}: it applies to "
                             f"{', '.join(datasets)}")
    try:
        SamplingParams(temperature=args.temperature)
    except SamplingParamsError as exc:
        raise UsageError(f"--temperature {args.temperature:g}: {exc}") from None
    lo, hi = args.token_range
    if lo >= hi:
        raise UsageError(f"--token-range {lo} {hi}: LO must be below HI (ids are drawn from [LO, HI))")
    names = [name for name, _ in args.goodput]
    if len(set(names)) < len(names):
        raise UsageError(f"--goodput gives an SLO twice: {' '.join(f'{n}:{ms:g}' for n, ms in args.goodput)}")
    if args.result_file:
        path = os.path.abspath(args.result_file)
        folder = os.path.dirname(path)
        if os.path.isdir(path):
            raise UsageError(f"--result-file {args.result_file} is a folder")
        if not os.path.isdir(folder):
            raise UsageError(f"--result-file {args.result_file}: no folder {folder}")
        if not os.access(path if os.path.exists(path) else folder, os.W_OK):
            raise UsageError(f"--result-file {args.result_file}: not writable")
