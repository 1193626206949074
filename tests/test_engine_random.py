"""Random end-to-end runs of `LLMEngine`, checked against independent references.

Each scenario (a seed) drives one engine through a random interleaving of `add_request`, `abort`
and `step`: a small KV pool (requests are preempted, cached prefixes evicted), chunked prefill under
a small token budget, at most four running requests; prompts of random lengths, many sharing a
prefix, some under a namespace (tenant), some under the id of a request that has finished; greedy
requests and seeded sampling (top-p, n up to 3); logit bias, penalties, stop token ids, EOS and
stop strings (made likely by a bias on a favoured token), max_tokens (or none: up to
max_model_len) and min_tokens; DELTA outputs folded with `OutputAccumulator` for some requests,
FINAL_ONLY for others; synchronous and asynchronous scheduling, prefix caching on and (once) off,
FCFS and LPM queue order, stream intervals 1 to 3. Checked:

- after every step and every abort, the KV invariants;
- every greedy sample token by token: it is the argmax of the dense (no cache) model's logits over
  the sample's own prefix, processed as vLLM does (logit bias, the min_tokens mask, penalties), up to
  float near-ties (`MARGIN`);
- every seeded sample token by token: it is the draw, with the uniform number of its key, from the
  same processed dense logits cut by top-p (`possible_draws`: up to float near-ties), and it equals
  the same request run alone on a reference engine (no prefix caching, nothing else in its batch) up
  to the first such near-tie: seeded sampling does not depend on the batch;
- every finished sample ends where vLLM's rules end it (`expected_end`) with that finish reason,
  stop reason and text; an aborted one has finish reason "abort" and has not reached an end;
- exactly one finished output per request (a FINAL_ONLY request: one output in all), none after it,
  and `abort` answers None exactly for the requests already finished;
- a request's cached prompt tokens come only from requests of its namespace (this one included),
  never its whole prompt;
- a request with `prompt_logprobs` gets them in exactly one output, the dense model's, one per
  prompt token (fewer only if aborted), with no prefix-cache hit;
- at the end, no request holds a block, a batch row or an entry in any per-request table, and once
  the prefix cache is reset every block is free.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import numpy as np
import pytest

from llmjax.outputs import OutputAccumulator, RequestOutput
from llmjax.sampling_params import RequestOutputKind, SamplingParams
from tests.engine_helpers import REF_LEN, dense_logits, drain, engine_bytes_per_token, tiny_engine

DELTA, FINAL_ONLY = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY
PRESET = "tiny-gqa"
BLOCK = 8
# 20 usable blocks of 8 tokens: four requests of 40-80 tokens do not fit together, one always does
CONFIG = dict(max_num_batched_tokens=32, max_num_seqs=4, block_size=BLOCK, max_model_len=REF_LEN,
              kv_cache_memory_bytes=21 * BLOCK * engine_bytes_per_token(PRESET))
VOCAB = 512  # the tiny presets' vocabulary
EOS = 2  # their EOS id (CharTokenizer: ids 0, 1, 2 have no text, every other id one character)
MARGIN = 1e-4  # a greedy token may differ from the reference's argmax by this much (float near-ties)
SAMPLE_EPS = 1e-5  # a sampled token may differ where the top-p cut or the draw is this near a boundary
NAMESPACES = [None, None, None, "tenant-a", "tenant-b"]

# (seed, async_scheduling, enable_prefix_caching, other EngineConfig fields)
SCENARIOS = [(1, False, True, {}), (2, True, True, {}), (3, False, True, dict(queue_order="lpm")),
             (4, True, True, dict(stream_interval=3)), (5, False, False, {}),
             (6, True, True, dict(queue_order="lpm", stream_interval=2)),
             (7, False, True, dict(max_num_batched_tokens=16)), (8, True, True, dict(max_num_batched_tokens=16))]


def scenario_id(scenario) -> str:
    seed, async_scheduling, prefix_caching, extra = scenario
    return "-".join([f"seed{seed}", "async" if async_scheduling else "sync", "cache" if prefix_caching else "nocache",
                     *(f"{k}={v}" for k, v in extra.items())])


@dataclass
class Spec:
    key: str  # unique in the run
    prompt: list[int]
    params: SamplingParams
    namespace: str | None
    request_id: str = ""  # the id it was added under: its key, or the id of a request that had finished


def token_text(token: int) -> str:
    return chr(32 + (token - 3) % 95) if token >= 3 else ""  # CharTokenizer's rule, written out


def random_params(rng: np.random.Generator, prompt_len: int) -> SamplingParams:
    max_tokens = int(rng.integers(1, min(40, REF_LEN - prompt_len) + 1))
    kw: dict = dict(max_tokens=max_tokens, ignore_eos=True, output_kind=DELTA if rng.random() < 0.5 else FINAL_ONLY)
    if prompt_len > 80 and rng.random() < 0.5:
        kw["max_tokens"] = None  # up to max_model_len
    if rng.random() < 0.6:
        kw.update(temperature=0.0, n=int(rng.choice([1, 1, 1, 2])))
    else:
        kw.update(temperature=float(rng.choice([0.6, 1.0])), top_p=float(rng.choice([1.0, 0.9])),
                  seed=int(rng.integers(0, 2**63)), n=int(rng.choice([1, 1, 2, 3])))
    favoured, bias = int(rng.integers(3, VOCAB)), float(rng.choice([2.0, 5.0, 10.0]))
    ending = rng.choice(["length", "stop_id", "eos", "stop_str"])
    if ending == "stop_id":
        kw.update(stop_token_ids=[favoured, int(rng.integers(3, VOCAB))], logit_bias={favoured: bias})
    elif ending == "eos":
        kw.update(ignore_eos=False, logit_bias={EOS: bias})
    elif ending == "stop_str":
        char = token_text(favoured)
        stops = [char] if rng.random() < 0.5 else [char * 2, token_text(int(rng.integers(3, VOCAB))) + char]
        kw.update(stop=stops, logit_bias={favoured: bias}, include_stop_str_in_output=bool(rng.random() < 0.3))
    if ending != "length" and rng.random() < 0.5:
        kw["min_tokens"] = int(rng.integers(0, max_tokens + 1))  # <= max_model_len - prompt_len too
    if rng.random() < 0.3:
        kw.update(presence_penalty=float(rng.choice([0.0, 0.5, 1.5])), frequency_penalty=float(rng.choice([0.0, 0.3])),
                  repetition_penalty=float(rng.choice([1.0, 1.3])))
    if rng.random() < 0.2:
        kw["prompt_logprobs"] = int(rng.choice([0, 3]))
    return SamplingParams(**kw)


def random_specs(rng: np.random.Generator, num_requests: int) -> list[Spec]:
    prefixes = [rng.integers(3, VOCAB, size=int(k)).tolist() for k in rng.integers(8, 41, size=3)]
    specs: list[Spec] = []
    for i in range(num_requests):
        u = rng.random()
        if u < 0.15 and specs:  # the same prompt again: a full match (one token is still computed)
            prompt = list(specs[int(rng.integers(len(specs)))].prompt)
        elif u < 0.72:  # a shared prefix; some long: with the output, most of the pool, up to max_model_len
            suffix = rng.integers(0, 25) if u < 0.65 else rng.integers(50, 70)
            prompt = prefixes[int(rng.integers(len(prefixes)))] + rng.integers(3, VOCAB, size=int(suffix)).tolist()
        else:
            prompt = rng.integers(3, VOCAB, size=int(rng.integers(1, 61))).tolist()
        namespace = NAMESPACES[int(rng.integers(len(NAMESPACES)))]
        specs.append(Spec(f"r{i}", prompt, random_params(rng, len(prompt)), namespace))
    return specs


def expected_end(prompt: list[int], params: SamplingParams, tokens: list[int]):
    """Where vLLM's rules end a sample that generated `tokens`: (index of the token that ends it,
    finish reason, stop reason, text), or None when none of them does. An EOS (unless ignore_eos) or a
    stop id ends it once min_tokens tokens are out, its id kept and its text dropped (unless
    include_stop_str_in_output); then a stop string completed by the token's text (a token after the
    first min_tokens; cut from the text unless include_stop_str_in_output); then max_tokens or
    max_model_len."""
    text = ""
    for i, token in enumerate(tokens):
        n = i + 1
        eos = token == EOS and not params.ignore_eos
        if n >= params.min_tokens and (eos or token in params.stop_token_ids):
            keep = token_text(token) if params.include_stop_str_in_output else ""
            return i, "stop", None if eos else token, text + keep
        char = token_text(token)
        text += char
        if char and n > params.min_tokens:
            for stop in params.stop:
                if text.endswith(stop):
                    return i, "stop", stop, text if params.include_stop_str_in_output else text[: -len(stop)]
        if (params.max_tokens is not None and n >= params.max_tokens) or len(prompt) + n >= REF_LEN:
            return i, "length", None, text
    return None


def processed_logits(engine, prompt: list[int], params: SamplingParams, tokens: list[int]) -> np.ndarray:
    """`[len(tokens), V]` float64: row i scores token i, the dense (no cache) model's logits over
    everything before it processed in vLLM's order: logit bias, the min_tokens mask (EOS, with
    ignore_eos too, and the stop ids), the repetition penalty on tokens of the prompt and of the output
    so far, then the frequency and presence penalties."""
    rows = dense_logits(engine, prompt + tokens)[len(prompt) - 1 : -1].astype(np.float64)
    for token, value in (params.logit_bias or {}).items():
        rows[:, token] += value
    masked = list(params.stop_token_ids) + [EOS]
    rows[: params.min_tokens, masked] = -np.inf
    counts = np.zeros(VOCAB)
    in_prompt = np.bincount(prompt, minlength=VOCAB) > 0
    rep = params.repetition_penalty
    for i, token in enumerate(tokens):
        seen = in_prompt | (counts > 0)
        rows[i] = np.where(seen, np.where(rows[i] > 0, rows[i] / rep, rows[i] * rep), rows[i])
        rows[i] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        counts[token] += 1
    return rows


def check_prompt_logprobs(engine, prompt: list[int], k: int, entries, whole: bool) -> None:
    """Prompt logprobs are the dense model's: one entry per prompt token (fewer only if aborted), None
    first, then the token's own logprob first and the top k."""
    assert entries[0] is None and (len(entries) == len(prompt) if whole else 1 <= len(entries) <= len(prompt))
    ref = np.asarray(jax.nn.log_softmax(dense_logits(engine, prompt), axis=-1))
    for t in range(1, len(entries)):
        entry, row = entries[t], ref[t - 1]
        ids = list(entry)
        assert ids[0] == prompt[t] and max(k, 1) <= len(ids) <= k + 1
        np.testing.assert_allclose([entry[i].logprob for i in ids], row[ids], atol=2e-5)
        np.testing.assert_allclose(sorted((e.logprob for e in entry.values()), reverse=True)[:k],
                                   np.sort(row)[::-1][:k], atol=2e-5)


