"""`StepBuckets`: the padded shapes (T, S, B) a step runs at, one rule for every caller.

T = new tokens, S = requests, B = blocks per request. Each is a power of two between a floor and
the config's maximum (`max_num_batched_tokens`, `max_num_seqs`, `max_model_len / block_size`), so a
server compiles a bounded set of step functions. The scheduler stamps every `SchedulerOutput`
with its bucket; the runner pads to it, warm-up compiles `warmup_shapes()`, the KV profiler runs
`largest()`, and experiments read the bucket off the scheduler's outputs (the simulator's too).

Floors keep the number of compiled steps small where padding is (nearly) free: attention's work
follows the traced context lengths and request counts (loop bounds), not B or padded requests, so
B starts at `MIN_BLOCK_TOKENS` tokens of table, and at least `MIN_BLOCK_BUCKET` blocks (2048 tokens:
a model of that context, such as the embedded SmolLM2, has a single B, so warm-up covers every
context it can see; tables twice as wide as
needed cost no measurable step time, `experiments/step_profile.py --wide-tables`); and a mixed
step pads S to at least T / `MIXED_TOKENS_PER_SEQ` (the padded rows cost only LM-head rows: < 4%
of such a step).
"""

from __future__ import annotations

from llmjax.config import EngineConfig

MIN_TOKEN_BUCKET = 8
MIN_BLOCK_BUCKET = 8
MIN_BLOCK_TOKENS = 2048  # block tables are at least this many tokens wide (capped by max_model_len)
MIXED_TOKENS_PER_SEQ = 8  # a mixed step (some request has > 1 token) has S >= T / 8

Shape = tuple[int, int, int, bool]  # (T, S, B, decode_only)


def bucket(n: int, lo: int, hi: int) -> int:
    """Smallest power of two >= max(n, lo), capped at `hi`."""
    size = lo
    while size < n:
        size *= 2
    return min(size, hi)


def powers(lo: int, hi: int) -> list[int]:
    """The buckets `bucket` can return for lo..hi: lo, 2*lo, ... below hi, then hi."""
    out = [min(lo, hi)]
    while out[-1] < hi:
        out.append(min(out[-1] * 2, hi))
    return out


class StepBuckets:
    """The bucket rules of one `EngineConfig`. Immutable; safe to share."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.block_size = config.block_size
        self.max_tokens = max(config.max_num_batched_tokens, MIN_TOKEN_BUCKET)
        self.max_seqs = config.max_num_seqs
        self.max_blocks = -(-config.max_model_len // config.block_size)
        self.min_blocks = bucket(1, max(MIN_BLOCK_BUCKET, MIN_BLOCK_TOKENS // config.block_size), self.max_blocks)

    def shape(self, num_tokens: int, num_reqs: int, max_blocks: int) -> tuple[int, int, int]:
        """(T, S, B) of a step of `num_tokens` tokens in `num_reqs` requests (mixed when
        `num_tokens > num_reqs`), the longest block table `max_blocks` long."""
        t = bucket(num_tokens, MIN_TOKEN_BUCKET, self.max_tokens)
        s = bucket(num_reqs, self.min_seqs(t) if num_tokens > num_reqs else 1, self.max_seqs)
        return t, s, bucket(max_blocks, self.min_blocks, self.max_blocks)

    def min_seqs(self, t: int) -> int:
        """The smallest S bucket of a mixed step of T = t."""
        return max(1, t // MIXED_TOKENS_PER_SEQ)

    def warmup_shapes(self, max_context: int | None = None) -> list[Shape]:
        """The common buckets for contexts up to `max_context` tokens (default: the smallest
        block-table bucket; longer contexts compile on first use): for each block-table bucket B,
        decode-only steps at each request-count bucket S, and mixed steps at each token bucket T
        with each request-count bucket such a step can pad to, so that no step of a server within
        these contexts waits for a compile. 29 shapes for T=512, S=64."""
        blocks = self.min_blocks if max_context is None else -(-max_context // self.block_size)
        shapes: list[Shape] = []
        for b in powers(self.min_blocks, bucket(blocks, self.min_blocks, self.max_blocks)):
            for s in powers(1, self.max_seqs):
                t, s_, _ = self.shape(s, s, b)
                shapes.append((t, s_, b, True))
            for t in powers(MIN_TOKEN_BUCKET, self.max_tokens):
                for n in powers(self.min_seqs(t), min(t - 1, self.max_seqs)):  # n < t: mixed
                    t_, s_, _ = self.shape(t, n, b)
                    shapes.append((t_, s_, b, False))
        return list(dict.fromkeys(shapes))

    def largest(self) -> list[Shape]:
        """The buckets with the most activations: the mixed step at `max_num_batched_tokens` and the
        decode-only step at `max_num_seqs`, full block tables (the KV profiler runs them)."""
        cfg = self.config
        t, s, b = self.shape(cfg.max_num_batched_tokens, cfg.max_num_seqs, self.max_blocks)
        t_dec, s_dec, _ = self.shape(cfg.max_num_seqs, cfg.max_num_seqs, self.max_blocks)
        return [(t, s, b, False), (t_dec, s_dec, b, True)]
