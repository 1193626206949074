"""End to end on the embedded SmolLM2-135M-Instruct GGUF file, against HF transformers' own GGUF loading.

Tolerance: both sides dequantize the same Q4_1/Q8_0 blocks to float32, so the weights are equal and
only float32 summation order differs (30 layers); observed logit differences are ~1e-4 on logits of
magnitude ~30, so we allow 2e-3 absolute and require identical greedy tokens.
"""

import numpy as np
import pytest
import torch

from llmjax.config import EngineConfig
from llmjax.engine import LLMEngine
from llmjax.models.loader import embedded_model_path, load_model
from llmjax.outputs import Logprob
from llmjax.sampling_params import RequestOutputKind, SamplingParams
from llmjax.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from tests.engine_helpers import assert_logprob_ranks_and_texts, drain

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "def fibonacci(n):",
    "Explain in one sentence why the sky is blue, and mention Rayleigh scattering by name.",
    "Translate 'good morning' into Spanish.",
    "The quick brown fox",
    "Once upon a time, in a small village at the edge of a vast forest, there lived an old clockmaker who",
    "2 + 2 =",
]


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = embedded_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer


@pytest.fixture(scope="module")
def ours():
    loaded = load_model(None)
    return loaded, load_tokenizer(loaded.source, loaded.config.eos_token_ids)


def test_logits_match_transformers(hf, ours):
    hf_model, hf_tok = hf
    loaded, _ = ours
    model = loaded.module()
    for prompt in PROMPTS[:4]:
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = hf_model(ids).logits[0].numpy()
        got = np.asarray(model(ids.numpy()))[0]
        np.testing.assert_allclose(got, expected, atol=2e-3, rtol=0)


