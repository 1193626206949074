"""Pallas GPU attention kernels (Triton backend), each runnable with `interpret=True` on CPU."""

from pallas_kernels.flash_attention import flash_attention, flash_prefill, prefill_segment_starts
from pallas_kernels.mla_attention import mla_ragged_paged_attention
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention

__all__ = ["flash_attention", "flash_prefill", "mla_ragged_paged_attention", "paged_attention",
           "prefill_segment_starts", "ragged_paged_attention"]
