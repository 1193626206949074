"""The offline API speaks vLLM: prompt forms, the `RequestOutput` shape, delta outputs from
`LLMEngine.step()`, and parallel sampling (`n` > 1) computing the shared prompt once."""

import jax
import numpy as np
import pytest

from llmjax.config import ConfigError, EngineConfig
from llmjax.engine import LLMEngine, RequestError
from llmjax.llm import LLM
from llmjax.sampling_params import SamplingParams
from tests.engine_helpers import GREEDY, REF_LEN, dense_greedy, dense_logits, drain

RNG = np.random.default_rng(5)
PROMPT = RNG.integers(3, 250, size=40).tolist()  # 5 whole blocks of 8


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-gqa", engine_config=EngineConfig(
        max_num_batched_tokens=64, max_num_seqs=8, block_size=8, max_model_len=REF_LEN,
        kv_cache_memory_bytes=2 << 20, attention_backend="xla", dtype="float32"))


def test_prompt_forms_and_output_shape(llm):
    text = "hello world"
    ids = llm.tokenizer.encode(text)
    outs = llm.generate([text, {"prompt": text}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    expected, _ = dense_greedy(llm.engine, ids, GREEDY.max_tokens)
    for out in outs:
        assert out.finished and out.error is None and out.prompt_token_ids == ids
        [c] = out.outputs
        assert c.index == 0 and c.token_ids == expected and c.finish_reason == "length" and c.stop_reason is None
        assert c.text == llm.tokenizer.decode(expected) and c.logprobs is None and c.cumulative_logprob is None
        m = out.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
        assert len(m.token_times) == len(c.token_ids) and m.token_times == sorted(m.token_times)
        assert m.num_preemptions == 0 and m.num_generation_tokens == len(c.token_ids)
    assert [o.prompt for o in outs] == [text, text, None]
    [single] = llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)
    assert single.outputs[0].token_ids == expected
    assert single.num_cached_tokens == (len(ids) - 1) // 8 * 8  # the earlier runs' full pages
    for bare in (ids, [ids]):  # token ids without a mapping, one prompt or a list of them, as vLLM takes them
        [out] = llm.generate(bare, GREEDY, use_tqdm=False)
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == expected
    with pytest.raises(TypeError, match="a prompt or a list of them"):
        llm.generate(None, GREEDY)
    with pytest.raises(TypeError, match="LLM.chat"):
        llm.generate([[{"role": "user", "content": "hi"}]], GREEDY)
    for bad in ([1.9, 2.2], [True, 504], 504):  # never turned into other ids
        with pytest.raises(RequestError, match="integer token ids"):
            llm.generate({"prompt_token_ids": bad}, GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="prompt_token_ids"):  # a string is no list of ids (nor text here)
        llm.generate({"prompt_token_ids": "504"}, GREEDY, use_tqdm=False)
    for bad in ("x", {"temperature": 0}, [GREEDY, {"temperature": 0}], 0.5):
        with pytest.raises(TypeError, match="a SamplingParams or a list of them"):
            llm.generate([text, text], bad, use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate([text, text], [GREEDY], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_a_prompts_cache_salt_is_its_tenant(llm):
    """vLLM's `"cache_salt"` in a prompt mapping: a request finds only its own tenant's cached pages;
    a bad salt is refused with nothing queued."""
    text = "a shared prefix of forty characters, more"
    full_pages = (len(llm.tokenizer.encode(text)) - 1) // 8 * 8
    llm.engine.kv.reset_prefix_cache()
    runs = [[{"prompt": text, "cache_salt": "a"}], [{"prompt": text, "cache_salt": "b"}, {"prompt": text}],
            [{"prompt": text, "cache_salt": "a"}, {"prompt_token_ids": llm.tokenizer.encode(text), "cache_salt": "b"}]]
    cached = [[o.num_cached_tokens for o in llm.generate(run, GREEDY, use_tqdm=False)] for run in runs]
    assert cached == [[0], [0, 0], [full_pages, full_pages]]
    for bad in ("", 7):
        with pytest.raises(RequestError, match="cache_salt"):
            llm.generate([{"prompt": text, "cache_salt": "ok"}, {"prompt": text, "cache_salt": bad}], GREEDY,
                         use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def char_ids(text: str) -> list[int]:
    """CharTokenizer's documented ids: printable ASCII c -> 3 + ord(c) - 32; anything else is '?'."""
    return [3 + (ord(c) if 32 <= ord(c) < 127 else ord("?")) - 32 for c in text]


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
    [{"role": "user", "content": ""}],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_renders_the_template(llm, add_generation_prompt):
    """CharTokenizer's chat format: BOS, then "<role>content\n" per message, then "<assistant>" when
    `add_generation_prompt`; one output per conversation, in order, continuing that prompt greedily."""
    outs = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False, add_generation_prompt=add_generation_prompt)
    assert len(outs) == len(CONVERSATIONS)
    for conversation, out in zip(CONVERSATIONS, outs):
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in conversation)
        text += "<assistant>" if add_generation_prompt else ""
        expected = [1] + char_ids(text)
        assert out.prompt_token_ids == expected and out.prompt == text  # the rendered conversation, as vLLM's
        tokens = out.outputs[0].token_ids  # greedy: each the argmax of the dense reference (up to near-ties)
        logits = dense_logits(llm.engine, expected + tokens)[len(expected) - 1 : -1]
        assert len(tokens) == GREEDY.max_tokens
        assert all(logits[i, t] > logits[i].max() - 1e-4 for i, t in enumerate(tokens)), tokens
    # one conversation, not a list of them
    [single] = llm.chat(CONVERSATIONS[1], GREEDY, use_tqdm=False, add_generation_prompt=add_generation_prompt)
    assert single.prompt_token_ids == outs[1].prompt_token_ids
    with pytest.raises(TypeError, match="add_generation_prompt is True or False"):  # "no" is not False
        llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False, add_generation_prompt="no")


def test_chat_takes_openai_text_parts_joined_by_newlines(llm):
    """vLLM's LLM.chat (and our server) take a message's content as OpenAI content parts; text parts
    reach the template joined by newlines."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]}]
    one = SamplingParams(max_tokens=1)
    [out] = llm.chat(parts, one, use_tqdm=False)
    assert out.prompt_token_ids == [1] + char_ids("<user>What is\n2+2?\n<assistant>")
    [out] = llm.chat([[{"role": "system", "content": []}, *parts]], one, use_tqdm=False)
    assert out.prompt_token_ids == [1] + char_ids("<system>\n<user>What is\n2+2?\n<assistant>")


IMAGE = {"type": "image_url", "image_url": {"url": "http://example.com/cat.png"}}


@pytest.mark.parametrize("conversations, message", [
    # the server's 400 for the same message: param messages.0.content.0.type (tests/test_server.py)
    ([{"role": "user", "content": [IMAGE]}], r"^messages\.0\.content\.0\.type: Input should be 'text'"),
    ([[{"role": "user", "content": "ok"}], [{"role": "user", "content": "ok"}, {"role": "user", "content": [IMAGE]}]],
     r"^messages\.1\.1\.content\.0\.type: Input should be 'text'"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"^messages\.0\.content\.0\.text: Field required"),
    ([{"role": "user"}], r"^messages\.0\.content: Field required"),
    (["hi"], r"^messages\.0: a conversation is a list of messages"),
    ([[{"role": "user", "content": "ok"}], "hi"], r"^messages\.1: a conversation is a list of messages"),
    ([["hi"]], r"^messages\.0\.0: a message is a mapping"),
    ([{"content": "hi"}], r"^messages\.0\.role: a message's role is a string"),
])
def test_chat_refuses_other_content_with_the_servers_message(llm, conversations, message):
    with pytest.raises(ValueError, match=message):
        llm.chat(conversations, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing queued, the next call unharmed
    [out] = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.prompt_token_ids == [1] + char_ids("<user>hi\n<assistant>")


def test_chat_continues_the_final_message(llm):
    """vLLM's `continue_final_message`: the prompt ends with the last message's text, not its end of
    turn, so the reply goes on with it; it needs `add_generation_prompt=False`, as in vLLM."""
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    [out] = llm.chat(messages=conversation, sampling_params=SamplingParams(max_tokens=1), use_tqdm=False,
                     add_generation_prompt=False, continue_final_message=True)
    assert out.prompt == "<user>hi\n<assistant>Sure, " and out.prompt_token_ids == [1] + char_ids(out.prompt)
    with pytest.raises(ValueError, match="^messages: continue_final_message and add_generation_prompt cannot both"):
        llm.chat(conversation, GREEDY, use_tqdm=False, continue_final_message=True)
    with pytest.raises(ValueError, match=r"^messages\.1: continue_final_message needs a last message"):
        llm.chat([conversation, [{"role": "user", "content": " "}]], GREEDY, use_tqdm=False,
                 add_generation_prompt=False, continue_final_message=True)
    with pytest.raises(TypeError, match="continue_final_message is True or False"):
        llm.chat(conversation, GREEDY, use_tqdm=False, add_generation_prompt=False, continue_final_message=1)
    assert not llm.engine.has_unfinished_requests()


def test_chat_takes_a_name_of_none_as_none_and_refuses_another_kind(llm):
    """As the server's `ChatMessage`: `name: None` is no name; a name that is no string is refused."""
    [out] = llm.chat([{"role": "user", "content": "hi", "name": None}], SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.prompt_token_ids == [1] + char_ids("<user>hi\n<assistant>")
    with pytest.raises(ValueError, match=r"^messages\.0\.name: a message's name is a string"):
        llm.chat([{"role": "user", "content": "hi", "name": 3}], GREEDY, use_tqdm=False)


def test_chat_reads_developer_as_system_as_the_server_does(llm):
    [out] = llm.chat([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                     SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.prompt_token_ids == [1] + char_ids("<system>Be brief.\n<user>hi\n<assistant>")


def test_use_tqdm_takes_vllms_bar_factory_and_refuses_other_values(llm):
    from tqdm import tqdm

    made = []

    def bar(*args, **kwargs):
        made.append(kwargs["total"])
        return tqdm(*args, **kwargs)

    llm.generate(["a", "b"], SamplingParams(max_tokens=1), use_tqdm=bar)
    assert made == [2]
    with pytest.raises(TypeError, match="use_tqdm"):
        llm.generate("a", SamplingParams(max_tokens=1), use_tqdm="no")


def test_an_interrupted_generate_aborts_its_requests(llm, monkeypatch):
    """Ctrl-C while generating: the requests it queued are aborted, so the next call runs only its own."""
    engine, step, calls = llm.engine, llm.engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b", "c"], SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
    monkeypatch.undo()
    assert not engine.has_unfinished_requests()
    engine.check_kv_invariants()
    before = engine.num_generation_tokens
    llm.generate("d", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert engine.num_generation_tokens - before == 3


def test_a_refused_generate_changes_nothing_a_later_request_samples():
    """A call refused for its last prompt queues nothing and draws no seed: the next unseeded request
    samples what it would have sampled on an engine that never saw the refused call."""
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=8, max_model_len=REF_LEN,
                          kv_cache_memory_bytes=2 << 20, attention_backend="xla", dtype="float32")
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    fresh, refused = LLM("tiny-gqa", engine_config=config), LLM("tiny-gqa", engine_config=config)
    with pytest.raises(RequestError, match="prompt") as refusal:
        refused.generate(["x", "y", ""], params, use_tqdm=False)
    assert refusal.value.__notes__ == ["request 2 of the 3 given (from 0); none of them was added"]
    assert not refused.engine.has_unfinished_requests() and refused.engine.kv.usage().used == 0
    [expected], [got] = (llm.generate("x", params, use_tqdm=False) for llm in (fresh, refused))
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids


def test_get_tokenizer_is_the_engines(llm):
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.engine.tokenizer
    assert tokenizer.encode("hi") == [1] + char_ids("hi")  # CharTokenizer: BOS, then one id a character


def test_logprobs_and_cumulative_logprob(llm):
    [out] = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=1.0, seed=3, max_tokens=6,
                                                                      ignore_eos=True, logprobs=2), use_tqdm=False)
    [c] = out.outputs
    assert len(c.logprobs) == 6 and all(len(e) in (2, 3) and t in e for t, e in zip(c.token_ids, c.logprobs))
    assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)), rel=1e-5)