def _hf_greedy(hf_model, ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def test_chat_template_matches_transformers(hf, ours):
    _, hf_tok = hf
    _, tokenizer = ours
    conversations = [
        [{"role": "user", "content": "Hi!"}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Why?"}],
        [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
         {"role": "user", "content": "And 3+3? Answer in ünïcödé."}],
    ]
    for messages in conversations:
        for add_generation_prompt in (True, False):
            expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
            assert tokenizer.chat_prompt(messages, add_generation_prompt) == expected
        expected_ids = hf_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert tokenizer.encode_chat(messages) == list(expected_ids)
    # continuing a reply: the last message's text without its end of turn, as HF (and vLLM) cut it
    for final in ("The capital of France is", "A list:\n", "  padded  "):
        messages = [{"role": "user", "content": "Go on."}, {"role": "assistant", "content": final}]
        expected = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                              continue_final_message=True)
        assert tokenizer.chat_prompt(messages, False, continue_final_message=True) == expected


# Jinja features HF's apply_chat_template gives templates: its tojson (no HTML escapes, non-ASCII kept),
# {% break %} / {% continue %}, strftime_now (Llama 3's date line), every special token by name,
# the {% generation %} block, and `tools` / `documents` defined as None
TEMPLATES = [
    "{% for m in messages %}{{ m['content'] | tojson }}{{ m | tojson(indent=2, sort_keys=true) }}{% endfor %}",
    "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}{{ m['content'] }}"
    "{% if loop.index >= 2 %}{% break %}{% endif %}{% endfor %}",
    "{{ bos_token }}{{ unk_token }}{{ pad_token }}Today: {{ strftime_now('%d %b %Y') }}{{ eos_token }}",
    "{% if tools is not none %}[TOOLS]{{ tools | tojson }}{% endif %}{% if documents is not none %}[DOCS]{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
    "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{% endfor %}",
]


@pytest.mark.parametrize("template", TEMPLATES)
def test_template_features_render_as_in_transformers(hf, ours, template):
    _, hf_tok = hf
    _, tokenizer = ours
    messages = [{"role": "system", "content": "<b>héllo</b> & \"ü\""}, {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    expected = hf_tok.apply_chat_template(messages, chat_template=template, tokenize=False)
    own = tokenizer.chat_template
    try:
        tokenizer.chat_template = template
        assert tokenizer.chat_prompt(messages, add_generation_prompt=False) == expected
    finally:
        tokenizer.chat_template = own


def test_detokenize_endpoint_and_echo_invert_tokenize_special_tokens_included(hf, ours):
    """`/detokenize` of what `/tokenize` gave for a rendered chat (its template's special tokens
    in it) is that text again, and equals transformers' decode of the ids, as vLLM's endpoint;
    so is the echoed prompt of a completion given those ids."""
    import asyncio

    from llmjax.serve import protocol as p
    from llmjax.serve.api import OpenAIServer

    _, hf_tok = hf
    loaded, tokenizer = ours
    engine = LLMEngine(loaded, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=64,
                                                       kv_cache_memory_bytes=8 << 20, dtype="float32"))
    server = OpenAIServer(engine, "smollm2")
    messages = [{"role": "user", "content": "Say ünïcödé 🙂"}]
    text = tokenizer.chat_prompt(messages)
    assert "<|im_start|>" in text
    tokens = asyncio.run(server.tokenize(p.TokenizeRequest(messages=messages))).tokens
    assert tokens == tokenizer.encode_chat(messages)
    detokenized = asyncio.run(server.detokenize(p.DetokenizeRequest(tokens=tokens))).prompt
    assert detokenized == text == hf_tok.decode(tokens, skip_special_tokens=False)
    # `echo` of a token-id prompt: its text as vLLM decodes it (HF's default keeps special tokens), so it
    # matches the echoed logprob tokens
    assert server._prompt_text(tokens) == hf_tok.decode(tokens) == text


def test_token_bytes_concatenate_to_the_decoded_text(hf, ours):
    """A token's bytes (chat logprobs' `bytes`) are its own: the bytes of a character split over two
    tokens come apart, and any token sequence's bytes are the UTF-8 of transformers' decode of it."""
    from llmjax.serve import protocol as p

    _, hf_tok = hf
    _, tokenizer = ours
    text = "Say ünïcödé 🙂 and 日本語, <|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(map(tokenizer.token_bytes, ids)) == text.encode()
    emoji = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(emoji) == 2 and all("\ufffd" in tokenizer.token_to_text(t) for t in emoji)
    logprobs = p.chat_logprobs(tokenizer.token_to_text, tokenizer.token_bytes, emoji,
                               [{t: Logprob(-1.0)} for t in emoji], 1).content
    assert bytes(logprobs[0].bytes + logprobs[1].bytes) == "🙂".encode()
    assert logprobs[0].top_logprobs[0].bytes == logprobs[0].bytes
    rng = np.random.default_rng(0)
    for _ in range(500):
        seq = rng.integers(0, len(hf_tok), rng.integers(1, 9)).tolist()
        assert b"".join(map(tokenizer.token_bytes, seq)).decode(errors="replace") == \
            hf_tok.decode(seq, skip_special_tokens=False), seq


def test_min_num_tokens_bounds_the_encoding_and_spares_encoding_a_text_beyond_the_limit(ours, monkeypatch):
    """`min_num_tokens` never exceeds the real encoding's length, also on texts its longest
    vocabulary entries cover (runs of spaces, `#`), special tokens and multi-byte characters; with
    `at_most`, a text it puts beyond the limit is refused without being encoded."""
    from llmjax.tokenizer import TextTooLong

    _, tokenizer = ours
    texts = [PROMPTS[0], "\n" + " " * 1000 + "x", "#" * 8000, "<|im_start|>" * 50, "日本語 🙂 ünï" * 40,
             "ĊĠĠĠ" * 100, "a"]
    for text in texts:
        assert 0 < tokenizer.min_num_tokens(text) <= len(tokenizer.encode(text, add_special_tokens=False)), text
    assert tokenizer.min_num_tokens("#" * 8000) * 2 > len(tokenizer.encode("#" * 8000))  # a bound, but not loose
    monkeypatch.setattr(tokenizer.hf, "encode", lambda *a, **k: pytest.fail("encoded a text beyond the limit"))
    with pytest.raises(TextTooLong) as refused:
        tokenizer.encode("hello world " * 200_000, at_most=2048)
    assert refused.value.min_num_tokens > 2048


def test_incremental_detokenizer_handles_split_multibyte_characters(ours):
    _, tokenizer = ours
    assert isinstance(tokenizer, Tokenizer)
    text = "Grüße aus Köln 🌍🚀 — 東京タワー ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(len(tokenizer.hf.decode([t])) and "\ufffd" in tokenizer.hf.decode([t]) for t in ids), (
        "the sample should contain a character split across tokens"
    )


def _without_byte_table(tokenizer, monkeypatch, *args) -> IncrementalDetokenizer:
    """A detokenizer that takes the DecodeStream strategy (the vocabulary's byte table hidden)."""
    with monkeypatch.context() as patch:
        patch.setattr(tokenizer, "byte_table", lambda skip_special_tokens: None)
        return IncrementalDetokenizer(tokenizer, *args)


def test_detokenizer_strategies_give_the_same_text_and_the_stream_falls_back(ours, monkeypatch):
    """The DecodeStream strategy gives the same deltas as the windowed one (decoding the tokenizer's
    own way), and the byte-table strategy the same text, with and without special tokens; when the
    stream refuses a token the request goes on windowed and loses no text."""
    _, tokenizer = ours
    cases = [("The capital of France is", " Paris. It is 🌍 big"),
             ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "Hello! Grüße<|im_end|> again"),
             ("a", "\n\n  spaced   out\ttabs"), ("東京", "タワー ok 🚀")]
    for prompt, continuation in cases:
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        ids = tokenizer.encode(continuation, add_special_tokens=False)
        for skip in (True, False):
            by_bytes = IncrementalDetokenizer(tokenizer, prompt_ids, skip)
            streamed = _without_byte_table(tokenizer, monkeypatch, prompt_ids, skip)
            windowed = IncrementalDetokenizer(tokenizer, prompt_ids, skip)
            assert by_bytes.add == by_bytes._add_bytes and streamed.add == streamed._add_streamed
            windowed.add = windowed._add_windowed
            deltas = [windowed.add(t) for t in ids]
            assert [streamed.add(t) for t in ids] == deltas
            expected = tokenizer.decode(prompt_ids + ids, skip)[len(tokenizer.decode(prompt_ids, skip)):]
            assert "".join(by_bytes.add(t) for t in ids) == "".join(deltas) == expected
            failing = _without_byte_table(tokenizer, monkeypatch, prompt_ids, skip)
            calls = {"n": 0}
            real_step = failing._step

            def step(backend, token_id):
                calls["n"] += 1
                if calls["n"] == 3:  # the stream refuses the third new id
                    raise RuntimeError("refused")
                return real_step(backend, token_id)

            failing._step = step
            assert "".join(failing.add(t) for t in ids) == expected
            assert failing.add == failing._add_windowed
            for detokenizer in (by_bytes, streamed, windowed, failing):  # nothing held back at the end
                assert detokenizer.finish() == ""


