"""Tokenizers, the chat template, and incremental detokenization.

- `Tokenizer`: a HF tokenizer (from a model folder or a GGUF file) plus the model's end-of-turn ids.
- `CharTokenizer`: printable characters as tokens, for the random tiny presets (no vocabulary).
- `render_chat_template`: renders a Jinja chat template the way HF does (sandboxed, trim/lstrip blocks).
- `IncrementalDetokenizer`: turns a growing list of ids into text deltas; never emits half of a
  multi-byte character split across tokens.
"""

from __future__ import annotations

import codecs
import datetime
import functools
import json
from typing import Any, Sequence

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

try:  # tokenizers >= 0.21 (what the project asks for); an older one, as on a machine with its own
    from tokenizers.decoders import DecodeStream  # environment, decodes windowed
except ImportError:
    DecodeStream = None

from llmjax.models.loader import ModelSource

Message = dict[str, Any]
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>")


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, used by SmolLM2, Llama 3, Qwen, ...), character -> byte:
    a vocabulary entry writes each of its bytes as one printable character, the printable Latin-1
    bytes as themselves and the other 68 bytes, in byte order, as U+0100 onwards."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = sorted(set(range(256)) - set(printable))
    return {**{chr(b): b for b in printable}, **{chr(0x100 + i): b for i, b in enumerate(others)}}


BYTE_OF_CHAR = _byte_level_alphabet()


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template error: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """HF's `tojson` filter: plain JSON (Jinja's own escapes HTML characters), with its options."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` block (it marks the assistant's tokens for
    training masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)  # the tag's name
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@functools.lru_cache(maxsize=16)
def _compiled_template(template: str) -> jinja2.Template:
    """`template` compiled in the environment HF's `apply_chat_template` gives templates: sandboxed,
    `trim_blocks`/`lstrip_blocks`, `{% break %}`/`{% continue %}`, `{% generation %}`, its `tojson`,
    `raise_exception` and `strftime_now` (Llama 3's templates write today's date with it)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat_template(template: str, messages: Sequence[Message], add_generation_prompt: bool, **special: Any) -> str:
    """Render `template` as HF does: `messages`, `add_generation_prompt`, no `tools` or `documents`
    (None, so `tools is not none` is false) and the special tokens (`bos_token`, `eos_token`, ...:
    the tokenizer's `special_tokens_map`)."""
    return _compiled_template(template).render(messages=list(messages), tools=None, documents=None,
                                               add_generation_prompt=add_generation_prompt, **special)


def continue_final(rendered: str, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """`rendered` (the conversation `messages` rendered without a generation prompt) cut right after
    the last message's content, so the model goes on with that message (HF's and vLLM's
    `continue_final_message`): the template's end of turn after it is dropped, and the content's
    trailing whitespace kept where the template kept it. ValueError with `add_generation_prompt`
    (the prompt either continues the last message or opens a new one), for a conversation without
    a last message with text, and when the template did not write that text as it is."""
    if add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the prompt either "
                         "continues the last message or opens a new one")
    content = messages[-1]["content"] if messages else ""
    core = content.strip()
    at = rendered.rfind(core) if core else -1
    if at < 0:
        raise ValueError("continue_final_message needs a last message whose text the chat template writes as it is")
    end = at + len(core)
    tail = content[len(content.rstrip()):]
    return rendered[: end + len(tail)] if rendered.startswith(tail, end) else rendered[:end]


