"""Synthetic traces shared by the paper reproductions. Everything is drawn from a seeded numpy Generator.

Length traces (PagedAttention §6): prompt and output lengths from `llmjax.workloads` (log-normal,
matched to ShareGPT's or Alpaca's published means); arrivals are a Poisson process. Prompts are
random token ids, so no two requests share a prefix by accident.

Prefix-sharing workloads (RadixAttention): prompts built from random "text" (token ids) shared the way
the SGLang paper's benchmarks share it: few-shot examples, a long document, a tree-of-thought stem,
a chat history. Each builder returns prompts in arrival order, groups interleaved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from llmjax.sim import DUMMY_TOKEN, TraceRequest
from llmjax.workloads import LengthDist, lognormal_lengths

FIRST_ID = 16  # random token ids start here: below are the special tokens of the tokenizers we use


def poisson_arrivals(rng: np.random.Generator, n: int, rate: float) -> np.ndarray:
    """Arrival times of a Poisson process of `rate` requests per second, starting after one gap."""
    return np.cumsum(rng.exponential(1.0 / rate, n))


def random_tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(FIRST_ID, vocab, n).tolist()


def length_trace(dist: LengthDist, n: int, rate: float, seed: int, vocab: int, max_model_len: int = 2048,
                 max_prompt_len: int = 1024, name: str | None = None) -> list[TraceRequest]:
    """n requests with `dist`'s lengths clipped to prompt <= max_prompt_len and prompt + output <=
    max_model_len (the limits of vLLM's ShareGPT benchmark filter, which drops a longer request where
    this clips it; a prompt also leaves room for one output token) arriving at `rate` per second
    (rate <= 0: all at t=0). Request ids are `name` + index (default name: "<dist.name>-")."""
    rng = np.random.default_rng(seed)
    prompt_lens = lognormal_lengths(rng, n, dist.mean_prompt, dist.sigma_prompt, min(max_prompt_len, max_model_len - 1))
    output_lens = lognormal_lengths(rng, n, dist.mean_output, dist.sigma_output, max_model_len - prompt_lens)
    arrivals = poisson_arrivals(rng, n, rate) if rate > 0 else np.zeros(n)
    prefix = f"{dist.name}-" if name is None else name
    return [TraceRequest(f"{prefix}{i}", float(arrivals[i]), random_tokens(rng, int(prompt_lens[i]), vocab),
                         int(output_lens[i])) for i in range(n)]


def to_trace(prompts: Sequence[list[int]], output_lens: Sequence[int], rate: float, seed: int,
             name: str) -> list[TraceRequest]:
    """Prompts in arrival order, with Poisson arrivals at `rate` per second."""
    arrivals = poisson_arrivals(np.random.default_rng(seed), len(prompts), rate)
    return [TraceRequest(f"{name}-{i}", float(t), p, int(o))
            for i, (p, t, o) in enumerate(zip(prompts, arrivals, output_lens))]


# --- prefix-sharing workloads ------------------------------------------------------------------------
def interleave(groups: Sequence[Sequence[list[int]]], rng: np.random.Generator) -> list[list[int]]:
    """All prompts of all groups in a random order (so groups interleave in arrival)."""
    flat = [p for g in groups for p in g]
    return [flat[i] for i in rng.permutation(len(flat))]


def few_shot(rng: np.random.Generator, vocab: int, groups: int, per_group: int, shots: int = 5,
             example_len: int = 40, question_len: int = 16) -> list[list[int]]:
    """`groups` tasks, each with its own `shots` examples; every request is the examples + a question."""
    prompts = []
    for _ in range(groups):
        examples = random_tokens(rng, shots * example_len, vocab)
        prompts.append([examples + random_tokens(rng, question_len, vocab) for _ in range(per_group)])
    return interleave(prompts, rng)


def long_document(rng: np.random.Generator, vocab: int, docs: int, per_doc: int, doc_len: int = 400,
                  question_len: int = 16) -> list[list[int]]:
    """Questions over long documents: each request is one document + a question about it."""
    prompts = []
    for _ in range(docs):
        doc = random_tokens(rng, doc_len, vocab)
        prompts.append([doc + random_tokens(rng, question_len, vocab) for _ in range(per_doc)])
    return interleave(prompts, rng)


def tree_of_thought(rng: np.random.Generator, vocab: int, trees: int, branches: int = 3, depth: int = 2,
                    stem_len: int = 120, thought_len: int = 24) -> list[list[int]]:
    """Branching search: each node of a `branches`-ary tree of `depth` levels below a stem is a request whose
    prompt is the stem + the thoughts on its path. Trees interleave; within a tree, parents come first."""
    order = []
    for tree in range(trees):
        stem = random_tokens(rng, stem_len, vocab)
        level, nodes = [stem], []
        for _ in range(depth):
            level = [p + random_tokens(rng, thought_len, vocab) for p in level for _ in range(branches)]
            nodes += level
        order.append(nodes)
    # round-robin over trees keeps parents before children within each tree
    width = max(map(len, order))
    return [nodes[i] for i in range(width) for nodes in order if i < len(nodes)]


@dataclass(frozen=True)
class Chats:
    """Multi-turn conversations: a system prompt shared by all, then user messages per conversation and turn.

    The prompt of turn k is the system prompt, then for each earlier turn its user message and reply,
    then turn k's user message (`prompt`).
    """

    system: list[int]
    users: list[list[list[int]]]  # [conversation][turn] -> tokens

    @classmethod
    def draw(cls, rng: np.random.Generator, vocab: int, conversations: int, turns: int, system_len: int = 64,
             user_len: int = 24) -> Chats:
        return cls(random_tokens(rng, system_len, vocab),
                   [[random_tokens(rng, user_len, vocab) for _ in range(turns)] for _ in range(conversations)])

    def prompt(self, conversation: int, turn: int, replies: Sequence[list[int]]) -> list[int]:
        """The prompt of `turn`, given the replies of the earlier turns (replies[k] for turn k < turn)."""
        tokens = list(self.system)
        for k in range(turn):
            tokens += self.users[conversation][k] + replies[k]
        return tokens + self.users[conversation][turn]


def chat_trace(chats: Chats, reply_lens: np.ndarray, rate: float, think_time: float, seed: int) -> list[TraceRequest]:
    """Conversations starting at `rate` per second; each later turn arrives a think time (exponential,
    mean `think_time` seconds) after the previous turn finishes (`TraceRequest.after`), so its prompt
    never holds a reply that does not exist yet. Replies are the simulator's dummy tokens, so a turn's
    prompt holds exactly the tokens the simulator produced for the earlier turns. reply_lens:
    [conversation, turn]."""
    rng = np.random.default_rng(seed)
    starts = poisson_arrivals(rng, len(chats.users), rate)
    trace = []
    for c, start in enumerate(starts):
        replies = []
        for k, n in enumerate(reply_lens[c]):
            if k == 0:
                trace.append(TraceRequest(f"chat-{c}-0", float(start), chats.prompt(c, 0, replies), int(n)))
            else:
                trace.append(TraceRequest(f"chat-{c}-{k}", float(rng.exponential(think_time)),
                                          chats.prompt(c, k, replies), int(n), after=f"chat-{c}-{k - 1}"))
            replies.append([DUMMY_TOKEN] * int(n))
    return trace