def check_greedy(engine, prompt: list[int], params: SamplingParams, tokens: list[int], where: str) -> None:
    """Each token is the argmax of its `processed_logits` row; a different token only within MARGIN of it."""
    if not tokens:
        return
    rows = processed_logits(engine, prompt, params, tokens)
    for i, token in enumerate(tokens):
        best = int(rows[i].argmax())
        gap = rows[i, best] - rows[i, token]
        assert gap < MARGIN, f"{where}: token {i} is {token}, the reference's argmax {best} scores {gap} more"


@functools.lru_cache(maxsize=1)
def _uniforms_fn():
    """The uniform numbers of one sample's draws, by the sampler's documented key:
    fold_in(fold_in(fold_in(fold_in(key(0), seed_hi), seed_lo), sample_index), output_index)."""
    def one(hi, lo, sample_index, output_index):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), hi), lo)
        return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key, sample_index), output_index), ())

    return jax.jit(jax.vmap(one, in_axes=(None, None, None, 0)))


def possible_draws(row: np.ndarray, params: SamplingParams, u: float) -> set[int]:
    """The tokens a draw with uniform `u` from softmax(row / temperature), cut by top-p, may give
    when float32 noise decides: the engine's logits differ from the dense ones, and from one batch
    shape to another, by ~1e-6. The engine's rule: a token is kept when the mass of the more probable
    ones is below top_p (and so is any as probable as the last kept one); the first index whose
    cumulative kept mass exceeds u times the total is drawn. A token is uncertain when tokens within
    SAMPLE_EPS (relative) of its probability, or the mass itself within SAMPLE_EPS of top_p, could
    decide; every subset of the uncertain ones is tried with u and u +- SAMPLE_EPS. A single token
    unless the draw is that near a boundary."""
    assert params.top_k in (0, -1) and params.min_p == 0
    logits = row / params.temperature
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    if params.top_p < 1:
        ranked = np.sort(probs)  # ascending: the mass above p is the total less the mass up to p
        upto = np.concatenate([[0.0], np.cumsum(ranked)])  # upto[i]: the mass of the i least probable
        total = upto[-1]
        above_lo = total - upto[np.searchsorted(ranked, probs * (1 + SAMPLE_EPS), side="right")]  # no near-equal one
        above_hi = total - upto[np.searchsorted(ranked, probs * (1 - SAMPLE_EPS), side="left")] - probs  # all of them
        certain = above_hi < params.top_p - SAMPLE_EPS
        uncertain = np.flatnonzero(~certain & (above_lo < params.top_p + SAMPLE_EPS) & (probs > 0))
        assert len(uncertain) <= 6, f"{len(uncertain)} tokens at the top-p cut"
    else:
        certain, uncertain = probs > 0, np.zeros(0, int)
    draws = set()
    for subset in range(2 ** len(uncertain)):
        keep = certain.copy()
        keep[[t for j, t in enumerate(uncertain) if subset >> j & 1]] = True
        if not keep.any():
            continue
        kept = np.where(keep, probs, 0.0)
        cum = np.cumsum(kept) / kept.sum()
        for v in (u - SAMPLE_EPS, u, u + SAMPLE_EPS):
            draws.add(min(int((cum <= v).sum()), int(np.flatnonzero(kept)[-1])))
    return draws


