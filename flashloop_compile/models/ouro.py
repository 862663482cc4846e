"""Ouro: a looped (recurrent-depth) decoder, compatible with the Hugging Face Ouro release.

The whole model in one file (gpt-fast style). One embedding, N shared decoder layers applied R
times ("loops", ``total_ut_steps``), a final RMSNorm after every loop whose output is both the
next loop's input and the input of the early-exit gate, and an untied LM head.

Parameter names and ``config.json`` fields are those of the HF checkpoints, so real weights
load with :meth:`OuroForCausalLM.from_pretrained` and :meth:`save_pretrained` writes the same
layout. The KV cache is one K and one V buffer per (loop, layer), allocated once by
:meth:`OuroForCausalLM.setup_caches` and written in place at ``input_pos``; prefill and decode
share one ``forward``. Batches are right-padded: row b's token t sits at absolute position
``input_pos[b, t]``, so causal masking by position keeps padding out of every valid row.

Loop numbers are one-based in docs and readouts (``exit_at_step=1`` is the first loop), depth
indices zero-based in code.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "OuroConfig",
    "ModelConfigError",
    "Readout",
    "KVCache",
    "OuroForCausalLM",
    "PRESETS",
    "rope_cos_sin",
    "apply_rope",
    "exit_probabilities",
    "combine_readout",
]


class ModelConfigError(ValueError):
    """An Ouro config.json or preset that this implementation cannot run."""


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelConfigError(f"{file} is not valid JSON ({e})") from None


@dataclass(frozen=True)
class OuroConfig:
    vocab_size: int = 49152
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 24
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    head_dim: int | None = None
    max_position_embeddings: int = 65536
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    total_ut_steps: int = 4
    early_exit_threshold: float = 1.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_attention_heads, 1))
        positive = (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "total_ut_steps",
        )
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ModelConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads} (grouped-query attention)"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not (self.rope_theta > 0):
            raise ModelConfigError(f"rope_theta must be positive, got {self.rope_theta!r}")
        if not (self.rms_norm_eps > 0):
            raise ModelConfigError(f"rms_norm_eps must be positive, got {self.rms_norm_eps!r}")
        if not (0.0 <= self.early_exit_threshold <= 1.0):
            raise ModelConfigError(f"early_exit_threshold must lie in [0, 1], got {self.early_exit_threshold!r}")

    @property
    def num_loops(self) -> int:
        return self.total_ut_steps

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "OuroConfig":
        """From an HF ``config.json`` dict; fields this model does not implement are errors."""
        model_type = d.get("model_type", "ouro")
        if model_type != "ouro":
            raise ModelConfigError(
                f"model_type={model_type!r} is not supported: expected model_type 'ouro' (an Ouro checkpoint; "
                f"FlashLoop runs looped Ouro models only)"
            )
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(f"hidden_act={act!r} is not supported: Ouro uses a SwiGLU MLP ('silu')")
        if d.get("rope_scaling"):
            raise ModelConfigError(f"rope_scaling={d['rope_scaling']!r} is not supported: remove it or set it to null")
        if d.get("use_sliding_window") or (d.get("sliding_window") and d.get("use_sliding_window", False)):
            raise ModelConfigError("sliding-window attention is not supported: set use_sliding_window to false")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in names}
        if "num_key_value_heads" in kwargs and kwargs["num_key_value_heads"] is None:
            # HF OuroConfig: a null num_key_value_heads means multi-head attention.
            kwargs["num_key_value_heads"] = kwargs.get("num_attention_heads", cls.num_attention_heads)
        if isinstance(kwargs.get("eos_token_id"), list) and len(kwargs["eos_token_id"]) == 1:
            kwargs["eos_token_id"] = kwargs["eos_token_id"][0]
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(model_type="ouro", architectures=["OuroForCausalLM"], hidden_act="silu", rope_scaling=None)
        return d


PRESETS: dict[str, OuroConfig] = {
    # CPU tests: small enough for the Triton interpreter, every structural feature kept (R=4, MHA,
    # head_dim 64 so a V quantization group of 64 channels is one head's row, as in the real models).
    "tiny": OuroConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, rope_theta=10_000.0,
    ),
    # Real shapes (random weights) for GPU benchmarks.
    "ouro-1.4b": OuroConfig(num_hidden_layers=24),
    "ouro-2.6b": OuroConfig(num_hidden_layers=48),
}


@dataclass(frozen=True)
class Readout:
    """Which loop's logits a forward returns.

    last: the final loop (all R loops run) — the default.
    step: ``exit_at_step`` (one-based); only loops 1..step run, so later loops' caches are not
        written for these tokens: keep one depth per generation.
    threshold: per token, the first loop whose cumulative exit probability (FP32) reaches tau;
        all loops run.
    weighted: expected logits, sum_t p_t * logits_t; all loops run.
    """

    kind: Literal["last", "step", "threshold", "weighted"] = "last"
    step: int | None = None
    threshold: float | None = None

    @classmethod
    def exit_at_step(cls, k: int) -> "Readout":
        return cls("step", step=k)

    @classmethod
    def at_threshold(cls, tau: float) -> "Readout":
        return cls("threshold", threshold=tau)

    def loops_to_run(self, num_loops: int) -> int:
        if self.kind == "step":
            if self.step is None or not (1 <= self.step <= num_loops):
                raise ValueError(f"exit_at_step must be in 1..{num_loops}, got {self.step!r}")
            return self.step
        if self.kind == "threshold" and (self.threshold is None or not (0.0 <= self.threshold <= 1.0)):
            raise ValueError(f"threshold readout needs tau in [0, 1], got {self.threshold!r}")
        if self.kind not in ("last", "step", "threshold", "weighted"):
            raise ValueError(f"unknown readout {self.kind!r}: use last, step, threshold or weighted")
        return num_loops

    @property
    def needs_gate(self) -> bool:
        return self.kind in ("threshold", "weighted")


LAST = Readout()


def exit_probabilities(gate_logits: Sequence[Tensor]) -> Tensor:
    """p_t = lambda_t * prod_{j<t}(1 - lambda_j), the last loop taking the remainder; FP32, [..., R]."""
    lam = torch.sigmoid(torch.stack([g.float() for g in gate_logits], dim=-1))
    survive = torch.cumprod(1.0 - lam, dim=-1)
    prev = torch.cat([torch.ones_like(survive[..., :1]), survive[..., :-1]], dim=-1)
    p = lam * prev
    return torch.cat([p[..., :-1], prev[..., -1:]], dim=-1)


def combine_readout(loop_logits: Sequence[Tensor], gate_logits: Sequence[Tensor], readout: Readout) -> Tensor:
    """Apply a readout to per-loop logits [..., V] and gate logits [..., 1] (one per loop run)."""
    if readout.kind in ("last", "step"):
        return loop_logits[-1]
    p = exit_probabilities([g.squeeze(-1) for g in gate_logits])  # [..., R]
    if readout.kind == "weighted":
        return sum(p[..., t, None] * loop_logits[t].float() for t in range(len(loop_logits))).to(loop_logits[0].dtype)
    # threshold: first loop whose FP32 cumulative probability reaches tau; the last loop otherwise.
    cdf = torch.cumsum(p, dim=-1)
    reached = cdf >= readout.threshold
    reached[..., -1] = True
    exit_idx = torch.argmax(reached.to(torch.int8), dim=-1)  # first True
    stacked = torch.stack(list(loop_logits), dim=-2)  # [..., R, V]
    return torch.gather(stacked, -2, exit_idx[..., None, None].expand(*exit_idx.shape, 1, stacked.shape[-1])).squeeze(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos/sin [*positions.shape, head_dim] (HF layout: the half-frequencies repeated), computed in FP32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, T, D]; cos/sin [B, T, D]."""
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


