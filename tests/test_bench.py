"""`llmjax bench` end to end against a real server on a tiny random model: each dataset sends what
its arguments ask for (counts and lengths follow from them), and failed requests are counted and
shown with their errors. Bad flags, a server it cannot use and a run where every request failed
end the command with `error: ...`."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import socket

import httpx
import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from llmjax import bench as bench_module
from llmjax.bench import RequestResult, add_bench_args, error_text, run_bench, run_jobs
from llmjax.cli import main
from llmjax.serve.api import build_app
from llmjax.serve.metrics import parse_metrics
from tests.engine_helpers import tiny_engine
from tests.server_helpers import running_server

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def base_url():
    engine = tiny_engine(max_num_seqs=8, kv_cache_memory_bytes=4 << 20, max_model_len=MAX_MODEL_LEN)
    with running_server(build_app(engine, "tiny")) as url:
        yield url


def bench(base_url: str, *argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return run_bench(parser.parse_args(["--base-url", base_url, *argv]))


def server_counters(base_url: str) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{base_url}/metrics", timeout=30).text)


def test_random_dataset_sends_the_lengths_it_was_given(base_url):
    before = server_counters(base_url)
    summary = bench(base_url, "--num-prompts", "6", "--random-input-len", "9", "--random-output-len", "5",
                    "--max-concurrency", "3", "--seed", "1")
    after = server_counters(base_url)
    assert (summary["completed"], summary["failed"], summary["errors"]) == (6, 0, [])
    assert summary["total_input_tokens"] == 6 * 9
    assert summary["total_output_tokens"] == 6 * 5
    generated = after["llmjax:generation_tokens_total"] - before["llmjax:generation_tokens_total"]
    assert generated == 6 * 5
    ttft, e2el, tpot = summary["ttft_ms"], summary["e2el_ms"], summary["tpot_ms"]
    assert 0 < ttft["p50"] <= e2el["p50"] and tpot["p50"] > 0
    assert summary["itl_ms"]["p50"] > 0
    assert 1 <= summary["stream_events_per_request"] <= 5  # a token an event, or fewer when deltas merge


def test_prefix_dataset_shares_each_groups_prompt_head(base_url):
    # One request at a time: every request after its group's first finds the group's prefix (4
    # blocks of 8 tokens) in the prefix cache.
    before = server_counters(base_url)
    summary = bench(base_url, "--dataset", "prefix", "--num-prompts", "6", "--prefix-groups", "2",
                    "--prefix-len", "32", "--random-input-len", "8", "--random-output-len", "2",
                    "--max-concurrency", "1", "--seed", "2")
    after = server_counters(base_url)
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert summary["total_input_tokens"] == 6 * (32 + 8)
    hits = after["llmjax:prefix_cache_hits_total"] - before["llmjax:prefix_cache_hits_total"]
    assert hits >= (6 - 2) * 32


def test_multiturn_dataset_runs_every_turn_on_text_prompts(base_url):
    summary = bench(base_url, "--dataset", "multiturn", "--num-prompts", "2", "--turns", "3",
                    "--random-input-len", "6", "--random-output-len", "3", "--seed", "3")
    assert (summary["completed"], summary["failed"], summary["unsent_turns"]) == (2 * 3, 0, 0)
    assert summary["total_output_tokens"] == 2 * 3 * 3


def test_multiturn_conversations_that_stop_early_report_their_unsent_turns(base_url, capsys):
    """Turns of 40 tokens and replies of 10 outgrow the 128-token model within a few turns: every
    turn of every conversation is sent, failed, or reported unsent."""
    summary = bench(base_url, "--dataset", "multiturn", "--num-prompts", "2", "--turns", "6",
                    "--random-input-len", "40", "--random-output-len", "10", "--seed", "3")
    assert 0 < summary["unsent_turns"] < 2 * 6
    assert summary["completed"] + summary["failed"] + summary["unsent_turns"] == 2 * 6
    [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("Turns not sent")]
    assert line.split()[-1] == str(summary["unsent_turns"])


def test_failed_requests_are_counted_and_their_errors_shown(base_url, capsys):
    summary = bench(base_url, "--model", "no-such-model", "--num-prompts", "3", "--random-input-len", "4",
                    "--random-output-len", "2")
    assert (summary["completed"], summary["failed"]) == (0, 3)
    assert len(summary["errors"]) == 1 and summary["errors"][0].startswith("HTTP 404")
    assert f"failed: {summary['errors'][0]}" in capsys.readouterr().out


def test_goodput_counts_the_requests_within_every_slo():
    """vLLM's goodput: completed requests per second whose TTFT, TPOT and end-to-end latency all stay
    within the given limits (ms); failed requests count in neither."""
    from llmjax.bench import RequestResult, parse_slo, summarize

    def result(ttft_ms: float, e2e_ms: float, tokens: int, ok: bool = True) -> RequestResult:
        return RequestResult(ok=ok, prompt_tokens=4, output_tokens=tokens, ttft=ttft_ms / 1e3, latency=e2e_ms / 1e3)

    results = [
        result(100, 1000, 10),   # TPOT (1000 - 100) / 9 = 100 ms
        result(300, 1200, 10),   # TTFT 300 ms
        result(100, 2000, 10),   # TPOT 211 ms, E2E 2000 ms
        result(50, 50, 1),       # one token: no TPOT
        result(10, 20, 3, ok=False),
    ]
    slos = dict(map(parse_slo, ["ttft:200", "tpot:150"]))
    summary = summarize(results, duration=2.0, slos=slos)
    assert summary["completed"] == 4 and summary["failed"] == 1
    assert summary["request_goodput"] == 2 / 2.0  # the first and the one-token request
    assert summarize(results, 2.0, dict([parse_slo("e2el:1500")]))["request_goodput"] == 3 / 2.0
    assert "request_goodput" not in summarize(results, 2.0, {})
    assert summary["tpot_ms"]["p50"] == pytest.approx(np.median([100.0, 100.0, 1900 / 9]))
    for bad in ("ttft", "latency:5", "ttft:", "ttft:abc", "tpot:-5", "e2el:0", "e2el:nan"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected NAME:MS"):
            parse_slo(bad)


@pytest.mark.parametrize("flags, message", [
    (["--request-rate", "0"], "argument --request-rate: expected a number > 0 (or inf)"),
    (["--request-rate", "-2"], "argument --request-rate"),
    (["--request-rate", "nan"], "argument --request-rate"),
    (["--random-input-len", "-5"], "argument --random-input-len: expected a positive integer"),
    (["--random-output-len", "0"], "argument --random-output-len"),
    (["--random-range-ratio", "1.5"], "argument --random-range-ratio: expected a number in [0, 1]"),
    (["--num-prompts", "0"], "argument --num-prompts"),
    (["--max-concurrency", "0"], "argument --max-concurrency"),
    (["--prefix-groups", "0"], "argument --prefix-groups"),
    (["--turns", "0"], "argument --turns"),
    (["--temperature", "-0.5"], "--temperature -0.5: temperature must be >= 0"),
    (["--temperature", "nan"], "--temperature nan: temperature must be"),
    (["--token-range", "-1", "10"], "argument --token-range: expected an integer >= 0"),
    (["--token-range", "50", "10"], "--token-range 50 10: LO must be below HI"),
    (["--token-range", "7", "7"], "--token-range 7 7: LO must be below HI"),
    (["--goodput", "ttft:abc"], "argument --goodput: expected NAME:MS"),
    (["--goodput"], "argument --goodput: expected at least one argument"),
    (["--prefix-len", "8"], "--prefix-len has no effect with --dataset random: it applies to prefix"),
    (["--dataset", "multiturn", "--prefix-groups", "2"], "--prefix-groups has no effect with --dataset multiturn"),
    (["--turns", "2"], "--turns has no effect with --dataset random: it applies to multiturn"),
    (["--dataset", "sharegpt", "--random-input-len", "8"],
     "--random-input-len has no effect with --dataset sharegpt: it applies to random, prefix, multiturn"),
    (["--dataset", "sharegpt", "--random-range-ratio", "0.5"], "--random-range-ratio has no effect"),
    (["--dataset", "multiturn", "--prompt-format", "ids"], "--prompt-format has no effect with --dataset multiturn"),
    (["--goodput", "ttft:100", "ttft:200"], "--goodput gives an SLO twice"),
    (["--base-url", "127.0.0.1:8000"], "argument --base-url: expected a URL like"),
    (["--base-url", "http://127.0.0.1:8000/v1"], "argument --base-url: expected the server's root URL"),
    (["--result-file", "/no-such-folder/r.json"], "--result-file /no-such-folder/r.json: no folder /no-such-folder"),
    (["--result-file", "/"], "--result-file / is a folder"),
])
def test_bad_bench_flags_are_usage_errors_before_the_run(cli_error, monkeypatch, flags, message):
    monkeypatch.setattr("llmjax.bench.run_bench", lambda args: pytest.fail("the benchmark ran"))
    line, status = cli_error("bench", *flags)
    assert status == 2 and line.startswith("llmjax bench: error: ") and message in line, line


def scripted_server(streams: list[list[str]]) -> FastAPI:
    """A server whose n-th `/v1/completions` answer is the raw SSE body `streams[n % len(streams)]`
    (its events joined as sent)."""
    app, calls = FastAPI(), itertools.count()
    app.add_api_route("/v1/models", lambda: {"object": "list", "data": [{"id": "scripted", "max_model_len": 64}]})

    async def completions():
        events = streams[next(calls) % len(streams)]
        return StreamingResponse(iter(events), media_type="text/event-stream")

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    return app


def sse(chunk: dict) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


TEXT = sse({"choices": [{"index": 0, "text": "ab"}]})
USAGE = sse({"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}})
DONE = "data: [DONE]\n\n"


def test_a_malformed_stream_fails_that_request_alone():
    """Each request's stream as a server or a router may cut or shape it: an event cut short, a
    chunk that is no completion chunk, one without output or usage fail that request (its error
    says why); a usage chunk without `choices`, a `null` text and anything after `[DONE]` are no
    failure (vLLM's benchmark reads them so)."""
    streams = [
        [TEXT, USAGE, DONE],
        [TEXT, 'data: {"id": "c", "choi\n\n', DONE],                         # an event cut short
        [sse({"choices": [{"index": 0, "text": None}]}), TEXT,
         sse({"usage": {"prompt_tokens": 4, "completion_tokens": 2}}), DONE],  # no `choices`; null text
        [TEXT, USAGE, DONE, sse({"error": {"message": "late"}}), DONE],       # after [DONE]: not read
        [sse({"choices": "none"}), DONE],                                     # no completion chunk
        [TEXT, DONE],                                                         # no usage
        [sse({"choices": [{"index": 0, "text": "x" * (3 << 20)}]}), USAGE, DONE],  # a line over 2 MiB
    ]
    with running_server(scripted_server(streams)) as url:
        summary = bench(url, "--num-prompts", "7", "--random-input-len", "4", "--random-output-len", "2",
                        "--max-concurrency", "1")
    assert (summary["completed"], summary["failed"]) == (3, 4)
    assert summary["total_output_tokens"] == 6
    assert sorted(e.split(" (")[0].split(":")[0] for e in summary["errors"]) == [
        "LineTooLong", "malformed stream event", "malformed stream event", "no usage in the stream"]


def test_a_chunk_is_one_event_of_its_first_choice_and_an_error_event_says_what_it_holds():
    """vLLM's client times one gap per chunk and reads its first choice: a chunk of two choices is
    one event (no zero gap), its text the first choice's. An error event without a message is shown
    whole, not as "None"."""
    result = RequestResult()
    result.add_event({"choices": [{"index": 0, "text": "a"}]}, 0.0)
    result.add_event({"choices": [{"index": 0, "text": "b"}, {"index": 1, "text": "c"}]}, 0.0)
    result.add_event({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 2}}, 0.0)
    assert (len(result.itl), result.text, result.events, result.output_tokens) == (1, "ab", 3, 2)
    assert error_text({"message": "bad"}) == "bad"
    assert error_text({"code": 500, "type": "internal"}) == '{"code": 500, "type": "internal"}'
    assert error_text("plain") == '"plain"'


