"""FlashLoopConfig: the one immutable description of which FlashLoop features run and how.

Three independent groups, each off by default. A config is validated when it is built
(messages say what to change), hashes stably (the hash is part of every compile-cache key and
benchmark record), prints readably, and round-trips through a flat dict so that it can be passed
as ``torch.compile(..., backend="flashloop", options={...})``.

Loop numbers are one-based here, as in the paper: ``retention[0]`` is loop 1.
Checks that need the model (number of loops) live in :meth:`FlashLoopConfig.resolve`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = [
    "ConfigError",
    "ceil_fraction",
    "TokenSparsePrefill",
    "SparseDecodeAttention",
    "KVResidualQuantization",
    "Compilation",
    "FlashLoopConfig",
]


class ConfigError(ValueError):
    """A FlashLoop configuration that cannot be used as given."""


def _check_types(group: object) -> None:
    """Reject values of the wrong type (``"false"`` for a bool, ``64.0`` for an int)."""
    name = type(group).__name__
    for f in dataclasses.fields(group):
        v = getattr(group, f.name)
        if f.type in ("bool",) and not isinstance(v, bool):
            raise ConfigError(f"{_GROUP_KEYS[name]}.{f.name} must be true or false, got {v!r}")
        if f.type in ("int",) and (not isinstance(v, int) or isinstance(v, bool)):
            raise ConfigError(f"{_GROUP_KEYS[name]}.{f.name} must be an integer, got {v!r}")


def ceil_fraction(ratio: float, n: int) -> int:
    """``max(1, ceil(ratio * n))`` with the ratio read as the decimal the user wrote.

    Plain float arithmetic makes ``ceil(0.07 * 100)`` 8 (0.07 * 100 == 7.000000000000001); rounding
    the product to 9 decimals first gives 7, which is what "7% of 100 tokens" means.
    """
    if n <= 0:
        return 0
    return max(1, math.ceil(round(ratio * n, 9)))


def _ratio_tuple(name: str, value: Any) -> tuple[float, ...]:
    if isinstance(value, str):
        value = [v for v in value.replace(" ", "").split(",") if v]
    if isinstance(value, (int, float)):
        value = [value]
    try:
        out = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a list of numbers such as [1, 1, 0.25, 0.10], got {value!r}") from None
    for v in out:
        if not (0.0 < v <= 1.0) or math.isnan(v):
            raise ConfigError(f"{name} values must lie in (0, 1], got {v} in {list(out)}")
    return out


@dataclass(frozen=True)
class TokenSparsePrefill:
    """Loops 1-2 dense; before loop r >= 3 keep a nested top-k of prompt tokens per window.

    window: tokens per selection window, anchored at absolute prompt position 0; ``None`` means
        one window over the whole prompt (global selection).
    retention: fraction of each window's *original* length kept at each loop (one-based);
        budget = max(1, ceil(ratio * window_length)). Loops 1 and 2 must be 1.
    keep_last_token: always keep the prompt's last token active (the paper's engine); the RFC
        reserves no slot for it (False).
    """

    enabled: bool = False
    window: int | None = None
    retention: tuple[float, ...] = (1.0, 1.0, 0.25, 0.10)
    keep_last_token: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        object.__setattr__(self, "retention", _ratio_tuple("token_sparse_prefill.retention", self.retention))
        if self.window is not None and (not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1):
            raise ConfigError(f"token_sparse_prefill.window must be a positive int or None (global), got {self.window!r}")
        r = self.retention
        if len(r) < 2 or r[0] != 1.0 or r[1] != 1.0:
            raise ConfigError(
                f"token_sparse_prefill.retention must start with [1, 1] (loops 1 and 2 run densely: "
                f"they produce the two states the first score needs), got {list(r)}"
            )
        for a, b in zip(r, r[1:]):
            if b > a:
                raise ConfigError(
                    f"token_sparse_prefill.retention must be non-increasing (active sets are nested), got {list(r)}"
                )

    def budgets(self, window_length: int) -> tuple[int, ...]:
        """Static per-loop token budget of a window of this many tokens."""
        return tuple(ceil_fraction(ratio, window_length) for ratio in self.retention)

    @property
    def selects(self) -> bool:
        """Whether any selection work runs at all (all-100% retention skips it)."""
        return self.enabled and any(v < 1.0 for v in self.retention)


@dataclass(frozen=True)
class SparseDecodeAttention:
    """Loop 2 is the full-attention reference; loops 3..R recompute a top-k key set and correct.

    key_fraction: fraction of the causal keys kept per (layer, query, head) at each sparse loop;
        one number for every sparse loop, or one per loop 3..R. k = ceil(fraction * causal_length).
    reuse_selected_probabilities: loops 3..R reuse loop 2's probabilities over the selected keys
        S, renormalized over S (p_S = P_ref[S] / m), with the loop's own V: C_new = m * (p_S @ V[r, S]);
        they read no K and compute no score (the FlashLoop paper's engine option). Off: loop r's
        own softmax over S (SPEC.md section 2).
    """

    enabled: bool = False
    reference_loop: int = 2
    key_fraction: tuple[float, ...] = (0.10,)
    reuse_selected_probabilities: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        if self.reference_loop != 2:
            raise ConfigError(
                f"sparse_decode_attention.reference_loop must be 2 (the FlashLoop reference loop), got {self.reference_loop!r}"
            )
        object.__setattr__(self, "key_fraction", _ratio_tuple("sparse_decode_attention.key_fraction", self.key_fraction))
        if not self.key_fraction:
            raise ConfigError("sparse_decode_attention.key_fraction must not be empty")
        if self.reuse_selected_probabilities and not self.enabled:
            raise ConfigError(
                "sparse_decode_attention.reuse_selected_probabilities reuses sparse decode's loop-2 probabilities, "
                "but sparse decode is off: set sparse_decode_attention.enabled=true or leave "
                "reuse_selected_probabilities out"
            )

    def fraction_at(self, loop: int) -> float:
        """Key fraction of a one-based sparse loop (>= reference_loop + 1)."""
        kf = self.key_fraction
        return kf[0] if len(kf) == 1 else kf[loop - self.reference_loop - 1]

    @property
    def selects(self) -> bool:
        return self.enabled and any(v < 1.0 for v in self.key_fraction)


_PARAM_DTYPES = ("float16",)
_GROUP_SIZES = (16, 32, 64, 128)  # the packed kernels tile by a power of two in 16..128


@dataclass(frozen=True)
class KVResidualQuantization:
    """INT4 base for loop 1, INT4 residuals against the reconstructed predecessor for later loops.

    group_size: values per affine group (K: one channel across group_size token rows; V: one
        token across group_size channels of one head: the model's head_dim must be a multiple).
    tail: recent tokens kept in BF16; the tail holds tail..tail+group_size-1 tokens after each
        step and flushes whole groups. The packed cache's ring holds 2 * group_size tokens, so
        tail equals group_size (None, the default, means group_size).
    """

    enabled: bool = False
    bits: int = 4
    group_size: int = 64
    param_dtype: str = "float16"
    tail: int | None = None

    def __post_init__(self) -> None:
        _check_types(self)
        if self.bits != 4:
            raise ConfigError(f"kv_residual_quantization.bits must be 4 (the packed kernels store INT4), got {self.bits!r}")
        if self.group_size not in _GROUP_SIZES:
            raise ConfigError(f"kv_residual_quantization.group_size must be one of 16, 32, 64, 128, got {self.group_size!r}")
        if self.param_dtype not in _PARAM_DTYPES:
            raise ConfigError(
                f"kv_residual_quantization.param_dtype must be one of {_PARAM_DTYPES}, got {self.param_dtype!r}"
            )
        if self.tail is None:
            object.__setattr__(self, "tail", self.group_size)
        if not isinstance(self.tail, int) or isinstance(self.tail, bool) or self.tail != self.group_size:
            raise ConfigError(
                f"kv_residual_quantization.tail must equal group_size={self.group_size} (the packed cache keeps "
                f"{self.group_size}..{2 * self.group_size - 1} recent tokens and flushes whole groups), got {self.tail!r}: "
                f"set tail={self.group_size} or leave it out"
            )


@dataclass(frozen=True)
class Compilation:
    """How the backend compiles, not what it computes.

    outline_layers: compile each distinct layer once and reuse it for every loop and layer
        (see passes/outline.py) instead of compiling the unrolled R*N layers as one graph.
        Much faster compiles; no fusion across layer boundaries.
    position_attention: the fastest exact attention for every prefill site (passes/position_attention.py).
        A prefill of a fresh prompt (positions 0..T-1 built in the graph: the model called
        without ``input_pos``, as the engine calls a prompt's first chunk) attends its dense loops
        with causal SDPA over the prompt's own K/V (FlashAttention / cuDNN on the GPU); a prefill
        at given positions (a chunk over a stored prefix) attends through
        flashloop.position_attention, which skips the keys after a query tile's last position.
        Either replaces the model's SDPA masked over the whole cache (1x32K dense prefill on the
        H200: 3343 ms masked, 1593 ms position_attention). ``None`` (the default): wherever the
        graph has the pattern (an in-place cache, a position mask); a graph without it compiles
        unchanged. ``True``: required, an error naming the site where it cannot apply. ``False``:
        off (the model's own masked SDPA; for debugging and measuring).
    fuse_projections: linears sharing an input (Q/K/V, gate/up) become one GEMM over weights
        concatenated at compile time (passes/fuse_projections.py). Exact; in every configuration,
        features off included. Off only to debug or to measure the fusion.
    """

    outline_layers: bool = False
    position_attention: bool | None = None
    fuse_projections: bool = True

    def __post_init__(self) -> None:
        _check_types(self)
        if self.position_attention is not None and not isinstance(self.position_attention, bool):
            raise ConfigError(
                f"compilation.position_attention must be true (required), false (off) or null (wherever it applies, "
                f"the default), got {self.position_attention!r}"
            )

    @property
    def enabled(self) -> bool:
        """Whether a compilation rewrite is asked for (the default, best-effort prefill attention is not)."""
        return self.outline_layers or self.position_attention is True


_GROUP_KEYS = {
    "Compilation": "compilation",
    "TokenSparsePrefill": "token_sparse_prefill",
    "SparseDecodeAttention": "sparse_decode_attention",
    "KVResidualQuantization": "kv_residual_quantization",
}

_FEATURES: dict[str, type] = {
    "token_sparse_prefill": TokenSparsePrefill,
    "sparse_decode_attention": SparseDecodeAttention,
    "kv_residual_quantization": KVResidualQuantization,
}
_GROUPS: dict[str, type] = {**_FEATURES, "compilation": Compilation}


@dataclass(frozen=True)
class FlashLoopConfig:
    """The effective FlashLoop configuration. All features off by default (dense path)."""

    token_sparse_prefill: TokenSparsePrefill = field(default_factory=TokenSparsePrefill)
    sparse_decode_attention: SparseDecodeAttention = field(default_factory=SparseDecodeAttention)
    kv_residual_quantization: KVResidualQuantization = field(default_factory=KVResidualQuantization)
    compilation: Compilation = field(default_factory=Compilation)

    @classmethod
    def all_on(cls, **overrides: Any) -> "FlashLoopConfig":
        """Every feature enabled with default parameters (flat-dict overrides allowed)."""
        flat = {f"{g}.enabled": True for g in _FEATURES}
        flat.update(overrides)
        return cls.from_dict(flat)

    @classmethod
    def from_switches(cls, token_sparse: bool, sparse_decode: bool, quantize: bool, **overrides: Any) -> "FlashLoopConfig":
        """One of the 8 feature combinations, default parameters."""
        flat = {
            "token_sparse_prefill.enabled": token_sparse,
            "sparse_decode_attention.enabled": sparse_decode,
            "kv_residual_quantization.enabled": quantize,
        }
        flat.update(overrides)
        return cls.from_dict(flat)

    @property
    def any_enabled(self) -> bool:
        """Whether any FlashLoop feature is on (compilation settings are not features)."""
        return any(getattr(self, g).enabled for g in _FEATURES)

    @property
    def switches(self) -> tuple[bool, bool, bool]:
        return tuple(getattr(self, g).enabled for g in _FEATURES)  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        """Flat ``{"group.param": value}`` dict (lists for tuples): the torch.compile ``options`` form."""
        flat: dict[str, Any] = {}
        for g in _GROUPS:
            for f in dataclasses.fields(getattr(self, g)):
                v = getattr(getattr(self, g), f.name)
                flat[f"{g}.{f.name}"] = list(v) if isinstance(v, tuple) else v
        return flat

    @classmethod
    def from_dict(cls, options: Mapping[str, Any] | None) -> "FlashLoopConfig":
        """Build from the flat dict of :meth:`to_dict`; unknown keys are errors."""
        grouped: dict[str, dict[str, Any]] = {g: {} for g in _GROUPS}
        for key, value in (options or {}).items():
            group, _, name = str(key).partition(".")
            if group not in _GROUPS or not name:
                raise ConfigError(
                    f"unknown FlashLoop option {key!r}: keys look like 'group.parameter' with group one of {sorted(_GROUPS)}"
                )
            names = {f.name for f in dataclasses.fields(_GROUPS[group])}
            if name not in names:
                raise ConfigError(f"unknown FlashLoop option {key!r}: {group} has parameters {sorted(names)}")
            grouped[group][name] = value
        return cls(**{g: _GROUPS[g](**kw) for g, kw in grouped.items()})

    @classmethod
    def coerce(cls, options: "FlashLoopConfig | Mapping[str, Any] | None") -> "FlashLoopConfig":
        """Accept a config object, its flat dict, or None (all off)."""
        if isinstance(options, FlashLoopConfig):
            return options
        if options is not None and not isinstance(options, Mapping):
            raise ConfigError(f"FlashLoop options must be a FlashLoopConfig or a flat dict, got {type(options).__name__}")
        return cls.from_dict(options)

    def resolve(self, num_loops: int, *, forward_loops: int | None = None, head_dim: int | None = None) -> "FlashLoopConfig":
        """Check the config against a model with ``num_loops`` loops (and ``head_dim``, if given); returns self.

        ``forward_loops``: a graph that runs fewer loops than the model (``exit_at_step``) is
        checked against what it runs: loops below a feature's start simply stay dense.
        """
        tsp, sda, kvq = self.token_sparse_prefill, self.sparse_decode_attention, self.kv_residual_quantization
        strict = forward_loops is None
        if kvq.enabled and strict and num_loops < 2:
            raise ConfigError(
                f"kv_residual_quantization needs a looped model (residuals against the previous loop); the model runs "
                f"{num_loops} loop: turn kv_residual_quantization off"
            )
        if kvq.enabled and head_dim is not None and head_dim % kvq.group_size:
            fits = [g for g in _GROUP_SIZES[::-1] if head_dim % g == 0]
            hint = f"set kv_residual_quantization.group_size={fits[0]}" if fits else "no group size fits: turn kv_residual_quantization off"
            raise ConfigError(
                f"kv_residual_quantization.group_size={kvq.group_size} must divide the model's head_dim={head_dim} (a V "
                f"group lies within one head): {hint}"
            )
        if tsp.enabled and (len(tsp.retention) != num_loops if strict else len(tsp.retention) < forward_loops):
            raise ConfigError(
                f"token_sparse_prefill.retention has {len(tsp.retention)} entries but the model runs {num_loops} loops: "
                f"give one ratio per loop"
            )
        if sda.enabled:
            n_sparse = num_loops - sda.reference_loop
            if strict and n_sparse < 1:
                raise ConfigError(
                    f"sparse_decode_attention needs at least {sda.reference_loop + 1} loops (reference loop "
                    f"{sda.reference_loop} plus a sparse loop); the model runs {num_loops}"
                )
            if len(sda.key_fraction) != 1 and (len(sda.key_fraction) != n_sparse if strict else len(sda.key_fraction) < n_sparse):
                raise ConfigError(
                    f"sparse_decode_attention.key_fraction has {len(sda.key_fraction)} entries; give one number or "
                    f"one per sparse loop 3..{num_loops} ({max(n_sparse, 0)} entries)"
                )
        return self

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    def hash(self) -> str:
        """Stable short hash of the effective configuration (compile-cache keys, benchmark records)."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    def __str__(self) -> str:
        parts = []
        for g in _GROUPS:
            grp = getattr(self, g)
            if not grp.enabled:
                if g in _FEATURES:
                    parts.append(f"{g}=off")
                continue
            params = ", ".join(
                f"{f.name}={list(getattr(grp, f.name)) if isinstance(getattr(grp, f.name), tuple) else getattr(grp, f.name)}"
                for f in dataclasses.fields(grp)
                if f.name != "enabled"
            )
            parts.append(f"{g}=on({params})")
        return f"FlashLoopConfig[{self.hash()}]({'; '.join(parts)})"
