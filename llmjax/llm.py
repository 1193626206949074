"""The offline API: `LLM(model, **engine_args).generate(prompts, sampling_params)`.

Prompts may be strings, token-id lists, or chat conversations (lists of `{"role", "content"}`
messages, rendered with the model's chat template). Outputs come back in input order.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

from tqdm import tqdm

from llmjax.config import EngineConfig
from llmjax.engine import LLMEngine, RequestOutput
from llmjax.sampling_params import SamplingParams

Prompt = str | Sequence[int] | Sequence[dict[str, Any]]


def _is_single(prompts: Any) -> bool:
    if isinstance(prompts, str):
        return True
    items = list(prompts)
    return bool(items) and (all(isinstance(p, int) for p in items) or all(isinstance(p, dict) for p in items))


class LLM:
    """A model plus an engine, for batch generation in one process."""

    def __init__(self, model: str | None = None, seed: int = 0, engine_config: EngineConfig | None = None,
                 **engine_args: Any):
        """`engine_args` are `EngineConfig` fields; or pass a whole `engine_config`."""
        config = engine_config or EngineConfig(**engine_args)
        self.engine = LLMEngine.from_config(model, config, seed=seed)
        self.tokenizer = self.engine.tokenizer

    def _prompt_ids(self, prompt: Prompt) -> str | list[int]:
        if isinstance(prompt, str):
            return prompt
        items = list(prompt)
        if items and isinstance(items[0], dict):
            return self.tokenizer.encode_chat(items)
        return [int(t) for t in items]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; returns one finished `RequestOutput` per prompt, in order."""
        if _is_single(prompts):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(sampling_params)} sampling params")
        ids = [self.engine.add_request(self._prompt_ids(p), sp) for p, sp in zip(prompts, sampling_params)]
        self.engine.scheduler.input_closed = True
        results: dict[str, RequestOutput] = {}
        start, generated = time.perf_counter(), 0
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    generated += len(out.delta_token_ids)
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
                bar.set_postfix(tok_per_s=f"{generated / (time.perf_counter() - start):.1f}")
        self.engine.scheduler.input_closed = False
        return [results[i] for i in ids]

    def chat(self, conversations, sampling_params: SamplingParams | None = None, use_tqdm: bool = True):
        """Generate replies to one conversation or a list of them."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate(list(conversations), sampling_params, use_tqdm)
