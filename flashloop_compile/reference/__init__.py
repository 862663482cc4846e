"""The explicit, eager FlashLoop reference: the oracle for every optimized path.

Written for clarity, not speed: one request at a time, FP32 attention with materialized
probabilities, Python loops. See :mod:`.flashloop` for the engine and the other modules for the
pieces (codec, selection, attention, KV stores) that kernels and passes are checked against.
"""

from flashloop_compile.reference.attention import (
    ReferenceState,
    attention_probs,
    causal_attention,
    correction_attention,
    reference_attention,
    reuse_correction_attention,
)
from flashloop_compile.reference.codec import dequantize, quantize, quantize_channel_groups, quantize_token_groups
from flashloop_compile.reference.flashloop import ReferenceFlashLoop, ReferenceRequest, StepRecord
from flashloop_compile.reference.kvstore import DenseKVStore, KVBytes, QuantizedKVStore
from flashloop_compile.reference.selection import change_scores, select_active, window_bounds

__all__ = [
    "ReferenceFlashLoop",
    "ReferenceRequest",
    "StepRecord",
    "ReferenceState",
    "attention_probs",
    "causal_attention",
    "reference_attention",
    "correction_attention",
    "reuse_correction_attention",
    "quantize",
    "dequantize",
    "quantize_token_groups",
    "quantize_channel_groups",
    "DenseKVStore",
    "QuantizedKVStore",
    "KVBytes",
    "change_scores",
    "select_active",
    "window_bounds",
]
