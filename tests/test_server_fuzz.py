"""Random requests against the HTTP server: valid ones of many shapes, malformed ones, streams the
client abandons, all at once on a tiny random model with a pool small enough to preempt.

The contract checked is the server's, not any model's output: a malformed request gets an OpenAI
error object with a 4xx status and never a 5xx; every valid request completes (200, `n` choices, each
with a finish reason; a stream ends with `[DONE]`) however many bad ones run beside it; afterwards
nothing runs or waits, no KV block is in use and the KV invariants hold. The valid shapes leave out
what the server refuses by design (`best_of` > 1, `stream_options` without `stream`), so a valid
combination it refuses fails the test.
"""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from llmjax.serve.api import build_app
from tests.engine_helpers import engine_bytes_per_token, tiny_engine
from tests.server_helpers import assert_no_leak, running_server

MODEL = "tiny"
CONCURRENCY = 24
REQUESTS = 120

COMMON = {  # sampling fields both endpoints take, each with values the server must accept
    "n": [1, 2, 3], "temperature": [0, 0.7, 1.5], "top_p": [0.5, 1], "top_k": [0, 5, -1], "min_p": [0, 0.1],
    "seed": [1, 7], "stop": ["a", ["b", "cd"], []], "stop_token_ids": [[5, 6], []], "min_tokens": [0, 2],
    "presence_penalty": [0.5, -1], "frequency_penalty": [1.0], "repetition_penalty": [1.2],
    "logit_bias": [{"5": 100}, {}], "ignore_eos": [True, False], "include_stop_str_in_output": [True],
    "skip_special_tokens": [False], "cache_salt": ["tenant-a", "tenant-b"], "max_tokens": [1, 8, 24],
}
COMPLETION_ONLY = {"echo": [True], "logprobs": [0, 3]}
CHAT_ONLY = {"top_logprobs": [0, 2], "max_completion_tokens": [5]}
PROMPTS = ["hello there", "a b c d e f g", [1, 2, 3, 4], ["a b", "c"], [[7, 8], [9]]]
MESSAGES = [[{"role": "user", "content": "hi"}],
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name a colour"}],
            [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]]
