"""AsyncEngine's delivery: each stream gets its outputs in order, and the loop thread wakes an
event loop once per step for all of that step's outputs (not once per output)."""

import asyncio

from llmjax.outputs import OutputAccumulator
from llmjax.serve import async_engine
from llmjax.serve.async_engine import AsyncEngine
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
            await stream.add(prompt, GREEDY, f"r{i}")

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