def test_generate_returns_prompt_logprobs(llm):
    """`prompt_logprobs` through `LLM.generate`, vLLM's shape: None for the first prompt token, then
    {id: Logprob} with the prompt's token first: the dense model's; none unless asked for."""
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    [out, plain] = llm.generate([{"prompt_token_ids": PROMPT}, "abc"],
                                [params, SamplingParams(max_tokens=2)], use_tqdm=False)
    assert plain.prompt_logprobs is None
    entries = out.prompt_logprobs
    assert len(entries) == len(PROMPT) and entries[0] is None
    ref = np.asarray(jax.nn.log_softmax(dense_logits(llm.engine, PROMPT), axis=-1))
    for t in range(1, len(PROMPT)):
        assert next(iter(entries[t])) == PROMPT[t] and len(entries[t]) in (1, 2)
        np.testing.assert_allclose([e.logprob for e in entries[t].values()], ref[t - 1, list(entries[t])], atol=2e-5)
        assert max(e.logprob for e in entries[t].values()) == pytest.approx(ref[t - 1].max(), abs=2e-5)

def test_step_returns_deltas(llm):
    engine = llm.engine
    rid = engine.add_request(PROMPT, GREEDY)
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    assert all(len(d.outputs) == 1 and len(d.outputs[0].token_ids) == 1 for d in deltas)
    assert [d.outputs[0].token_ids[0] for d in deltas] == dense_greedy(engine, PROMPT, GREEDY.max_tokens)[0]
    assert "".join(d.outputs[0].text for d in deltas) == engine.tokenizer.decode(
        [d.outputs[0].token_ids[0] for d in deltas])
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    assert all(d.metrics is deltas[-1].metrics for d in deltas)  # one live record, never copied per step
    assert len(deltas[-1].metrics.token_times) == 12 and deltas[-1].metrics.finish_time is not None
    assert deltas[-1].metrics.num_generation_tokens == 12
    assert deltas[-1].request_id == rid


