"""Graph passes: recognition of the recurrent block, then one rewrite pass per FlashLoop feature.

``PASS_ORDER`` is the fixed order the manager runs them in.
"""

from flashloop_compile.passes.manager import FlashLoopPass, PassManager, RewriteReport, graph_phase
from flashloop_compile.passes.recognize import (
    AttentionSite,
    CacheSite,
    LoopMismatchError,
    LoopStructure,
    NoRecurrentBlockError,
    RecognitionError,
    UnrecognizedKVSourceError,
    UnsupportedAttentionError,
    recognize,
)

import flashloop_compile.lowering.ops  # noqa: F401  (registers the flashloop ops)
import flashloop_compile.lowering.packed_ops  # noqa: F401
import flashloop_compile.lowering.prefill_ops  # noqa: F401
import flashloop_compile.lowering.selection_ops  # noqa: F401
from flashloop_compile.passes.kv_quant import KVResidualQuantizationPass
from flashloop_compile.passes.position_attention import PositionAttentionPass
from flashloop_compile.passes.sparse_decode import SparseDecodeAttentionPass
from flashloop_compile.passes.token_sparse import TokenSparsePrefillPass

# Token-sparse prefill re-emits loop bodies and sparse decode replaces attention; the exact
# position-attention rewrite (a compilation option) takes the prefill sites left as SDPA; KV
# quantization runs last because it rewrites every cache write and read the others leave behind.
PASS_ORDER: list[type[FlashLoopPass]] = [
    TokenSparsePrefillPass, SparseDecodeAttentionPass, PositionAttentionPass, KVResidualQuantizationPass,
]

__all__ = [
    "PASS_ORDER",
    "SparseDecodeAttentionPass",
    "KVResidualQuantizationPass",
    "TokenSparsePrefillPass",
    "PositionAttentionPass",
    "FlashLoopPass",
    "PassManager",
    "RewriteReport",
    "graph_phase",
    "recognize",
    "AttentionSite",
    "CacheSite",
    "LoopStructure",
    "RecognitionError",
    "NoRecurrentBlockError",
    "LoopMismatchError",
    "UnsupportedAttentionError",
    "UnrecognizedKVSourceError",
]
