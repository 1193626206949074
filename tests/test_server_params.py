"""The HTTP API's sampling fields take effect: `stop` (and the response's `stop_reason`), `top_k`,
`min_p`, `min_tokens`, `include_stop_str_in_output` and `skip_special_tokens`, each sent through a real
server on a tiny random model and compared with what an offline engine of the same weights (not the
server's) generates for the same `SamplingParams`. Each case first checks that the field changes the
offline output, so a server that dropped the field could not pass.

Prompts are token ids (no tokenization on either side); requests go one at a time, so the server's
engine computes them in the same batch shapes as the offline engine. Greedy where the field can be
seen greedily, else seeded sampling at temperature 1 (a seeded request draws the same tokens in any
engine). `skip_special_tokens` needs a tokenizer with special tokens that decode to text (the tiny
presets' `CharTokenizer` renders every special id as ""), so it runs on an engine whose tokenizer is
a small HF word-level tokenizer with one id in four special.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from llmjax.config import EngineConfig
from llmjax.engine import LLMEngine
from llmjax.models.loader import load_model
from llmjax.outputs import CompletionOutput
from llmjax.sampling_params import SamplingParams
from llmjax.serve.api import build_app
from tests.engine_helpers import REF_LEN, run_to_completion, tiny_engine
from tests.server_helpers import running_server

MODEL = "tiny"
PROMPT = np.random.default_rng(7).integers(3, 250, size=20).tolist()
ENGINE_ARGS = {"kv_cache_memory_bytes": 4 << 20}  # the server's and the offline engines' configuration
GREEDY = {"temperature": 0.0, "max_tokens": 30, "ignore_eos": True}
SAMPLED = {"temperature": 1.0, "seed": 123, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def client():
    app = build_app(tiny_engine(**ENGINE_ARGS), MODEL)
    with running_server(app) as url, httpx.Client(base_url=url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline():
    """A second engine with the server engine's weights and configuration."""
    return tiny_engine(**ENGINE_ARGS)


def generate(engine: LLMEngine, prompt: list[int] = PROMPT, **params) -> CompletionOutput:
    return run_to_completion(engine, [prompt], SamplingParams(**params))[0].outputs[0]


def complete(client: httpx.Client, prompt: list[int] = PROMPT, **body) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, **body})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    return choice


def assert_same(choice: dict, expected: CompletionOutput) -> None:
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == \
        (expected.text, expected.finish_reason, expected.stop_reason)


def first_new_substring(text: str, start: int = 6) -> str:
    """Two characters of `text` that first occur at or after `start` (so a stop there cuts the text)."""
    for i in range(start, len(text) - 1):
        if text.find(text[i : i + 2]) == i:
            return text[i : i + 2]
    raise AssertionError(f"no new two-character string in {text!r}")


@pytest.mark.parametrize("as_list", [False, True], ids=["string", "list"])
def test_stop_cuts_the_text_and_names_the_stop_reason(client, offline, as_list):
    full = generate(offline, **GREEDY)
    stop = first_new_substring(full.text)
    expected = generate(offline, **GREEDY, stop=[stop])
    assert expected.text == full.text[: full.text.find(stop)] != full.text  # the field matters
    assert expected.finish_reason == "stop" and expected.stop_reason == stop
    choice = complete(client, **GREEDY, stop=[stop, "\x7f\x7f"] if as_list else stop)
    assert_same(choice, expected)


def test_stop_reason_of_a_stop_token_id(client, offline):
    full = generate(offline, **GREEDY)
    stop_id = full.token_ids[5]
    expected = generate(offline, **GREEDY, stop_token_ids=[stop_id])
    assert len(expected.token_ids) < len(full.token_ids) and expected.stop_reason == stop_id
    choice = complete(client, **GREEDY, stop_token_ids=[stop_id])
    assert_same(choice, expected)
    assert isinstance(choice["stop_reason"], int)


def test_stop_in_a_chat_completion(client, offline):
    messages = [{"role": "user", "content": "Count to ten."}]
    prompt = offline.tokenizer.encode_chat(messages)
    full = generate(offline, prompt, **GREEDY)
    stop = first_new_substring(full.text)
    expected = generate(offline, prompt, **GREEDY, stop=[stop])
    assert expected.text != full.text and expected.stop_reason == stop
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, **GREEDY, "stop": [stop]})
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    assert (choice["message"]["content"], choice["finish_reason"], choice["stop_reason"]) == \
        (expected.text, "stop", stop)


def test_include_stop_str_in_output(client, offline):
    full = generate(offline, **GREEDY)
    stop = first_new_substring(full.text)
    expected = generate(offline, **GREEDY, stop=[stop], include_stop_str_in_output=True)
    assert expected.text == full.text[: full.text.find(stop) + len(stop)]  # the field matters
    assert expected.text.endswith(stop) and expected.stop_reason == stop
    assert_same(complete(client, **GREEDY, stop=[stop], include_stop_str_in_output=True), expected)