class Tokenizer:
    """A HF tokenizer with llmjax's needs: encode, decode, chat prompts, the set of stop ids.

    `eos_token_ids` (what ends a request unless `ignore_eos`) is the model's declared eos ids, the
    tokenizer's eos, and every `END_OF_TURN_TOKENS` entry the vocabulary has: llama.cpp's
    end-of-generation set. HF `generate` and vLLM stop on the declared ids only, so on SmolLM2 a
    sampled `<|endoftext|>` (id 0) ends a request here and not there."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int] = ()):
        self.hf = hf_tokenizer
        vocab = hf_tokenizer.get_vocab()
        ids = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            ids.add(hf_tokenizer.eos_token_id)
        ids.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
        self.eos_token_ids = frozenset(ids)
        self.chat_template: str | None = hf_tokenizer.chat_template
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._byte_level = isinstance(getattr(backend, "decoder", None), tokenizers.decoders.ByteLevel)
        self._byte_tables: dict[bool, list[bytes]] = {}  # see `byte_table`
        self._token_texts: dict[int, str] = {}  # see `token_to_text`
        self._backend = backend
        self._longest_entry = max(map(len, vocab))
        for skip_special_tokens in (True, False):  # built now, not in a serving step (tens of ms each)
            self.byte_table(skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True, at_most: int | None = None) -> list[int]:
        """`at_most`: raise `TextTooLong` instead of encoding a text certainly longer than that many
        tokens (see `min_num_tokens`)."""
        if at_most is not None:
            _check_length(self, text, at_most)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def min_num_tokens(self, text: str) -> int:
        """A lower bound on `len(encode(text))`, found without encoding it: a token spans at most as
        many characters of the normalized text as its vocabulary entry has (byte-level BPE: an entry
        character a byte; SentencePiece: `▁` for a space). 0 for a tokenizer without a `tokenizers`
        backend, whose normalization is not known here (SentencePiece's own can drop characters)."""
        if self._backend is None:
            return 0
        if self._backend.normalizer is not None:
            text = self._backend.normalizer.normalize_str(text)
        return -(-len(text) // self._longest_entry)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_text(self, token_id: int) -> str:
        """One token's text on its own (part of a character shows as U+FFFD), remembered once made: a
        request with logprobs asks for 21 tokens' a step. Safe from several threads (a race makes a
        text twice)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.hf.decode([token_id])
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (OpenAI's logprob `bytes`): with a byte-level vocabulary,
        exactly its own bytes, which may be part of a multi-byte character whose text shows as
        U+FFFD (the bytes of consecutive tokens concatenate to the UTF-8 of their decoded text);
        an added token (`<|im_start|>`), or any other vocabulary, gives the UTF-8 of its text."""
        table = self.byte_table(skip_special_tokens=False)
        if table is not None and 0 <= token_id < len(table):
            return table[token_id]
        return self.token_to_text(token_id).encode()

    def byte_table(self, skip_special_tokens: bool) -> list[bytes] | None:
        """With a byte-level vocabulary (its decoder ByteLevel alone), the bytes of each token id's
        decoded text, by id: a vocabulary entry's own bytes, an added token's text, a special token's
        nothing when `skip_special_tokens`; None for any other vocabulary. Built once, by `__init__`."""
        if not self._byte_level:
            return None
        if skip_special_tokens not in self._byte_tables:
            added = self.hf.added_tokens_decoder
            table = []
            for token_id, entry in enumerate(self.hf.convert_ids_to_tokens(list(range(len(self.hf))))):
                if token_id in added:
                    table.append(b"" if skip_special_tokens and added[token_id].special
                                 else self.token_to_text(token_id).encode())
                    continue
                try:
                    table.append(bytes(BYTE_OF_CHAR[c] for c in entry))
                except (KeyError, TypeError):  # not written in the byte alphabet
                    table.append(self.token_to_text(token_id).encode())
            self._byte_tables[skip_special_tokens] = table
        return self._byte_tables[skip_special_tokens]

    def chat_prompt(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        """The conversation rendered by the chat template; with `continue_final_message`, cut after
        the last message's text (`continue_final`)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        special = {name: token for name, token in self.hf.special_tokens_map.items() if isinstance(token, str)}
        text = render_chat_template(self.chat_template, messages, add_generation_prompt and not continue_final_message,
                                    **{"bos_token": "", "eos_token": "", **special})
        return continue_final(text, messages, add_generation_prompt) if continue_final_message else text

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, at_most: int | None = None,
                    continue_final_message: bool = False) -> list[int]:
        """Token ids of the rendered chat prompt (`chat_prompt`). The template writes its own special
        tokens; `add_special_tokens` adds the tokenizer's too (as HF's `apply_chat_template` then `encode`)."""
        return self.encode(self.chat_prompt(messages, add_generation_prompt, continue_final_message),
                           add_special_tokens, at_most)


class CharTokenizer:
    """Printable ASCII as tokens, for the random tiny presets (they have no vocabulary to load).

    Ids 0/1/2 are pad/bos/eos; every other id decodes to one printable character
    (`chr(32 + (id - 3) % 95)`), so any sampled id is visible text. Characters outside
    printable ASCII encode as '?'. Its chat format writes each turn as `<role>content` or, for a
    message with a `name`, `<role:name>content`, one a line.
    """

    OFFSET = 3
    NUM_CHARS = 95
    eos_token_ids = frozenset({2})
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True, at_most: int | None = None) -> list[int]:
        if at_most is not None:
            _check_length(self, text, at_most)
        ids = [self.OFFSET + (ord(c) - 32 if 32 <= ord(c) < 127 else ord("?") - 32) for c in text]
        return ([1] if add_special_tokens else []) + ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(self.token_to_text, ids))

    def min_num_tokens(self, text: str) -> int:
        return len(text)  # one token a character

    def token_to_text(self, token_id: int) -> str:
        return chr(32 + (token_id - self.OFFSET) % self.NUM_CHARS) if token_id >= self.OFFSET else ""

    def token_bytes(self, token_id: int) -> bytes:
        return self.token_to_text(token_id).encode()

    def chat_prompt(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        text = "".join(f"<{m['role']}{':' + m['name'] if 'name' in m else ''}>{m['content']}\n" for m in messages)
        if continue_final_message:
            return continue_final(text, messages, add_generation_prompt)
        return text + ("<assistant>" if add_generation_prompt else "")

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, at_most: int | None = None,
                    continue_final_message: bool = False) -> list[int]:
        """BOS (the chat format's own), then the rendered text; `add_special_tokens` adds the
        tokenizer's BOS before it, as `Tokenizer.encode_chat` does."""
        return [1] + self.encode(self.chat_prompt(messages, add_generation_prompt, continue_final_message),
                                 add_special_tokens, at_most)


class TextTooLong(ValueError):
    """A text certainly longer than the tokens it may have (`encode(..., at_most=)`); nothing was encoded."""

    def __init__(self, num_chars: int, min_num_tokens: int, at_most: int):
        super().__init__(f"the text has at least {min_num_tokens} tokens ({num_chars} characters), more than {at_most}")
        self.num_chars, self.min_num_tokens = num_chars, min_num_tokens


def _check_length(tokenizer: Tokenizer | CharTokenizer, text: str, at_most: int) -> None:
    bound = tokenizer.min_num_tokens(text)
    if bound > at_most:
        raise TextTooLong(len(text), bound, at_most)


def load_tokenizer(source: ModelSource, eos_token_ids: Sequence[int] = ()) -> Tokenizer | CharTokenizer:
    if source.kind == "preset":
        return CharTokenizer()
    from transformers import AutoTokenizer

    if source.kind == "gguf":
        hf = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    else:
        hf = AutoTokenizer.from_pretrained(str(source.path))
    return Tokenizer(hf, eos_token_ids)


class IncrementalDetokenizer:
    """Text deltas for a growing token list: `add(id)` returns the text the new id completes
    (possibly empty), never ending in half of a multi-byte character split across tokens; once the
    output is complete, `finish()` returns what was held back. Together they concatenate to the
    decoded output.

    One strategy per tokenizer, all giving the same text:
    - a byte-level vocabulary (GPT-2's alphabet: SmolLM2, Llama 3, Qwen): each id's bytes
      (`Tokenizer.byte_table`) through an incremental UTF-8 decoder: a list lookup and one call into
      Python's C codec per token, no tokenizer call. It holds back only the bytes of an incomplete
      character, where the others hold back a token's whole text, and it shows an invalid byte
      (U+FFFD, as `decode` does) when it comes, where they wait for the next token. It needs no
      context: the text is the decode of the output's ids alone, so the bytes of a character the
      prompt left incomplete are no part of it (an output starting with their continuation shows
      U+FFFD for it, as `decode` of the output does);
    - another HF tokenizer backed by `tokenizers` (every fast tokenizer): its `DecodeStream` (Rust,
      about a microsecond a token), primed with the prompt's last ids so leading spaces and byte
      fallback see their context (less the ids of a character the prompt leaves incomplete, whose
      U+FFFD would otherwise open the output); should it refuse a sequence, the request goes on windowed;
    - windowed (any other HF tokenizer): decode a short window of recent ids twice (without and with
      the new id) and emit the difference, holding back a delta that ends in U+FFFD (an incomplete
      UTF-8 sequence) until the next token completes it;
    - `CharTokenizer`: every id is its own character.
    """

    CONTEXT = 6  # prompt ids that give the first new ids their context

    def __init__(self, tokenizer: Tokenizer | CharTokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT:])  # the byte-table strategy's (unused)
        self.prefix_offset = 0
        self.read_offset = len(self.ids)  # ids before it are returned as text
        backend = getattr(getattr(tokenizer, "hf", None), "_tokenizer", None)
        table = tokenizer.byte_table(skip_special_tokens) if isinstance(tokenizer, Tokenizer) else None
        if isinstance(tokenizer, CharTokenizer):
            self.add = tokenizer.token_to_text
            return
        if table is not None:
            self._table, self._utf8 = table, codecs.getincrementaldecoder("utf-8")("replace").decode
            self.add = self._add_bytes
            return
        self.ids = self._context(list(prompt_ids))
        self.read_offset = len(self.ids)
        if isinstance(backend, tokenizers.Tokenizer) and DecodeStream is not None:
            self._backend = backend
            self._step = DecodeStream(skip_special_tokens=skip_special_tokens).step
            try:
                for token_id in self.ids:  # the context's own text is not returned
                    self._step(backend, token_id)
                self.add = self._add_streamed
            except Exception:  # a context the stream refuses
                self.add = self._add_windowed
        else:
            self.add = self._add_windowed

    def _context(self, prompt_ids: list[int]) -> list[int]:
        """The prompt's last ids that give the output its context: the shortest suffix of at least
        CONTEXT ids (up to 4 x CONTEXT) whose text holds no U+FFFD. A context starting inside a
        character (byte-fallback tokens) decodes to U+FFFD, and some decoders then lose the first
        output token's leading space; one ending inside a character would put it in the output.
        With no such suffix, the last CONTEXT ids less those that end in part of a character."""
        def clean(ids: list[int]) -> bool:
            return "\ufffd" not in self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

        for size in range(min(self.CONTEXT, len(prompt_ids)), min(4 * self.CONTEXT, len(prompt_ids)) + 1):
            if clean(prompt_ids[len(prompt_ids) - size:]):
                return prompt_ids[len(prompt_ids) - size:]
        ids = prompt_ids[-self.CONTEXT:]
        while ids and self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens).endswith("\ufffd"):
            ids.pop()
        return ids

    def _add_bytes(self, token_id: int) -> str:
        try:
            return self._utf8(self._table[token_id])
        except IndexError:  # an id past the vocabulary (a model's padded rows) has no text
            return ""

    def _add_streamed(self, token_id: int) -> str:
        self.ids.append(token_id)
        try:
            text = self._step(self._backend, token_id)
        except Exception:  # e.g. tokenizers' InvalidPrefix: continue from the last returned text
            self.ids.pop()
            self.prefix_offset = max(0, self.read_offset - self.CONTEXT)
            self.add = self._add_windowed
            return self._add_windowed(token_id)
        if text is None:
            return ""
        self.read_offset = len(self.ids)
        return text

    def _add_windowed(self, token_id: int) -> str:
        self.ids.append(token_id)
        skip = self.skip_special_tokens
        before = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        after = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def finish(self) -> str:
        """The text held back at the end of the output (the output is complete): an incomplete
        character as U+FFFD, as `decode` shows it; the windowed and streamed strategies also give the
        text of the ids they held back with it. Later calls return ""."""
        if isinstance(self.tokenizer, CharTokenizer):
            return ""
        if self.add == self._add_bytes:
            return self._utf8(b"", True)
        if self.read_offset == len(self.ids):
            return ""
        skip = self.skip_special_tokens
        before = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        after = self.tokenizer.decode(self.ids[self.prefix_offset :], skip_special_tokens=skip)
        self.prefix_offset = self.read_offset = len(self.ids)
        return after[len(before) :]
