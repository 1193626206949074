"""Request-length distributions of public datasets, synthesised: no dataset is read.

The serving papers publish only the mean prompt and output lengths of ShareGPT and Alpaca, so
lengths are drawn from log-normal distributions whose log-space spread (sigma) is ours to choose
and whose location is solved, per draw, so that the drawn lengths, after capping, have exactly the
published means. Used by `llmjax bench --dataset sharegpt`, the paper reproductions and the
experiments.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthDist:
    """Published mean prompt and output lengths, and our log-space spread (sigma) for each."""

    name: str
    mean_prompt: float
    mean_output: float
    sigma_prompt: float
    sigma_output: float


# Means: the PagedAttention paper, §6.1 (OPT tokenizer). Sigmas: our assumption, not published. Its
# Figure 11 shows long right tails, prompts more skewed than outputs; sigma 1.0 / 0.8 give coefficients
# of variation of about 1.3 / 0.95 before the lengths are capped (under paper_repro/traces.py's caps,
# ShareGPT's draws have about 1.1 / 0.9). memory_waste.py reports how the results move with sigma_output.
SHAREGPT = LengthDist("ShareGPT", 161.31, 337.99, sigma_prompt=1.0, sigma_output=0.8)
ALPACA = LengthDist("Alpaca", 19.31, 58.45, sigma_prompt=1.0, sigma_output=0.8)


def lognormal_lengths(rng: np.random.Generator, n: int, mean: float, sigma: float,
                      cap: int | np.ndarray) -> np.ndarray:
    """n integer lengths in [1, cap] (cap may vary per draw): round(exp(mu + sigma * z)), clipped, with mu
    solved by bisection so that the lengths' sample mean is `mean` (to within the integer rounding).
    Where the caps put `mean` out of reach (above the caps' mean, or below 1), the lengths come as close
    as they can: every one at its cap, or every one 1. ValueError for a cap below 1 (no length fits)."""
    if np.any(np.asarray(cap) < 1):
        raise ValueError(f"a length's cap must be at least 1, got {np.min(cap)}")
    if n == 0:
        return np.zeros(0, np.int64)
    z = rng.standard_normal(n)

    def draw(mu: float) -> np.ndarray:
        return np.clip(np.rint(np.exp(mu + sigma * z)), 1, cap).astype(np.int64)

    lo, hi = np.log(mean) - 5 * sigma - 5, np.log(mean) + 5 * sigma + 5
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if draw(mid).mean() < mean else (lo, mid)
    return draw(hi)