def test_parallel_sampling_computes_the_prompt_once(llm):
    engine = llm.engine
    engine.kv.reset_prefix_cache()
    computed = []
    original = engine.runner.dispatch

    def counting(out, previous=None):
        computed.append(int(out.num_new_tokens[out.num_new_tokens > 1].sum()))
        return original(out, previous)

    engine.runner.dispatch = counting
    try:
        before = engine.kv.stats()
        n = 4
        params = SamplingParams(n=n, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
        [out] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
        after = engine.kv.stats()
    finally:
        engine.runner.dispatch = original
    assert [c.index for c in out.outputs] == list(range(n))
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == n  # distinct streams per sample
    # sample 0 computes the 40-token prompt; each sibling finds 4 full pages (32 tokens; the last
    # prompt token is always computed) and computes 8
    assert after.hit_tokens - before.hit_tokens == (n - 1) * 32
    assert sum(computed) == 40 + (n - 1) * 8
    assert out.num_cached_tokens == 0 and engine.kv.usage().used == 0
    assert engine.num_held_samples == 0  # released, each counted as waiting until then
    # the samples are reproducible: sample 0 is the n=1 request with the same seed
    [one] = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=1.0, seed=11, max_tokens=8,
                                                                      ignore_eos=True), use_tqdm=False)
    assert one.outputs[0].token_ids == out.outputs[0].token_ids