def test_a_prompt_ending_in_part_of_a_character_puts_none_of_it_in_the_output(ours, monkeypatch):
    """Every strategy's text is the decode of the output's ids alone when the prompt's last ids are
    the first bytes of a character (a token-id prompt can end anywhere)."""
    _, tokenizer = ours
    emoji = tokenizer.encode("😀", add_special_tokens=False)
    assert len(emoji) > 1, "the emoji should span tokens"
    prompt_ids = tokenizer.encode("Hi ", add_special_tokens=False) + emoji[:-1]
    ids = tokenizer.encode(" Hello there", add_special_tokens=False)
    for skip in (True, False):
        expected = tokenizer.decode(ids, skip)
        by_bytes = IncrementalDetokenizer(tokenizer, prompt_ids, skip)
        streamed = _without_byte_table(tokenizer, monkeypatch, prompt_ids, skip)
        windowed = _without_byte_table(tokenizer, monkeypatch, prompt_ids, skip)
        windowed.add = windowed._add_windowed
        assert streamed.add == streamed._add_streamed
        for detokenizer in (by_bytes, streamed, windowed):
            assert "".join(map(detokenizer.add, ids)) + detokenizer.finish() == expected


def test_byte_table_text_is_the_tokenizers_decode_on_random_ids(ours):
    """Random ids after a prompt (special tokens, characters split across tokens, invalid UTF-8) give
    the byte-table strategy the text the tokenizer decodes: while the output grows, less the U+FFFD of
    an incomplete character at the end (one or two), which it holds back; with `finish()`, all of it."""
    _, tokenizer = ours
    rng = np.random.default_rng(0)
    prompt_ids = tokenizer.encode("Tell me: 東京", add_special_tokens=False)
    for case in range(60):
        ids = rng.integers(0, len(tokenizer.hf), 16).tolist()
        if case % 4 == 0:  # some special tokens among them
            ids[3] = ids[11] = int(rng.integers(0, 17))
        for skip in (True, False):
            detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip)
            deltas = [detokenizer.add(t) for t in ids]
            expected = tokenizer.decode(prompt_ids + ids, skip)[len(tokenizer.decode(prompt_ids, skip)):]
            text = "".join(deltas)
            assert expected.startswith(text) and set(expected[len(text):]) <= {"\ufffd"}, (ids, skip)
            assert len(expected) - len(text) <= 2
            assert text + detokenizer.finish() == expected and detokenizer.finish() == ""


def _split_character_ids(tokenizer) -> list[int]:
    """Ids of a text cut after a token that holds only the first bytes of a character."""
    ids = tokenizer.encode(" ok 東京タワー 🌍🚀", add_special_tokens=False)
    table = tokenizer.byte_table(True)
    cuts = [n for n in range(1, len(ids))
            if table[ids[n - 1]][0] >= 0xC0 and tokenizer.decode(ids[n - 1:n]) == "\ufffd"]
    assert cuts, "the sample should contain a character split across tokens"
    return ids[:cuts[-1]]