def check_sampled(engine, prompt: list[int], params: SamplingParams, index: int, tokens: list[int],
                  where: str) -> set[int]:
    """Each token of seeded sample `index` is a `possible_draws` of its `processed_logits` row with
    the uniform number of its key; returns the positions where more than one token was possible."""
    if not tokens:
        return set()
    rows = processed_logits(engine, prompt, params, tokens)
    seed = params.seed % 2**64
    us = np.asarray(_uniforms_fn()(np.uint32(seed >> 32), np.uint32(seed & 0xFFFFFFFF), np.int32(index),
                                   np.arange(REF_LEN, dtype=np.int32)), np.float64)
    ties = set()
    for i, token in enumerate(tokens):
        draws = possible_draws(rows[i], params, float(us[i]))
        assert token in draws, f"{where}: token {i} is {token}, the reference draws {draws}"
        if len(draws) > 1:
            ties.add(i)
    return ties


class Record:
    """Every output the run returned, by spec (`Spec.key`: a request id may be reused once its
    request finished): DELTA ones folded, FINAL_ONLY ones kept."""

    def __init__(self, specs: list[Spec]):
        self.specs = {s.key: s for s in specs}
        self.current: dict[str, str] = {}  # request id -> the key of the spec added under it last
        self.deltas = {s.key: OutputAccumulator() for s in specs}
        self.final_only: dict[str, RequestOutput] = {}
        self.num_finished = dict.fromkeys(self.specs, 0)
        self.with_prompt_logprobs = dict.fromkeys(self.specs, 0)  # outputs carrying prompt logprobs
        self.aborted: set[str] = set()

    def add(self, out: RequestOutput) -> None:
        rid = out.request_id
        assert rid in self.current, f"an output for unknown request {rid!r}"
        key = self.current[rid]
        assert self.num_finished[key] == 0, f"{rid} ({key}): an output after its finished one"
        assert out.error is None, f"{rid}: {out.error}"
        if self.specs[key].params.output_kind is FINAL_ONLY:
            assert out.finished and key not in self.final_only, f"{key}: FINAL_ONLY gave an unfinished or second output"
            self.final_only[key] = out
        else:
            self.deltas[key].add(out)
        self.num_finished[key] += out.finished
        self.with_prompt_logprobs[key] += out.prompt_logprobs is not None

    def whole(self, key: str) -> RequestOutput:
        return self.final_only[key] if key in self.final_only else self.deltas[key].outputs[self.specs[key].request_id]