def test_parallel_greedy_samples_equal_the_reference_and_abort_frees_all(llm):
    engine = llm.engine
    params = SamplingParams(n=3, temperature=0.0, max_tokens=12, ignore_eos=True)
    [out] = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    expected, _ = dense_greedy(engine, PROMPT, 12)
    assert [c.token_ids for c in out.outputs] == [expected] * 3  # siblings read the shared KV blocks
    rid = engine.add_request(PROMPT[:20], params)
    engine.step()
    final = engine.abort(rid)
    assert final.finished and {c.index for c in final.outputs} == {0, 1, 2}
    assert all(c.finish_reason == "abort" for c in final.outputs)
    assert not engine.has_unfinished_requests() and engine.kv.usage().used == 0
    engine.check_kv_invariants()
    assert drain(engine, []) == []


def test_accumulator_folds_deltas_without_mutating_them():
    from llmjax.outputs import CompletionOutput, OutputAccumulator, RequestMetrics, RequestOutput

    def delta(parts, finished=False):
        return RequestOutput("r", None, [1, 2], [CompletionOutput(i, t, ids, -float(len(ids)), [{x: -1.0} for x in ids],
                                                                  "length" if finished else None)
                                                 for i, t, ids in parts],
                             finished, RequestMetrics(0.0, token_times=[1.0, 2.0] if finished else []))

    deltas = [delta([(1, "b", [7])]), delta([(0, "a", [5]), (1, "c", [8])]), delta([(0, "d", [6])], finished=True)]
    snapshot = repr(deltas)
    acc = OutputAccumulator()
    for d in deltas:
        whole = acc.add(d)
    assert repr(deltas) == snapshot
    assert [(c.index, c.text, c.token_ids, len(c.logprobs)) for c in whole.outputs] == [(0, "ad", [5, 6], 2),
                                                                                       (1, "bc", [7, 8], 2)]
    assert whole.finished and whole.metrics.token_times == [1.0, 2.0] and whole.outputs[0].cumulative_logprob == -1.0