def test_every_detokenizer_strategy_gives_the_held_back_text_when_the_output_ends(ours, monkeypatch):
    """An output that ends inside a character: each strategy's deltas and `finish()` make the
    tokenizer's decode, U+FFFD included, as HF's `decode` gives it."""
    _, tokenizer = ours
    prompt_ids = tokenizer.encode("Say:", add_special_tokens=False)
    ids = _split_character_ids(tokenizer)
    expected = tokenizer.decode(prompt_ids + ids)[len(tokenizer.decode(prompt_ids)):]
    by_bytes = IncrementalDetokenizer(tokenizer, prompt_ids)
    streamed = _without_byte_table(tokenizer, monkeypatch, prompt_ids)
    windowed = IncrementalDetokenizer(tokenizer, prompt_ids)
    windowed.add = windowed._add_windowed
    for detokenizer in (by_bytes, streamed, windowed):
        text = "".join(detokenizer.add(t) for t in ids)
        assert text != expected and text + detokenizer.finish() == expected
        assert detokenizer.finish() == ""


def _byte_fallback_tokenizer() -> Tokenizer:
    """A SentencePiece-style tokenizer as Llama 2 / Mistral ship theirs: "▁" for spaces, characters
    outside the vocabulary as byte tokens `<0xNN>`, and a decoder that strips the text's first space."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ("▁Hello", "▁the", "▁world", "東"):
        vocab[piece] = len(vocab)
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    raw.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                             unk_token="<unk>"))


@pytest.mark.parametrize("tail", ["😀😀", "😀東", "é東京😀", ""])
def test_a_prompt_of_byte_tokens_keeps_the_first_output_tokens_space(tail, monkeypatch):
    """A byte-fallback tokenizer (the streamed and windowed strategies): the prompt's last ids may
    start inside a character; the context must not, or the decoder's strip takes the output's first
    space. The text is HF's decode of prompt and output, less the prompt's."""
    tokenizer = _byte_fallback_tokenizer()
    hf = tokenizer.hf
    byte_ids = [hf.convert_tokens_to_ids(f"<0x{b:02X}>") for b in tail.encode()]
    prompt = [hf.convert_tokens_to_ids("▁Hello")] + byte_ids
    output = [hf.convert_tokens_to_ids("▁the")] * 2 + [hf.convert_tokens_to_ids("▁world")]
    expected = hf.decode(prompt + output)[len(hf.decode(prompt)):]
    assert expected == " the the world"
    streamed = IncrementalDetokenizer(tokenizer, prompt)
    windowed = IncrementalDetokenizer(tokenizer, prompt)
    windowed.add = windowed._add_windowed
    assert streamed.add == streamed._add_streamed  # no byte table: these tokens are not byte-level
    for detokenizer in (streamed, windowed):
        assert "".join(map(detokenizer.add, output)) + detokenizer.finish() == expected


def test_a_prompt_ending_inside_a_character_adds_nothing_to_the_text(ours):
    """The byte-level text is the decode of the output's ids alone: a character the prompt left
    incomplete shows no U+FFFD in the output, whether the output then starts a new character or
    has no token at all."""
    _, tokenizer = ours
    prompt = tokenizer.encode("Hi ", add_special_tokens=False) + _split_character_ids(tokenizer)[-1:]
    assert tokenizer.decode(prompt).endswith("\ufffd")
    output = tokenizer.encode(" North", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(map(detokenizer.add, output)) + detokenizer.finish() == tokenizer.decode(output) == " North"
    assert IncrementalDetokenizer(tokenizer, prompt).finish() == ""


@pytest.mark.parametrize("output_kind", [RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY])
def test_engine_text_of_an_output_ending_inside_a_character_is_the_decode(ours, output_kind):
    """A request whose last token leaves a character incomplete (ended by max_tokens, or by a stop id
    whose text is kept): its text is HF's decode of its tokens, U+FFFD included, streamed or not."""
    loaded, tokenizer = ours
    engine = LLMEngine(loaded, tokenizer, EngineConfig(max_num_seqs=4, max_model_len=64, kv_cache_memory_bytes=8 << 20))
    split = _split_character_ids(tokenizer)[-1]
    forced = [SamplingParams(temperature=0, max_tokens=1, logit_bias={split: 100}, output_kind=output_kind),
              SamplingParams(temperature=0, max_tokens=3, logit_bias={split: 100}, output_kind=output_kind,
                             stop_token_ids=[split], include_stop_str_in_output=True)]
    ids = [engine.add_request("Hello", params) for params in forced]
    texts, tokens = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.outputs[0].text
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    for rid in ids:
        assert tokens[rid] == [split] and texts[rid] == tokenizer.hf.decode([split]) == "\ufffd"
    engine.check_kv_invariants()