def drive(engine, specs: list[Spec], rng: np.random.Generator) -> Record:
    """Add, abort and step at random until every request has finished; KV invariants after each.
    Some requests take the id of one that has finished (`Spec.request_id` is set when added)."""
    record = Record(specs)
    queue = list(specs)
    live: list[str] = []  # request ids added whose final output was not seen yet
    done: list[str] = []  # request ids whose request finished (and were not reused since)
    for _ in range(5000):
        if not queue and not engine.has_unfinished_requests():
            break
        u = rng.random()
        if queue and (u < 0.3 or not engine.has_unfinished_requests()):
            spec = queue.pop(0)
            spec.request_id = done.pop(int(rng.integers(len(done)))) if done and rng.random() < 0.2 else spec.key
            assert engine.add_request(spec.prompt, spec.params, spec.request_id, spec.namespace) == spec.request_id
            record.current[spec.request_id] = spec.key
            live.append(spec.request_id)
        elif 0.3 <= u < 0.34 and (live or done):
            rid = str(rng.choice(done if done and (not live or rng.random() < 0.2) else live))
            out = engine.abort(rid)
            if rid in done:
                assert out is None, f"abort of finished {rid} returned an output"
            else:
                assert out is not None and out.finished and out.request_id == rid
                record.aborted.add(record.current[rid])
                record.add(out)
            engine.check_kv_invariants()
        else:
            for out in engine.step():
                record.add(out)
            engine.check_kv_invariants()
        for rid in [r for r in live if record.num_finished[record.current[r]]]:
            live.remove(rid)
            done.append(rid)
    else:
        pytest.fail("the run did not finish")
    assert engine.step() == []  # completes a step still in flight (asynchronous scheduling): nothing of it is due
    return record