def test_a_request_past_its_timeout_fails_alone():
    """`--request-timeout` bounds a request in all: a stream that stalls after its first event fails,
    the next request (a whole stream) succeeds."""
    async def stalled():
        yield TEXT
        await asyncio.sleep(30)

    app, calls = FastAPI(), itertools.count()
    app.add_api_route("/v1/models", lambda: {"object": "list", "data": [{"id": "scripted", "max_model_len": 64}]})

    async def completions():
        body = stalled() if next(calls) == 0 else iter([TEXT, USAGE, DONE])
        return StreamingResponse(body, media_type="text/event-stream")

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    with running_server(app) as url:
        summary = bench(url, "--num-prompts", "2", "--random-input-len", "4", "--random-output-len", "2",
                        "--max-concurrency", "1", "--request-timeout", "0.5")
    assert (summary["completed"], summary["failed"]) == (1, 1)
    assert summary["errors"] == ["timed out: the request took longer than its timeout"]


def test_arrivals_wait_only_between_requests(monkeypatch):
    """Poisson arrivals: a gap before each request after the first, none after the last, so the
    measured duration ends with the last request, not with one more gap."""
    gaps = []
    real_sleep = asyncio.sleep

    async def record(delay, *args):
        gaps.append(delay)
        await real_sleep(0)

    async def job(send):
        return None

    class OnlyTheBenchSleeps:  # llmjax.bench's `asyncio`, its sleep recorded (other threads' loops untouched)
        sleep = staticmethod(record)

        def __getattr__(self, name):
            return getattr(asyncio, name)

    monkeypatch.setattr(bench_module, "asyncio", OnlyTheBenchSleeps())
    results, _ = asyncio.run(run_jobs(None, [job] * 5, total=0, request_rate=2.0, max_concurrency=None, seed=0))
    assert len(gaps) == 4 and all(g > 0 for g in gaps)
    gaps.clear()
    asyncio.run(run_jobs(None, [job] * 5, total=0, request_rate=float("inf"), max_concurrency=None, seed=0))
    assert gaps == []