class KVCache(nn.Module):
    """One (loop, layer)'s K and V, [max_batch, kv_heads, max_seq, head_dim], updated in place.

    Two separate registered buffers per (loop, layer): inductor then keeps the ``index_put_`` in
    place. (Views into one big tensor made inductor copy the whole cache every decode step.)
    """

    def __init__(
        self, max_batch: int, kv_heads: int, max_seq: int, head_dim: int, dtype: torch.dtype, device: Any, storage: bool = True
    ) -> None:
        super().__init__()
        shape = (max_batch, kv_heads, max_seq, head_dim)
        for name in ("k_cache", "v_cache"):
            # storage=False: a zero-byte stand-in with the cache's shape (every element aliases one
            # value) for compiled runs whose cache lives elsewhere; an eager write into it fails.
            buf = torch.zeros(shape, dtype=dtype, device=device) if storage else torch.zeros(1, dtype=dtype, device=device).expand(shape)
            self.register_buffer(name, buf, persistent=False)
        self.has_storage = storage

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Write k/v [B, Hkv, T, D] at per-row positions input_pos [B, T]; return this batch's K/V."""
        if not self.has_storage and not torch.compiler.is_compiling():
            raise RuntimeError(
                "this KV cache was set up without storage (setup_caches(storage=False)): run the model compiled "
                "with backend='flashloop' and kv_residual_quantization enabled, or call setup_caches(storage=True)"
            )
        b = k.shape[0]
        rows = torch.arange(b, device=k.device)[:, None]
        self.k_cache[rows, :, input_pos] = k.transpose(1, 2)
        self.v_cache[rows, :, input_pos] = v.transpose(1, 2)
        return self.k_cache[:b], self.v_cache[:b]


