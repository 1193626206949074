"""The experiments' wall-clock replay (`experiments/common.py: replay_engine`) cuts a step that
compiled out of the clock, its own tokens' times included. The clock is faked: the "compile" of one
step jumps it by an hour, so the check does not depend on how fast this machine is."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "experiments"))

from common import replay_engine  # noqa: E402
from llmjax.sim import TraceRequest  # noqa: E402
from tests.engine_helpers import tiny_engine  # noqa: E402

HOUR = 3600.0


def test_a_compiling_steps_stall_shows_in_no_request_time(monkeypatch):
    engine = tiny_engine(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)  # few warm-up shapes
    engine.warmup()  # no real compile during the replay: the faked one is the only stall
    offset = [0.0]
    real_monotonic = time.monotonic
    monkeypatch.setattr(time, "monotonic", lambda: real_monotonic() + offset[0])
    runner, real_dispatch, calls = engine.runner, engine.runner.dispatch, [0]

    def dispatch(*args, **kwargs):  # the third step "compiles" for an hour before it runs
        calls[0] += 1
        if calls[0] == 3:
            runner.num_compiles += 1
            offset[0] += HOUR
        return real_dispatch(*args, **kwargs)

    monkeypatch.setattr(runner, "dispatch", dispatch)
    trace = [TraceRequest(f"r{i}", 0.0, list(range(3, 3 + n)), 8) for i, n in enumerate((5, 9, 14))]
    replay = replay_engine(engine, trace)

    assert replay.compiles == 1 and calls[0] > 3
    assert sorted(t.request_id for t in replay.timings) == ["r0", "r1", "r2"]
    for t in replay.timings:
        assert len(t.token_times) == 8
        times = [t.arrival, *t.token_times]
        assert all(0 <= later - earlier < HOUR / 2 for earlier, later in zip(times, times[1:])), times
    assert replay.duration < HOUR / 2