def test_late_wake_ups_do_not_push_later_arrivals_back(monkeypatch):
    """Each sleep wakes 50 ms late (a busy event loop): arrival k still comes at most about that late
    after its due time (the start plus the first k gaps of the seed's draws), not k times that."""
    clock = [0.0]
    started = []

    async def late_sleep(delay, *args):
        clock[0] += delay + 0.05

    async def nothing():
        return None

    def job(send):  # called as the job is started
        started.append(clock[0])
        return nothing()

    class FakeAsyncio:
        sleep = staticmethod(late_sleep)

        def __getattr__(self, name):
            return getattr(asyncio, name)

    class FakeTime:
        @staticmethod
        def perf_counter():
            return clock[0]

    monkeypatch.setattr(bench_module, "asyncio", FakeAsyncio())
    monkeypatch.setattr(bench_module, "time", FakeTime())
    asyncio.run(run_jobs(None, [job] * 20, total=0, request_rate=2.0, max_concurrency=None, seed=0))
    due = np.concatenate([[0.0], np.cumsum(np.random.default_rng(1).exponential(0.5, size=19))])
    lateness = np.array(started) - due
    assert lateness.min() >= 0 and lateness.max() < 0.2, lateness


def test_an_unreachable_server_is_an_error():
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--base-url", url, "--num-prompts", "1"])
    assert str(exit_info.value.code).startswith(f"error: cannot connect to {url}")