class OuroAttention(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, input_pos: Tensor, cache: KVCache | None) -> Tensor:
        bsz, seqlen, _ = x.shape
        q = self.q_proj(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seqlen, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seqlen, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(input_pos, k, v)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(y.transpose(1, 2).reshape(bsz, seqlen, self.n_heads * self.head_dim))


class OuroMLP(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class OuroDecoderLayer(nn.Module):
    """Sandwich norms: each sub-block's input and output are normalized before the residual add."""

    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = OuroAttention(config)
        self.mlp = OuroMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(config.hidden_size, eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, input_pos: Tensor, cache: KVCache | None) -> Tensor:
        x = x + self.input_layernorm_2(self.self_attn(self.input_layernorm(x), cos, sin, mask, input_pos, cache))
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))


class OuroModel(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(OuroDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1, bias=True)
        self.kv_caches: nn.ModuleList | None = None  # R * N, index loop * N + layer

    def cache_at(self, loop: int, layer: int) -> KVCache | None:
        """The cache of zero-based (loop, layer), or None before setup_caches."""
        return None if self.kv_caches is None else self.kv_caches[loop * len(self.layers) + layer]

    def forward(self, input_ids: Tensor, input_pos: Tensor, num_loops: int, with_gate: bool) -> tuple[list[Tensor], list[Tensor]]:
        """Run ``num_loops`` loops; return each loop's normalized state and (if asked) gate logits."""
        cfg = self.config
        h = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(input_pos, cfg.head_dim, cfg.rope_theta, h.dtype)
        if self.kv_caches is None:
            key_pos = input_pos
        else:
            max_seq = self.kv_caches[0].k_cache.shape[2]
            key_pos = torch.arange(max_seq, device=input_ids.device)[None].expand(input_ids.shape[0], -1)
        mask = (key_pos[:, None, None, :] <= input_pos[:, None, :, None])  # [B, 1, T, S]
        states: list[Tensor] = []
        gates: list[Tensor] = []
        for loop in range(num_loops):
            for i, layer in enumerate(self.layers):
                h = layer(h, cos, sin, mask, input_pos, self.cache_at(loop, i))
            h = self.norm(h)
            states.append(h)
            if with_gate:
                gates.append(self.early_exit_gate(h))
        return states, gates


class OuroForCausalLM(nn.Module):
    def __init__(self, config: OuroConfig) -> None:
        super().__init__()
        self.config = config
        self.model = OuroModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def from_preset(cls, name: str, *, dtype: torch.dtype = torch.float32, device: Any = "cpu", seed: int = 0,
                    **overrides: Any) -> "OuroForCausalLM":
        """Random-init model of a preset's shape (``tiny``, ``ouro-1.4b``, ``ouro-2.6b``);
        ``overrides``: OuroConfig fields to change (e.g. ``num_hidden_layers`` for a shorter stack)."""
        if name not in PRESETS:
            raise ModelConfigError(f"unknown preset {name!r}: choose one of {sorted(PRESETS)}")
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(OuroConfig)})
        if unknown:
            raise ModelConfigError(f"unknown OuroConfig fields {unknown}: override fields of {sorted(f.name for f in dataclasses.fields(OuroConfig))}")
        config = dataclasses.replace(PRESETS[name], **overrides)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.device(device):
                model = cls(config)
            model.init_random_()
        return model.to(dtype=dtype)

    @torch.no_grad()
    def init_random_(self) -> "OuroForCausalLM":
        """normal(0, 1/sqrt(fan_in)) matrices (embeddings 1), unit norms, zero biases.

        Fan-in scaling keeps activations O(1) at every size, so even the tiny preset produces
        varied tokens rather than one repeated argmax.
        """
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5)
        return self

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype: torch.dtype | None = None, device: Any = "cpu") -> "OuroForCausalLM":
        """Load an HF-layout directory: config.json plus model.safetensors or a sharded index."""
        from safetensors.torch import load_file

        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} not found: from_pretrained needs an HF model directory")
        raw = _read_json(cfg_file)
        if not isinstance(raw, dict):
            raise ModelConfigError(f"{cfg_file} holds {type(raw).__name__}, not a JSON object of config fields")
        try:
            config = OuroConfig.from_dict(raw)
        except ModelConfigError as e:
            raise ModelConfigError(f"{cfg_file}: {e}") from None
        single, index = path / "model.safetensors", path / "model.safetensors.index.json"
        if single.is_file():
            files = [single]
        elif index.is_file():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelConfigError(f"{index} has no 'weight_map' object: the file is not a safetensors index")
            files = [path / f for f in sorted(set(weight_map.values()))]
        else:
            raise FileNotFoundError(f"{path} has neither model.safetensors nor model.safetensors.index.json")
        state: dict[str, Tensor] = {}
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f} not found (listed in {index})")
            try:
                state.update(load_file(str(f), device=str(device)))
            except Exception as e:  # safetensors raises its own error types for a damaged header or data
                raise ModelConfigError(f"{f} is not a readable safetensors file ({type(e).__name__}: {e})") from None
        with torch.device("meta"):
            model = cls(config)
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        expected = set(model.state_dict().keys())
        if config.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise ModelConfigError(
                f"checkpoint {path} does not match the Ouro layout: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        if dtype is not None:
            state = {k: v.to(dtype) for k, v in state.items()}
        model.load_state_dict(state, assign=True, strict=not config.tie_word_embeddings)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model

    @classmethod
    def from_hf(cls, hf_model_or_path: Any, *, dtype: torch.dtype | None = None, device: Any = None) -> "OuroForCausalLM":
        """This model from a Hugging Face Ouro: an in-memory model (``transformers``' remote-code
        ``OuroForCausalLM``: its ``config`` and ``state_dict()``) or a checkpoint directory.

        The weights are the same tensors (no copy; ``dtype``/``device`` convert them), so the
        logits equal the HF model's. Unlike the HF model, whose cache grows by concatenation, this
        model's cache is written in place (:meth:`setup_caches`), which FlashLoop's features need.
        """
        if isinstance(hf_model_or_path, (str, os.PathLike)):
            return cls.from_pretrained(hf_model_or_path, dtype=dtype, device=device or "cpu")
        hf_config = getattr(hf_model_or_path, "config", None)
        if not isinstance(hf_model_or_path, nn.Module) or hf_config is None:
            raise TypeError(
                f"from_hf takes a Hugging Face Ouro model (an nn.Module with a .config) or a checkpoint directory, "
                f"got {type(hf_model_or_path).__name__}"
            )
        raw = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(vars(hf_config))
        config = OuroConfig.from_dict(raw)
        state = {k: v.detach() for k, v in hf_model_or_path.state_dict().items()}
        with torch.device("meta"):
            model = cls(config)
        expected = set(model.state_dict().keys())
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
            expected.discard("lm_head.weight")
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise ModelConfigError(
                f"{type(hf_model_or_path).__name__} does not have the Ouro layout: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}"
            )
        if dtype is not None or device is not None:
            state = {k: v.to(dtype=dtype, device=device) for k, v in state.items()}
        model.load_state_dict(state, assign=True, strict=not config.tie_word_embeddings)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return model.train(hf_model_or_path.training)

    def save_pretrained(self, path: str | os.PathLike, *, max_shard_bytes: int | None = None) -> list[Path]:
        """Write config.json and the weights with the HF parameter names: model.safetensors, or,
        where they exceed ``max_shard_bytes``, HF's sharded layout (model-0000i-of-0000n.safetensors,
        each at most ``max_shard_bytes`` unless one tensor alone is larger, and
        model.safetensors.index.json), which :meth:`from_pretrained` reads too. Weight files of the
        other layout left in ``path`` by an earlier save are removed (from_pretrained prefers
        model.safetensors). Returns the weight files written (the index included)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2, sort_keys=True))
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        nbytes = {k: v.numel() * v.element_size() for k, v in state.items()}
        for old in [*path.glob("model-*-of-*.safetensors"), path / "model.safetensors.index.json", path / "model.safetensors"]:
            old.unlink(missing_ok=True)
        if max_shard_bytes is None or sum(nbytes.values()) <= max_shard_bytes:
            save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
            return [path / "model.safetensors"]
        groups: list[list[str]] = [[]]
        size = 0
        for k in state:  # in state_dict order, a new shard where the next tensor would overflow this one
            if groups[-1] and size + nbytes[k] > max_shard_bytes:
                groups.append([])
                size = 0
            groups[-1].append(k)
            size += nbytes[k]
        files, weight_map = [], {}
        for i, names in enumerate(groups, start=1):
            f = path / f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            save_file({k: state[k] for k in names}, str(f), metadata={"format": "pt"})
            weight_map.update({k: f.name for k in names})
            files.append(f)
        index = path / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {"total_size": sum(nbytes.values())}, "weight_map": weight_map},
                                    indent=2, sort_keys=True))
        return files + [index]

    # -- cache ------------------------------------------------------------------------------------
    def setup_caches(
        self, max_batch: int, max_seq: int, *, dtype: torch.dtype | None = None, device: Any = None, storage: bool = True
    ) -> None:
        """Allocate one K and one V buffer per (loop, layer); zero-filled, allocated once.

        ``storage=False`` allocates nothing: the buffers only describe the cache's shape, for a
        compiled model whose KV lives in a packed cache (kv_residual_quantization).
        """
        cfg = self.config
        if max_seq > cfg.max_position_embeddings:
            raise ValueError(f"max_seq={max_seq} exceeds max_position_embeddings={cfg.max_position_embeddings}")
        ref = self.lm_head.weight
        dtype, device = dtype or ref.dtype, device or ref.device
        self.model.kv_caches = nn.ModuleList(
            KVCache(max_batch, cfg.num_key_value_heads, max_seq, cfg.head_dim, dtype, device, storage)
            for _ in range(cfg.num_loops * cfg.num_hidden_layers)
        )

    def clear_caches(self) -> None:
        self.model.kv_caches = None

    @property
    def cache_capacity(self) -> tuple[int, int] | None:
        """(max_batch, max_seq) of the allocated caches, or None."""
        if self.model.kv_caches is None:
            return None
        k = self.model.kv_caches[0].k_cache
        return k.shape[0], k.shape[2]

    # -- forward ----------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        input_pos: Tensor | None = None,
        *,
        readout: Readout = LAST,
        logits_index: Tensor | None = None,
    ) -> Tensor:
        """Logits [B, T, V] (or [B, K, V] at ``logits_index`` [B, K]) under ``readout``.

        input_pos: absolute positions, [B, T] (or [T], shared by every row); default 0..T-1.
        With caches set up the K/V of these positions are written and every earlier position of
        the row is attended; without caches the forward attends within ``input_ids`` only.
        """
        states, gates = self.forward_loops(input_ids, input_pos, readout=readout)
        if logits_index is not None:
            states = [torch.gather(s, 1, logits_index[..., None].expand(-1, -1, s.shape[-1])) for s in states]
            gates = [torch.gather(g, 1, logits_index[..., None]) for g in gates]
        if readout.kind in ("last", "step"):
            return self.lm_head(states[-1])
        return combine_readout([self.lm_head(s) for s in states], gates, readout)

    def forward_loops(self, input_ids: Tensor, input_pos: Tensor | None = None, *, readout: Readout = LAST) -> tuple[list[Tensor], list[Tensor]]:
        """Every loop's normalized hidden state [B, T, hidden] and gate logits [B, T, 1]."""
        input_pos = self._check_inputs(input_ids, input_pos)
        return self.model(input_ids, input_pos, readout.loops_to_run(self.config.num_loops), readout.needs_gate)

    def _check_inputs(self, input_ids: Tensor, input_pos: Tensor | None) -> Tensor:
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        bsz, seqlen = input_ids.shape
        if input_pos is None:
            input_pos = torch.arange(seqlen, device=input_ids.device)
        if input_pos.dim() == 1:
            input_pos = input_pos[None].expand(bsz, -1)
        if tuple(input_pos.shape) != (bsz, seqlen):
            raise ValueError(f"input_pos must be [batch, tokens] = {(bsz, seqlen)} or [tokens], got {tuple(input_pos.shape)}")
        cap = self.cache_capacity
        if cap is not None and bsz > cap[0]:
            raise ValueError(f"batch {bsz} exceeds the cache's max_batch={cap[0]}: call setup_caches with a larger max_batch")
        return input_pos
