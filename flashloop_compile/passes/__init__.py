"""Graph passes: recognition of the recurrent block, then one rewrite pass per FlashLoop feature.

``PASS_ORDER`` is the fixed order the manager runs them in.
"""

from flashloop_compile.passes.manager import PASS_ORDER, FlashLoopPass, PassManager, RewriteReport, graph_phase
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
import flashloop_compile.lowering.packed_sparse_ops  # noqa: F401
import flashloop_compile.lowering.prefill_ops  # noqa: F401
import flashloop_compile.lowering.selection_ops  # noqa: F401
from flashloop_compile.passes.kv_quant import KVResidualQuantizationPass
from flashloop_compile.passes.position_attention import PositionAttentionPass
from flashloop_compile.passes.sparse_decode import SparseDecodeAttentionPass
from flashloop_compile.passes.token_sparse import TokenSparsePrefillPass


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