def test_a_server_without_models_is_an_error():
    app = FastAPI()
    app.add_api_route("/v1/models", lambda: {"object": "list", "data": []})
    with running_server(app) as url, pytest.raises(SystemExit) as exit_info:
        main(["bench", "--base-url", url, "--num-prompts", "1"])
    assert str(exit_info.value.code).startswith(f"error: GET {url}/v1/models lists no model")


def test_a_run_where_every_request_failed_exits_with_an_error(base_url, tmp_path, capsys):
    result = tmp_path / "result.json"
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--base-url", base_url, "--model", "no-such-model", "--num-prompts", "3",
              "--random-input-len", "4", "--random-output-len", "2", "--result-file", str(result)])
    assert exit_info.value.code == "error: all 3 requests failed"
    assert "failed: HTTP 404" in capsys.readouterr().out  # the table and the errors come first
    written = json.loads(result.read_text(), parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert written["failed"] == 3
    settings = written["settings"]
    assert settings["request_rate"] == "inf" and settings["num_prompts"] == 3 and settings["random_input_len"] == 4
    assert settings["prefix_len"] == 512 and settings["model"] == "no-such-model"  # a default, and the flag
    assert "api_key" not in settings and written["provenance"]["commit"]


def test_each_request_cut_to_fit_counts_once():
    """A prefix request whose drawn lengths and whole prompt (prefix + its own part) are both cut
    counts once, as does each turn of a conversation; one that fits is not counted."""
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    cases = [(["--dataset", "prefix", "--prefix-groups", "1", "--prefix-len", "100", "--random-input-len", "100",
               "--random-output-len", "200"], 4), (["--random-input-len", "8", "--random-output-len", "8"], 0),
             (["--dataset", "multiturn", "--turns", "3", "--random-input-len", "300"], 4 * 3)]  # 300 > 256
    for argv, capped in cases:
        args = parser.parse_args(["--num-prompts", "4", "--model", "m", *argv])
        workload = bench_module.Workload(args, 256, lambda ids: " ".join(map(str, ids)))
        workload.jobs()
        assert workload.capped == capped, argv


def test_multiturn_defaults_fit_every_turn_in_a_2048_token_model():
    """A multiturn conversation's default turns, each resending the history, fit the embedded model's
    default context (with the shared 1024-token default, only the first turn did)."""
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    for dataset in ("multiturn", "random"):
        args = bench_module.with_dataset_defaults(parser.parse_args(["--dataset", dataset]))
        if dataset == "random":
            assert args.random_input_len == bench_module.DATASET_FLAGS["random_input_len"][1]
            continue
        last_turn = args.turns * (args.random_input_len + args.random_output_len)  # its history, message and reply
        assert last_turn <= 2048, vars(args)


def test_text_prompts_that_fill_the_context_fit_it(base_url, capsys):
    """Asked for more than the context holds, every request is cut to fit and said to be: output at
    most half the context, the prompt the rest, counted as the server counts the text (its BOS
    included), so none is refused."""
    summary = bench(base_url, "--num-prompts", "3", "--random-input-len", "300", "--random-output-len", "100",
                    "--prompt-format", "text")
    assert (summary["completed"], summary["failed"], summary["capped_requests"]) == (3, 0, 3)
    assert summary["total_output_tokens"] == 3 * (MAX_MODEL_LEN // 2)
    assert summary["total_input_tokens"] <= 3 * (MAX_MODEL_LEN - MAX_MODEL_LEN // 2)
    assert "3 requests' drawn lengths were cut to fit max_model_len 128" in capsys.readouterr().err


def test_an_api_key_is_sent_with_every_request(monkeypatch):
    """A server started with `--api-key` (text prompts: `/detokenize` too); none given, its 401 is the error."""
    engine = tiny_engine(max_num_seqs=4, kv_cache_memory_bytes=2 << 20, max_model_len=MAX_MODEL_LEN)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with running_server(build_app(engine, "tiny", api_key="sekret")) as url:
        summary = bench(url, "--api-key", "sekret", "--num-prompts", "2", "--random-input-len", "4",
                        "--random-output-len", "2", "--prompt-format", "text")
        assert (summary["completed"], summary["failed"]) == (2, 0)
        with pytest.raises(SystemExit) as exit_info:
            main(["bench", "--base-url", url, "--num-prompts", "1"])
        assert str(exit_info.value.code).startswith(f"error: GET {url}/v1/models answered 401")


@pytest.mark.parametrize("card, detokenize, message", [
    ({"id": "m"}, None, "gives no max_model_len"),
    ({"id": "m", "max_model_len": 64}, (400, {"error": {"message": "bad ids"}}), "/detokenize answered 400"),
    ({"id": "m", "max_model_len": 64}, (200, {"text": "x"}), "/detokenize answered no prompt"),
])
def test_a_server_missing_what_bench_reads_is_an_error(card, detokenize, message):
    """A model card without `max_model_len`, a `/detokenize` that refuses or answers another shape:
    `error: ...` naming it, no traceback."""
    from fastapi.responses import JSONResponse

    app = FastAPI()
    app.add_api_route("/v1/models", lambda: {"object": "list", "data": [card]})
    if detokenize is not None:
        app.add_api_route("/detokenize", lambda: JSONResponse(detokenize[1], detokenize[0]), methods=["POST"])
    with running_server(app) as url, pytest.raises(SystemExit) as exit_info:
        main(["bench", "--base-url", url, "--num-prompts", "1", "--random-input-len", "4", "--prompt-format", "text"])
    assert str(exit_info.value.code).startswith("error: ") and message in str(exit_info.value.code)


@pytest.mark.parametrize("max_model_len", [1024, 2048])
def test_sharegpt_requests_have_the_published_mean_lengths(max_model_len):
    """The output lengths are solved under the caps that fit them to the context, so the lengths sent
    (not only those drawn) have ShareGPT's published means, and none is cut afterwards."""
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    args = parser.parse_args(["--num-prompts", "2000", "--model", "m", "--dataset", "sharegpt",
                              "--prompt-format", "ids"])
    workload = bench_module.Workload(args, max_model_len, lambda ids: " ".join(map(str, ids)))
    payloads = []

    async def send(payload):
        payloads.append(payload)
    jobs, _ = workload.jobs()
    for job in jobs:
        asyncio.run(job(send))
    inputs = np.array([len(p["prompt"]) for p in payloads])
    outputs = np.array([p["max_tokens"] for p in payloads])
    assert workload.capped == 0 and (inputs + outputs).max() <= max_model_len
    assert abs(inputs.mean() - bench_module.SHAREGPT.mean_prompt) < 0.5
    assert abs(outputs.mean() - bench_module.SHAREGPT.mean_output) < 0.5
