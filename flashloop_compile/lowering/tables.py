"""The launch tables' registry, without Triton: ``with_overrides`` makes a table from its defaults
and a ``FLASHLOOP_*`` environment override and registers it in ``LAUNCH_TABLES``, which
lowering_key.py hashes into the compile caches' key (a table is changed in place, never replaced).

The kernel launch tables live next to their kernels (kernels/packed_kv.py). A table that decides
the graph's form, read by a pass on a machine that may have no Triton, lives here:
``PACKED_CORRECTION``.
"""

from __future__ import annotations

import json
import os

__all__ = ["LAUNCH_TABLES", "env_object", "with_overrides", "PACKED_CORRECTION"]

# Every launch table, by its environment variable.
LAUNCH_TABLES: dict[str, dict] = {}


def env_object(env: str, example: str) -> dict:
    """The JSON object in environment variable ``env`` ({} when unset); anything else is an error
    that shows ``example``, an object the variable takes."""
    text = os.environ.get(env, "{}")
    try:
        over = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{env}: not JSON ({e}); give an object such as '{example}'") from None
    if not isinstance(over, dict):
        raise ValueError(f"{env}: give a JSON object such as '{example}', not {text!r}")
    return over


def with_overrides(defaults: dict, env: str) -> dict:
    """``defaults`` updated from the JSON object in environment variable ``env`` (a run's launch
    parameters without editing the defaults); a key the defaults do not have is an error, so a
    stale or misspelt override cannot be silently ignored."""
    over = env_object(env, json.dumps(defaults))
    unknown = sorted(set(over) - set(defaults))
    if unknown:
        raise ValueError(f"{env}: unknown launch parameters {unknown}; known: {sorted(defaults)}")
    LAUNCH_TABLES[env] = table = {**defaults, **over}
    return table


# Sparse decode's corrections under KV quantization (loops 3..R). "read_attend" (the default since
# session 17): the kv_quant pass emits one flashloop.packed_correction_attention per site, whose CUDA
# body for one query row per kv head (Ouro's decode) reconstructs the selected keys as packed_read
# does and attends them in registers, one softmax partial per tile of keys
# (packed_kv._read_attend_kernel), then combines with O_ref - C_ref: read-then-correct's values
# without the BF16 copy's write and re-read. Session 17 (H200, 32K, per site): B1 depth 2 / 3
# 58.8 / 80.5 us against 81.1 / 93.6 for read-then-correct, B4 149.0 / 222.0 against 204.5 / 219.9;
# the 1x32K sparse + quant step 14.34 ms against 15.01 (dense 12.80), benchmarks/RESULTS.md.
# Off: the pass reads the selected keys to BF16 (flashloop.packed_read of [B, Hkv, P] positions) and
# corrects over that copy (flashloop.correction_attention); several query rows or heads per kv head
# take that form inside the op as well. "linear" (opt-in, session 15; takes precedence): the op's body
# scores and weights the selected keys on their codes (sparse_decode.correction_linear_triton; on
# tensor cores with KernelConfig.correction_mma), 1.1-1.3x slower than read-then-correct (session 16).
PACKED_CORRECTION = with_overrides({"linear": False, "read_attend": True}, "FLASHLOOP_PACKED_CORRECTION")