def test_engine_greedy_equals_hf_generate(hf, ours):
    """All prompts at once, a few requests per step, chunked prefill on (budget 32 tokens)."""
    hf_model, _ = hf
    loaded, tokenizer = ours
    engine = LLMEngine(loaded, tokenizer, EngineConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256,
                                                       kv_cache_memory_bytes=64 << 20))
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {out.request_id: out.outputs[0] for out in drain(engine, ids)}
    for rid, prompt in zip(ids, prompts):
        assert done[rid].token_ids == _hf_greedy(hf_model, prompt, 20), f"prompt {tokenizer.decode(prompt)!r}"
    answer = done[ids[0]].text
    assert "Paris" in answer



def test_prompt_logprobs_match_transformers(hf, ours):
    """Prompt logprobs (the server's `echo` with `logprobs`) against transformers' log-softmax of its
    logits at every prompt position, over prefill chunks of 32 tokens: each prompt token's logprob,
    and the top 5 (ids equal but for near-ties)."""
    hf_model, hf_tok = hf
    loaded, tokenizer = ours
    engine = LLMEngine(loaded, tokenizer, EngineConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256,
                                                       kv_cache_memory_bytes=64 << 20))
    prompts = [hf_tok(p).input_ids for p in (PROMPTS[7] + " " + PROMPTS[4], PROMPTS[3] * 6)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=5)
    outs = drain(engine, [engine.add_request(p, params) for p in prompts])
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            expected = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], dim=-1).numpy()
        entries = out.prompt_logprobs
        assert len(entries) == len(ids) > 32 and entries[0] is None
        for t in range(1, len(ids)):
            row, entry = expected[t - 1], entries[t]
            assert next(iter(entry)) == ids[t]
            np.testing.assert_allclose([entry[i].logprob for i in entry], row[list(entry)], atol=2e-3, rtol=0)
            top = sorted(entry, key=lambda i: entry[i].logprob, reverse=True)[:5]
            fifth = np.sort(row)[-5]
            assert set(top) == set(np.argsort(-row)[:5].tolist()) or abs(row[top[-1]] - fifth) < 2e-3
            assert_logprob_ranks_and_texts(engine, entry, row, 5, 2e-3)
            assert [e.decoded_token for e in entry.values()] == [hf_tok.decode([i]) for i in entry]

NEAR_TIE = 0.5  # float32 logit gap below which two tokens count as tied under bfloat16 rounding


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def test_engine_bfloat16_greedy_agrees_with_hf_bfloat16(hf):
    """The mixed-precision path (bfloat16 weights and KV cache, float32 accumulation and activations)
    against HF transformers in bfloat16: greedy outputs equal, or the first difference falls where the
    two tokens' logits under HF float32 differ by less than NEAR_TIE (rounding can flip a near-tie;
    after that the sequences are no longer comparable)."""
    import jax.numpy as jnp
    from transformers import AutoModelForCausalLM

    hf32, _ = hf
    path = embedded_model_path()
    hf16 = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16).eval()
    loaded = load_model(None, dtype=jnp.bfloat16)
    tokenizer = load_tokenizer(loaded.source, loaded.config.eos_token_ids)
    engine = LLMEngine(loaded, tokenizer, EngineConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256,
                                                       kv_cache_memory_bytes=64 << 20))
    assert engine.runner.cache[0].dtype.itemsize == 2  # the KV cache follows the weights
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done = {out.request_id: out.outputs[0].token_ids for out in drain(engine, ids)}
    equal = 0
    for rid, prompt in zip(ids, prompts):
        ours = done[rid]
        with torch.no_grad():
            out = hf16.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                pad_token_id=0, eos_token_id=None)
        theirs = out[0, len(prompt):].tolist()
        i = _first_divergence(ours, theirs)
        if i is None:
            equal += 1
            continue
        with torch.no_grad():
            logits = hf32(torch.tensor([prompt + theirs[:i]])).logits[0, -1]
        gap = abs(float(logits[theirs[i]] - logits[ours[i]]))
        assert gap < NEAR_TIE, f"prompt {tokenizer.decode(prompt)!r}: token {i} differs with a float32 gap {gap:.3f}"
    assert equal >= len(prompts) // 2, f"only {equal} of {len(prompts)} greedy outputs equal"