@pytest.fixture(scope="module")
def solo_engine():
    """The reference for seeded samples: each request run alone, prefix caching off (same shapes as
    the engines under test, so nothing more is compiled)."""
    return tiny_engine(PRESET, **CONFIG, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def solo(solo_engine):
    cache: dict = {}

    def run(spec: Spec) -> RequestOutput:
        params = dataclasses.replace(spec.params, output_kind=DELTA)
        key = (tuple(spec.prompt), repr(params))
        if key not in cache:
            cache[key] = drain(solo_engine, [solo_engine.add_request(spec.prompt, params)])[0]
        return cache[key]

    return run


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("seed, async_scheduling, prefix_caching, extra", SCENARIOS, ids=map(scenario_id, SCENARIOS))
def test_random_interleavings_match_the_references(seed, async_scheduling, prefix_caching, extra, solo):
    rng = np.random.default_rng(seed)
    specs = random_specs(rng, 36)
    engine = tiny_engine(PRESET, **{**CONFIG, **extra}, async_scheduling=async_scheduling,
                         enable_prefix_caching=prefix_caching)
    evictions = []
    if prefix_caching:  # count evictions (the pool is small: they must happen)
        evict = engine.kv.prefix_cache.evict
        engine.kv.prefix_cache.evict = lambda n: evictions.append(evict(n)) or evictions[-1]
    record = drive(engine, specs, rng)

    outputs = {s.key: record.whole(s.key) for s in specs}
    for spec in specs:
        rid, params = spec.key, spec.params
        out = outputs[rid]
        assert out.request_id == spec.request_id
        assert record.num_finished[rid] == 1, f"{rid}: {record.num_finished[rid]} finished outputs"
        assert out.finished and out.prompt_token_ids == spec.prompt
        if params.prompt_logprobs is None:
            assert out.prompt_logprobs is None and record.with_prompt_logprobs[rid] == 0
        else:
            assert record.with_prompt_logprobs[rid] == 1 and out.num_cached_tokens == 0, rid
            check_prompt_logprobs(engine, spec.prompt, params.prompt_logprobs, out.prompt_logprobs,
                                  whole=rid not in record.aborted)
        assert out.metrics.num_generation_tokens == sum(len(c.token_ids) for c in out.outputs)
        indices = [c.index for c in out.outputs]
        assert indices == list(range(params.n)), f"{rid}: samples {indices}"
        reference = solo(spec) if params.temperature > 0 else None
        for c in out.outputs:
            where = f"{rid} ({spec.request_id}) sample {c.index} ({params})"
            tokens = c.token_ids
            end = expected_end(spec.prompt, params, tokens)
            if c.finish_reason == "abort":
                assert rid in record.aborted, f"{where}: aborted but never asked to be"
                assert end is None, f"{where}: aborted after its end {end}"
                assert c.text == "".join(map(token_text, tokens)), where
            else:
                assert end is not None and end[0] == len(tokens) - 1, f"{where}: ends at {len(tokens)}, rules say {end}"
                assert (c.finish_reason, c.stop_reason, c.text) == end[1:], f"{where}: {tokens}"
            if reference is None:
                check_greedy(engine, spec.prompt, params, tokens, where)
                continue
            # seeded: the draws of the dense reference, and the tokens of the request run alone up to
            # the first position where the two runs' float noise could decide the draw
            ties = check_sampled(engine, spec.prompt, params, c.index, tokens, where)
            ref = reference.outputs[c.index]
            diverge = next((i for i, (a, b) in enumerate(zip(tokens, ref.token_ids)) if a != b), None)
            if diverge is not None:
                assert diverge in ties, f"{where}: {tokens} differs from the run alone {ref.token_ids} at {diverge}"
            elif c.finish_reason == "abort":
                assert len(tokens) <= len(ref.token_ids), f"{where}: {tokens} outlived the run alone {ref.token_ids}"
            else:
                assert (tokens, c.finish_reason, c.stop_reason, c.text) == \
                    (ref.token_ids, ref.finish_reason, ref.stop_reason, ref.text), where
        # cached prompt tokens: only what requests of the same namespace (this one included) computed
        if not prefix_caching:
            assert out.num_cached_tokens == 0
        else:
            sources = [s.prompt + c.token_ids for s in specs if s.namespace == spec.namespace
                       for c in outputs[s.key].outputs]
            bound = max(common_prefix(spec.prompt, seq) for seq in sources)
            bound = min(bound, len(spec.prompt) - 1) // BLOCK * BLOCK
            assert out.num_cached_tokens <= bound, f"{rid}: {out.num_cached_tokens} cached tokens, at most {bound}"

    # nothing is left behind: no blocks held, no per-request state anywhere
    scheduler, kv = engine.scheduler, engine.kv
    assert not engine.has_unfinished_requests() and not engine._parents and engine._inflight is None
    assert not scheduler.running and not scheduler.waiting and not scheduler.batch
    assert sorted(scheduler._free_rows) == list(range(CONFIG["max_num_seqs"])) and scheduler._last_decodes is None
    assert not kv._seqs and kv._group is None and kv._num_seq_tokens == 0
    engine.check_kv_invariants()
    usage = kv.usage()
    assert usage.used == 0 and usage.cached + usage.free == usage.num_blocks
    assert kv.reset_prefix_cache()
    usage = kv.usage()
    assert usage.free == usage.num_blocks == engine.num_blocks - 1 and usage.cached == 0
    engine.check_kv_invariants()

    # the run exercised what it is meant to
    assert scheduler.num_preemptions > 0
    assert record.aborted
    if prefix_caching:
        assert sum(evictions) > 0 and kv.stats().hit_tokens > 0