def test_min_tokens_holds_back_a_stop_token(client, offline):
    """Greedy decoding stops on its first token; with min_tokens it cannot before that many tokens."""
    full = generate(offline, **GREEDY)
    stop_id = full.token_ids[0]
    stopped = generate(offline, **GREEDY, stop_token_ids=[stop_id])
    expected = generate(offline, **GREEDY, stop_token_ids=[stop_id], min_tokens=6)
    assert len(stopped.token_ids) == 1 and len(expected.token_ids) >= 6  # the field matters
    assert expected.token_ids[:6].count(stop_id) == 0
    choice = complete(client, **GREEDY, stop_token_ids=[stop_id], min_tokens=6)
    assert_same(choice, expected)


@pytest.mark.parametrize("field, value", [("top_k", 3), ("top_k", 40), ("min_p", 0.3), ("min_p", 0.8)])
def test_filters_change_a_seeded_sample(client, offline, field, value):
    """top_k / min_p restrict a seeded draw at temperature 1: the server's text is the offline engine's
    for the same seed and filter, which differs from the unfiltered draw."""
    unfiltered = generate(offline, **SAMPLED)
    expected = generate(offline, **SAMPLED, **{field: value})
    assert expected.text != unfiltered.text  # the field matters
    assert complete(client, **SAMPLED, **{field: value})["text"] == expected.text
    assert complete(client, **SAMPLED)["text"] == unfiltered.text  # and the seed alone reproduces the draw


# --- skip_special_tokens: a tokenizer whose special tokens have text -----------------------------------
def word_level_tokenizer(vocab_size: int):
    """A HF fast tokenizer over `vocab_size` words: 0 <pad>, 1 <s>, 2 </s>, every other id divisible by 4
    a special token "<spN>", the rest plain words."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    from llmjax.tokenizer import Tokenizer

    names = [{0: "<pad>", 1: "<s>", 2: "</s>"}.get(i, f"<sp{i}>" if i % 4 == 0 else f"w{i}") for i in range(vocab_size)]
    raw = RawTokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="<pad>"))
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                 unk_token="<pad>", additional_special_tokens=names[4::4])
    return Tokenizer(hf, (2,))


def word_level_engine() -> LLMEngine:
    model = load_model("tiny-gqa")
    config = EngineConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=8, max_model_len=REF_LEN,
                          attention_backend="xla", dtype="float32", **ENGINE_ARGS)
    return LLMEngine(model, word_level_tokenizer(model.config.vocab_size), config)


def test_skip_special_tokens():
    offline = word_level_engine()
    kept = generate(offline, **SAMPLED, skip_special_tokens=False)
    skipped = generate(offline, **SAMPLED, skip_special_tokens=True)
    assert kept.token_ids == skipped.token_ids and any(t % 4 == 0 for t in kept.token_ids)
    assert "<sp" in kept.text and "<sp" not in skipped.text  # the field matters
    with running_server(build_app(word_level_engine(), MODEL)) as url, httpx.Client(base_url=url, timeout=120) as c:
        for expected, skip in ((kept, False), (skipped, True)):
            choice = complete(c, **SAMPLED, skip_special_tokens=skip)
            assert choice["text"] == expected.text, skip
        assert complete(c, **SAMPLED)["text"] == skipped.text  # skipping is the default


def test_an_omitted_field_means_what_it_means_offline():
    """A sampling field the API and `SamplingParams` share has one default in both (the API's are
    OpenAI's, written out in its schema), so a request that leaves it out samples as `SamplingParams()`."""
    import dataclasses

    from llmjax.serve.protocol import CompletionRequest

    offline = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
               for f in dataclasses.fields(SamplingParams)}
    shared = [name for name in CompletionRequest.model_fields if name in offline]
    assert len(shared) >= 15, shared
    for name in shared:
        api_default = CompletionRequest.model_fields[name].default
        assert api_default == offline[name] or (api_default is None and offline[name] in ((), [])), name


def test_the_models_generation_config_fills_the_fields_a_request_leaves_out(offline):
    """A model's generation_config.json defaults (`LLMEngine.generation_defaults`, read by the loader)
    apply to the fields a request does not send; a sent field wins; its max_tokens caps the request's."""
    engine = tiny_engine(**ENGINE_ARGS)
    engine.generation_defaults = {"temperature": 0.0, "top_k": 3, "max_tokens": 5}
    greedy = generate(offline, temperature=0.0, max_tokens=5, ignore_eos=True)
    filtered = generate(offline, **{**SAMPLED, "max_tokens": 5}, top_k=3)
    assert filtered.text != generate(offline, **{**SAMPLED, "max_tokens": 5}).text  # the default top_k matters
    with running_server(build_app(engine, MODEL)) as url, httpx.Client(base_url=url, timeout=120) as c:
        choice = complete(c, ignore_eos=True)  # OpenAI's default max_tokens, 16, capped at 5
        assert (choice["text"], len(greedy.token_ids)) == (greedy.text, 5)
        assert complete(c, **SAMPLED)["text"] == filtered.text  # its own temperature and seed, the default top_k