# values of every kind for any field, most of them wrong for the field they land in
WRONG = [None, -1, 0, 2**63, -(2**70), 1e300, "x", "", True, [], [[1]], {}, {"a": 1}, "NaN", 10**6, [1.5], ["a", 1]]
BAD_PROMPTS = ["", [], [-1], [10**9], [[]], [1.5], ["a", 1], 5, None, "x" * 5000]
BAD_MESSAGES = [[], [{"role": "user"}], [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": 5}],
                "hi", None, [{"content": "hi"}]]
RAW = [b"{", b"", b"[]", b"null", b'{"prompt": "a", "max_tokens": 1', b"\xff\xfe", b'{"prompt": "\\ud800"}']


def valid_body(rng: random.Random, chat: bool) -> dict:
    fields = {**COMMON, **(CHAT_ONLY if chat else COMPLETION_ONLY)}
    body = {"model": MODEL, "max_tokens": 8}
    body.update({"messages": rng.choice(MESSAGES)} if chat else {"prompt": rng.choice(PROMPTS)})
    for name in rng.sample(sorted(fields), rng.randint(0, 6)):
        body[name] = rng.choice(fields[name])
    if "top_logprobs" in body:
        body["logprobs"] = True
    if body.get("echo") and rng.random() < 0.3:
        body["max_tokens"] = 0  # the prompt alone (0 is valid only with echo)
    if body.get("min_tokens", 0) > min(body.get(k, 8) for k in ("max_tokens", "max_completion_tokens")):
        del body["min_tokens"]  # more than it may generate: invalid
    if rng.random() < 0.5:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": rng.random() < 0.5}
    return body


def malformed_body(rng: random.Random, chat: bool) -> dict | bytes:
    """A valid body with one thing broken: a field given a value of the wrong kind or range, the
    prompt or messages broken or missing, or no JSON object at all."""
    u = rng.random()
    if u < 0.1:
        return rng.choice(RAW)
    body = valid_body(rng, chat)
    key = "messages" if chat else "prompt"
    if u < 0.35:
        body[key] = rng.choice(BAD_MESSAGES if chat else BAD_PROMPTS)
    elif u < 0.4:
        del body[key]
    else:
        names = sorted({**COMMON, **(CHAT_ONLY if chat else COMPLETION_ONLY), "stream": 0, "stream_options": 0})
        body[rng.choice(names)] = rng.choice(WRONG)
    return body


async def send(client: httpx.AsyncClient, path: str, body: dict | bytes, abandon_after: int | None) -> dict:
    """One request; returns {"status", "text", "abandoned"}. A stream is read event by event, and
    dropped after `abandon_after` events if given."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    async with client.stream("POST", path, content=content, headers=headers) as r:
        text, events = "", 0
        async for chunk in r.aiter_text():
            text += chunk
            events += chunk.count("\n\n")
            if abandon_after is not None and events >= abandon_after:
                return {"status": r.status_code, "text": text, "abandoned": True}
        return {"status": r.status_code, "text": text, "abandoned": False}


def num_choices(body: dict) -> int:
    """`n` per prompt; a completion's prompt may be a list of prompts (strings or token id lists)."""
    prompt = body.get("prompt")
    batched = isinstance(prompt, list) and isinstance(prompt[0], (str, list))
    return body.get("n", 1) * (len(prompt) if batched else 1)


def check_valid(body: dict, result: dict) -> None:
    assert result["status"] == 200, (body, result["text"][:300])
    if result["abandoned"]:
        return
    if body.get("stream"):
        events = result["text"].split("\n\n")[:-1]
        assert events[-1] == "data: [DONE]", (body, result["text"][-300:])
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        finished = {c["index"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")}
        assert finished == set(range(num_choices(body))), body
        assert all("error" not in chunk for chunk in chunks), body
    else:
        choices = json.loads(result["text"])["choices"]
        assert len(choices) == num_choices(body), body
        assert all(c["finish_reason"] in ("stop", "length") for c in choices), (body, choices)


def check_malformed(body: dict | bytes, result: dict) -> None:
    """Not every broken body is invalid (a wrong value may happen to be a legal one); a refusal must
    be a 4xx OpenAI error object, and nothing may be a server error."""
    status = result["status"]
    assert status < 500, (body, result["text"][:300])
    if status != 200:
        assert 400 <= status < 500
        error = json.loads(result["text"])["error"]
        assert isinstance(error["message"], str) and error["message"], (body, error)


@pytest.fixture(scope="module")
def base_url():
    # 24 blocks of 8 tokens: concurrent requests overflow the pool, so some are preempted and recomputed
    engine = tiny_engine(max_num_seqs=12, max_num_batched_tokens=64,
                         kv_cache_memory_bytes=24 * 8 * engine_bytes_per_token("tiny-gqa"),
                         max_model_len=128)
    with running_server(build_app(engine, MODEL)) as url:
        yield url


@pytest.mark.parametrize("seed", [0, 1])
def test_random_valid_malformed_and_abandoned_requests(base_url, seed):
    rng = random.Random(seed)
    plan = []
    for _ in range(REQUESTS):
        chat = rng.random() < 0.5
        path = "/v1/chat/completions" if chat else "/v1/completions"
        valid = rng.random() < 0.6
        body = valid_body(rng, chat) if valid else malformed_body(rng, chat)
        abandon = rng.randint(1, 4) if isinstance(body, dict) and body.get("stream") is True and rng.random() < 0.2 \
            else None
        plan.append((path, body, valid, abandon))

    async def run_all() -> list[dict]:
        gate = asyncio.Semaphore(CONCURRENCY)
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            async def one(path, body, abandon):
                async with gate:
                    return await send(client, path, body, abandon)
            return await asyncio.gather(*(one(path, body, abandon) for path, body, _, abandon in plan))

    results = asyncio.run(run_all())
    for (_, body, valid, _), result in zip(plan, results):
        (check_valid if valid else check_malformed)(body, result)
    assert sum(valid for _, _, valid, _ in plan) > REQUESTS // 3  # the valid path is exercised
    with httpx.Client(base_url=base_url, timeout=30) as client:
        assert_no_leak(client)
