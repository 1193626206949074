"""AsyncEngine's delivery: each stream gets its outputs in order, the loop thread wakes an event
loop once per step for all of that step's outputs (not once per output), and a stream merges the
deltas its consumer has not read yet."""

import asyncio
from types import SimpleNamespace

import pytest

from llmjax.config import ConfigError, EngineConfig
from llmjax.outputs import CompletionOutput, OutputAccumulator, RequestMetrics, RequestOutput
from llmjax.serve import async_engine
from llmjax.serve.async_engine import AsyncEngine, OutputStream
from tests.engine_helpers import GREEDY, run_to_completion, tiny_engine

PROMPTS = [[5 + i, 17, 42 + i, 9] for i in range(8)]


def test_streams_get_their_outputs_with_one_wake_up_per_step(monkeypatch):
    expected = [o.outputs[0].token_ids for o in run_to_completion(tiny_engine(), PROMPTS)]
    wake_ups = []
    put_all = async_engine._put_all
    monkeypatch.setattr(async_engine, "_put_all", lambda batch: (wake_ups.append(len(batch)), put_all(batch)))
    engine = AsyncEngine(tiny_engine())
    engine.start()

    async def serve_all():
        streams = [engine.open_stream() for _ in PROMPTS]
        for i, (stream, prompt) in enumerate(zip(streams, PROMPTS)):
            await stream.add({f"r{i}": prompt}, GREEDY)

        async def collect(stream):
            whole = OutputAccumulator()
            async for out in stream:
                last = whole.add(out)
            return last.outputs[0].token_ids

        return await asyncio.gather(*map(collect, streams))

    try:
        got = asyncio.run(serve_all())
    finally:
        engine.shutdown()
    assert got == expected
    assert sum(wake_ups) == sum(len(ids) for ids in expected)  # one delta per token, each delivered once
    assert len(wake_ups) <= engine.engine.num_steps < sum(wake_ups)  # batched: fewer wake-ups than outputs


def _delta(request_id: str, text: str, token_ids: list[int], finish_reason: str | None = None,
           error: str | None = None) -> RequestOutput:
    done = finish_reason is not None
    return RequestOutput(request_id, None, [1], [CompletionOutput(0, text, token_ids, finish_reason=finish_reason)],
                         done, RequestMetrics(0.0), error=error)


def _read(stream: OutputStream, n: int) -> list[tuple]:
    """The next `n` outputs of `stream` as (request id, text, token ids, finished, error)."""

    async def take():
        got, outputs = [], aiter(stream)
        for _ in range(n):
            o = await anext(outputs)
            got.append((o.request_id, o.outputs[0].text, o.outputs[0].token_ids, o.finished, o.error))
        return got

    return asyncio.run(take())


def test_a_stream_merges_the_deltas_its_consumer_has_not_read():
    stream = OutputStream(engine=None)
    stream.unfinished = {"a", "b"}
    stream.put(_delta("a", "x", [5]))
    assert _read(stream, 1) == [("a", "x", [5], False, None)]  # read: later deltas start a new output
    for delta in (_delta("a", "y", [6]), _delta("b", "p", [9]), _delta("a", "z", [7]),
                  _delta("b", "q", [10], "length"), _delta("a", "!", [8], "stop")):
        stream.put(delta)
    assert _read(stream, 2) == [("a", "yz!", [6, 7, 8], True, None), ("b", "pq", [9, 10], True, None)]
    assert not stream.unfinished


def test_a_stream_never_merges_an_error_into_the_output_before_it():
    stream = OutputStream(engine=None)
    stream.unfinished = {"a"}
    stream.put(_delta("a", "x", [5]))
    stream.put(_delta("a", "", [], "error", error="RuntimeError: boom"))
    assert _read(stream, 2) == [("a", "x", [5], False, None), ("a", "", [], True, "RuntimeError: boom")]


def test_a_stream_of_cumulative_outputs_keeps_the_newest_unread_one():
    stream = OutputStream(engine=None)
    stream.unfinished = {"a"}
    stream._cumulative = True  # as `add` sets it for RequestOutputKind.CUMULATIVE params
    for output in (_delta("a", "x", [5]), _delta("a", "xy", [5, 6]), _delta("a", "xyz", [5, 6, 7], "stop")):
        stream.put(output)
    assert _read(stream, 1) == [("a", "xyz", [5, 6, 7], True, None)]


def test_a_consumer_that_falls_behind_reads_fewer_outputs_with_every_token():
    [reference] = run_to_completion(tiny_engine(), [PROMPTS[0]])
    engine = AsyncEngine(tiny_engine())
    engine.start()

    async def read(request_id: str, lag_s: float) -> list[RequestOutput]:
        stream = engine.open_stream()
        await stream.add({request_id: PROMPTS[0]}, GREEDY)
        outputs = []
        async for out in stream:
            outputs.append(out)
            if len(outputs) == 1:
                await asyncio.sleep(lag_s)  # the engine makes the other tokens meanwhile
        return outputs

    try:
        asyncio.run(read("warm-up", 0.0))  # compiles the steps of one request
        outputs = asyncio.run(read("r", 1.0))
    finally:
        engine.shutdown()
    tokens = [t for o in outputs for t in o.outputs[0].token_ids]
    assert tokens == reference.outputs[0].token_ids
    assert "".join(o.outputs[0].text for o in outputs) == reference.outputs[0].text
    assert len(outputs) < len(tokens) and outputs[-1].finished and not any(o.finished for o in outputs[:-1])


def test_static_batching_is_refused_on_a_server():
    # a server never closes its input: a partial static batch would wait forever
    engine = SimpleNamespace(config=EngineConfig(scheduling_policy="static", batch_size=2))
    with pytest.raises(ConfigError, match="use --scheduling-policy dynamic"):
        AsyncEngine(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_loop_never_waits_while_continuous_batching_has_work(async_scheduling):
    # A step that dispatches nothing but completes the step in flight frees its finished requests'
    # rows: waiting requests must be admitted at once, not after the stall wait (a wave of requests
    # that finish together, more waiting than max_num_seqs admits).
    engine = AsyncEngine(tiny_engine(max_num_seqs=2, async_scheduling=async_scheduling))
    stalls = []
    serve_commands = engine._serve_commands
    engine._serve_commands = lambda stalled: (stalls.append(stalled), serve_commands(stalled))[1]
    engine.start()

    async def serve_all():
        async def one(i):
            stream = engine.open_stream()
            await stream.add({f"r{i}": PROMPTS[i]}, GREEDY)
            whole = OutputAccumulator()
            async for out in stream:
                last = whole.add(out)
            return last

        return await asyncio.gather(*map(one, range(6)))

    try:
        outputs = asyncio.run(serve_all())
    finally:
        engine.shutdown()
    assert all(o.finished and len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outputs)
    assert engine.engine.num_steps > 0 and not any(stalls)


def test_an_accumulator_starts_anew_when_a_finished_requests_id_comes_again():
    """An engine takes an id again once its request has finished: the new request's deltas make a
    new output, never one appended to the finished one."""
    def delta(text: str, finished: bool) -> RequestOutput:
        return RequestOutput("same", None, [1], [CompletionOutput(0, text, [5], finish_reason="length" if finished
                                                                  else None)], finished, RequestMetrics(0.0))

    whole = OutputAccumulator()
    whole.add(delta("a", False))
    assert whole.add(delta("b", True)).outputs[0].text == "ab"
    assert whole.add(delta("c", False)).outputs[0].text == "c"
    again = whole.add(delta("d", True))
    assert (again.outputs[0].text, again.outputs[0].token_ids, again.finished) == ("cd", [5, 5], True)