def test_llm_seed_and_engine_args_reach_the_engine_config():
    """`LLM(seed=)` is vLLM's: it also seeds the sampling of requests without their own seed
    (`EngineConfig.seed`, which `test_engine_seed_fixes_unseeded_sampling` shows decides them);
    keyword args apply over an `engine_config`, and a name that is no field is an error."""
    base = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=8, max_model_len=REF_LEN,
                        kv_cache_memory_bytes=2 << 20, attention_backend="xla", dtype="float32", seed=3)
    config = LLM("tiny-gqa", seed=5, engine_config=base, max_num_seqs=4, async_scheduling=True).engine.config
    assert (config.seed, config.max_num_seqs, config.async_scheduling, config.block_size) == (5, 4, True, 8)
    assert LLM("tiny-gqa", engine_config=base).engine.config.seed == 3  # no seed given: the config's
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM("tiny-gqa", engine_config=base, max_num_seq=4)


@pytest.mark.parametrize("args, flag", [(dict(stream_interval=4), "stream_interval"),
                                        (dict(scheduling_policy="dynamic", batch_size=4, max_delay=30.0), "max_delay")])
def test_llm_refuses_settings_that_would_have_no_effect(args, flag, monkeypatch):
    # outputs are returned whole and every prompt is queued at once; refused before the model loads
    monkeypatch.setattr(LLMEngine, "from_config", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(ConfigError, match=f"{flag} has no effect"):
        LLM("tiny-gqa", **args)
    LLM._check_offline(EngineConfig(scheduling_policy="dynamic", batch_size=4))  # its defaults: fine


def test_min_tokens_beyond_the_context_left_stops_at_max_model_len_as_max_tokens_does(llm):
    """With `max_tokens` unset (up to max_model_len), a `min_tokens` beyond the context the prompt
    leaves is served as an explicit `max_tokens` beyond it is: it stops at max_model_len."""
    prompt = list(range(3, REF_LEN - 8 + 3))  # leaves 8 tokens of context
    for params in (SamplingParams(min_tokens=20, max_tokens=None), SamplingParams(min_tokens=20, max_tokens=30)):
        [out] = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"
