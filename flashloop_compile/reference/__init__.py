"""The explicit, eager FlashLoop reference: the oracle for every optimized path.

Written for clarity, not speed: one request at a time, FP32 attention with materialized
probabilities, Python loops. See :mod:`.flashloop` for the engine and the other modules for the
pieces (codec, selection, attention, KV stores) that kernels and passes are checked against.
The engine (``ReferenceFlashLoop``, ...) runs the model class, so it is imported on first use: the
codec the op library uses comes without :mod:`flashloop_compile.models`.
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

_ENGINE_NAMES = ("ReferenceFlashLoop", "ReferenceRequest", "StepRecord")


def __getattr__(name: str):
    if name in _ENGINE_NAMES:
        from flashloop_compile.reference import flashloop

        return getattr(flashloop, name)
    raise AttributeError(f"module 'flashloop_compile.reference' has no attribute {name!r}")
