# coding=utf-8
"""PyTorch Ouro model, written the way Hugging Face ``transformers`` writes its decoder models.

This is an independent re-implementation used as a *test fixture* for the FlashLoop backend: the
backend must find Ouro's recurrent block in the Dynamo graph of any reasonable implementation, not
only in the one shipped in ``flashloop_compile.models.ouro``. Everything here follows the shapes
and idioms of ``modeling_llama.py`` / ``modeling_qwen2.py`` / the Ouro remote code:

* one ``OuroRotaryEmbedding`` call per forward, ``(cos, sin)`` handed to every layer as
  ``position_embeddings``;
* an additive float causal mask (``torch.finfo(dtype).min`` for masked entries) built once from
  ``cache_position`` (plus an optional 2-D padding mask) and handed to every layer;
* ``repeat_kv`` (expand + reshape) for grouped-query attention, eager attention via
  ``torch.matmul`` + fp32 softmax, or SDPA;
* a dynamic cache that grows with ``torch.cat``, indexed ``current_ut * num_hidden_layers +
  layer_idx`` like Ouro's ``UniversalTransformerCache``.

Only plain ``torch`` is used (``transformers`` is not a dependency). Parameter names are those of
the HF Ouro checkpoints, so ``load_state_dict`` works with ``flashloop_compile``'s model.

Extra switches for negative tests of the backend (structures it must reject):
``use_sliding_window``/``sliding_window`` (sliding-window attention), ``position_embedding_type=
"alibi"`` (ALiBi instead of RoPE), ``total_ut_steps=1`` (no loop) and :class:`LlamaStyleForCausalLM`
(a plain pre-norm decoder without loops or sandwich norms).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "HFStyleOuroConfig",
    "LoopedDynamicCache",
    "OuroRMSNorm",
    "OuroRotaryEmbedding",
    "rotate_half",
    "apply_rotary_pos_emb",
    "repeat_kv",
    "eager_attention_forward",
    "sdpa_attention_forward",
    "ALL_ATTENTION_FUNCTIONS",
    "build_alibi_slopes",
    "prepare_4d_causal_attention_mask_with_cache_position",
    "causal_mask_function",
    "padding_mask_function",
    "and_masks",
    "sdpa_mask",
    "eager_mask",
    "OuroAttention",
    "OuroMLP",
    "OuroDecoderLayer",
    "OuroModel",
    "OuroModelOutput",
    "OuroCausalLMOutputWithPast",
    "OuroForCausalLM",
    "LlamaStyleDecoderLayer",
    "LlamaStyleModel",
    "LlamaStyleForCausalLM",
]


# ------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------
class HFStyleOuroConfig:
    r"""Configuration of an HF-style Ouro model (a stand-in for ``transformers.PretrainedConfig``).

    Args:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads:
            the usual decoder sizes.
        num_key_value_heads: KV heads for grouped-query attention (defaults to
            ``num_attention_heads``).
        head_dim: per-head size (defaults to ``hidden_size // num_attention_heads``).
        total_ut_steps: number of recurrent ("universal transformer") steps over the layer stack.
        use_sliding_window / sliding_window: hide keys at distance ``>= sliding_window`` from
            the query (negative-test variant).
        position_embedding_type: ``"rope"`` (Ouro) or ``"alibi"`` (negative-test variant).
        attn_implementation: ``"eager"`` or ``"sdpa"``.
        mask_implementation: ``"prepare_4d"`` (the 4-D additive mask of older ``transformers``)
            or ``"masking_utils"`` (the published Ouro code: ``transformers.masking_utils``'
            ``create_causal_mask``, a mask function vmapped over batch, head, query and key).
    """

    model_type = "ouro"

    def __init__(
        self,
        vocab_size: int = 49152,
        hidden_size: int = 2048,
        intermediate_size: int = 5632,
        num_hidden_layers: int = 24,
        num_attention_heads: int = 16,
        num_key_value_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        hidden_act: str = "silu",
        max_position_embeddings: int = 65536,
        initializer_range: float = 0.02,
        rms_norm_eps: float = 1e-6,
        use_cache: bool = True,
        tie_word_embeddings: bool = False,
        rope_theta: float = 1000000.0,
        attention_bias: bool = False,
        attention_dropout: float = 0.0,
        use_sliding_window: bool = False,
        sliding_window: Optional[int] = 4096,
        position_embedding_type: str = "rope",
        total_ut_steps: int = 4,
        early_exit_threshold: float = 1.0,
        pad_token_id: Optional[int] = None,
        bos_token_id: Optional[int] = 1,
        eos_token_id: Optional[int] = 2,
        attn_implementation: str = "eager",
        mask_implementation: str = "prepare_4d",
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        if num_key_value_heads is None:
            num_key_value_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim if head_dim is not None else hidden_size // num_attention_heads
        self.hidden_act = hidden_act
        self.max_position_embeddings = max_position_embeddings
        self.initializer_range = initializer_range
        self.rms_norm_eps = rms_norm_eps
        self.use_cache = use_cache
        self.tie_word_embeddings = tie_word_embeddings
        self.rope_theta = rope_theta
        self.attention_bias = attention_bias
        self.attention_dropout = attention_dropout
        self.use_sliding_window = use_sliding_window
        self.sliding_window = sliding_window if use_sliding_window else None
        if position_embedding_type not in ("rope", "alibi"):
            raise ValueError(f"position_embedding_type must be 'rope' or 'alibi', got {position_embedding_type!r}")
        self.position_embedding_type = position_embedding_type
        self.total_ut_steps = total_ut_steps
        self.early_exit_threshold = early_exit_threshold
        self.pad_token_id = pad_token_id
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        if attn_implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"attn_implementation must be one of {sorted(ALL_ATTENTION_FUNCTIONS)}, got {attn_implementation!r}")
        self._attn_implementation = attn_implementation
        if mask_implementation not in ("prepare_4d", "masking_utils"):
            raise ValueError(f"mask_implementation must be 'prepare_4d' or 'masking_utils', got {mask_implementation!r}")
        self.mask_implementation = mask_implementation
        self.layer_types = [
            "sliding_attention" if self.sliding_window is not None else "full_attention"
            for _ in range(num_hidden_layers)
        ]
        for key, value in kwargs.items():  # unknown config.json fields are kept, as HF does
            setattr(self, key, value)

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **overrides: Any) -> "HFStyleOuroConfig":
        config_dict = {k: v for k, v in config_dict.items() if k not in ("model_type", "architectures", "rope_scaling")}
        config_dict.update(overrides)
        return cls(**config_dict)

    @classmethod
    def from_ouro_config(cls, config: Any, **overrides: Any) -> "HFStyleOuroConfig":
        """From ``flashloop_compile.models.ouro.OuroConfig`` (anything with ``to_dict()``)."""
        return cls.from_dict(config.to_dict(), **overrides)

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "layer_types"}
        out["attn_implementation"] = out.pop("_attn_implementation")
        out["model_type"] = self.model_type
        return out

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.to_dict()})"


def _as_hf_config(config: Any, **overrides: Any) -> HFStyleOuroConfig:
    if isinstance(config, HFStyleOuroConfig):
        if not overrides:
            return config
        return HFStyleOuroConfig.from_dict(config.to_dict(), **overrides)
    return HFStyleOuroConfig.from_ouro_config(config, **overrides)


ACT2FN: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,
    "relu": nn.functional.relu,
}


# ------------------------------------------------------------------------------------------------
# Cache
# ------------------------------------------------------------------------------------------------
class LoopedDynamicCache:
    """A dynamic KV cache for looped models (cf. Ouro's ``UniversalTransformerCache``).

    One ``[batch, num_key_value_heads, seq_len, head_dim]`` key and value tensor per cache slot,
    kept in two plain Python lists. Ouro uses slot ``current_ut * num_hidden_layers + layer_idx``,
    so a model with ``R`` recurrent steps and ``N`` layers fills ``R * N`` slots. ``update``
    appends the new states along the sequence dimension with ``torch.cat`` and returns the full
    keys and values of that slot.
    """

    def __init__(self, max_cache_size: Optional[int] = None) -> None:
        self.key_cache: list[Optional[torch.Tensor]] = []
        self.value_cache: list[Optional[torch.Tensor]] = []
        self.max_cache_size = max_cache_size

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: Optional[dict[str, Any]] = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.max_cache_size is not None and layer_idx >= self.max_cache_size:
            raise IndexError(f"cache index {layer_idx} exceeds max_cache_size={self.max_cache_size}")
        while len(self.key_cache) <= layer_idx:
            self.key_cache.append(None)
            self.value_cache.append(None)
        cached_key = self.key_cache[layer_idx]
        cached_value = self.value_cache[layer_idx]
        if cached_key is None or cached_value is None:
            self.key_cache[layer_idx] = key_states
            self.value_cache[layer_idx] = value_states
        else:
            self.key_cache[layer_idx] = torch.cat([cached_key, key_states], dim=-2)
            self.value_cache[layer_idx] = torch.cat([cached_value, value_states], dim=-2)
        return self.key_cache[layer_idx], self.value_cache[layer_idx]

    def get_seq_length(self, layer_idx: Optional[int] = 0) -> int:
        if layer_idx is None:
            layer_idx = 0
        if len(self.key_cache) <= layer_idx or self.key_cache[layer_idx] is None:
            return 0
        return self.key_cache[layer_idx].shape[-2]

    def __len__(self) -> int:
        return len(self.key_cache)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for idx in range(len(self.key_cache)):
            if self.key_cache[idx] is not None:
                self.key_cache[idx] = self.key_cache[idx].index_select(0, beam_idx)
                self.value_cache[idx] = self.value_cache[idx].index_select(0, beam_idx)


# ------------------------------------------------------------------------------------------------
# Building blocks
# ------------------------------------------------------------------------------------------------
class OuroRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        """OuroRMSNorm is equivalent to T5LayerNorm."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class OuroRotaryEmbedding(nn.Module):
    def __init__(self, config: HFStyleOuroConfig, device: Optional[torch.device] = None) -> None:
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = "default"
        inv_freq, self.attention_scaling = self.compute_default_rope_parameters(config, device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.original_inv_freq = self.inv_freq

    @staticmethod
    def compute_default_rope_parameters(
        config: HFStyleOuroConfig, device: Optional[torch.device] = None
    ) -> tuple[torch.Tensor, float]:
        base = config.rope_theta
        dim = config.head_dim
        attention_factor = 1.0  # unused for the default rope type
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim))
        return inv_freq, attention_factor

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.LongTensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1).to(x.device)
        position_ids_expanded = position_ids[:, None, :].float()

        device_type = x.device.type if isinstance(x.device.type, str) and x.device.type != "mps" else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):  # Force float32
            freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = emb.cos() * self.attention_scaling
            sin = emb.sin() * self.attention_scaling

        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims of the input."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """Applies Rotary Position Embedding to the query and key tensors.

    Args:
        q (`torch.Tensor`): The query tensor.
        k (`torch.Tensor`): The key tensor.
        cos (`torch.Tensor`): The cosine part of the rotary embedding.
        sin (`torch.Tensor`): The sine part of the rotary embedding.
        position_ids (`torch.Tensor`, *optional*): Deprecated and unused.
        unsqueeze_dim (`int`, *optional*, defaults to 1):
            The dimension along which to unsqueeze cos[position_ids] and sin[position_ids] so that
            they can be properly broadcasted to the dimensions of q and k.
    Returns:
        `tuple(torch.Tensor)` comprising of the query and key tensors rotated using the Rotary
        Position Embedding.
    """
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    """
    This is the equivalent of torch.repeat_interleave(x, dim=1, repeats=n_rep). The hidden states
    go from (batch, num_key_value_heads, seqlen, head_dim) to (batch, num_attention_heads, seqlen,
    head_dim)
    """
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)

    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        causal_mask = attention_mask[:, :, :, : key_states.shape[-2]]
        attn_weights = attn_weights + causal_mask

    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()

    return attn_output, attn_weights


def sdpa_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    scaling: Optional[float] = None,
    dropout: float = 0.0,
    is_causal: Optional[bool] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)

    causal_mask = attention_mask
    if attention_mask is not None:
        causal_mask = causal_mask[:, :, :, : key.shape[-2]]

    # SDPA's own causal masking only when no explicit mask is given and there is more than one
    # query (a single decode query attends to every cached key).
    if is_causal is None:
        is_causal = query.shape[2] > 1 and causal_mask is None and getattr(module, "is_causal", True)

    attn_output = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=causal_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=is_causal,
    )
    attn_output = attn_output.transpose(1, 2).contiguous()
    return attn_output, None


ALL_ATTENTION_FUNCTIONS: dict[str, Callable[..., tuple[torch.Tensor, Optional[torch.Tensor]]]] = {
    "eager": eager_attention_forward,
    "sdpa": sdpa_attention_forward,
}


def build_alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al.), geometric, also for a non-power-of-two head count."""

    def _slopes_power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = _slopes_power_of_2(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        slopes = _slopes_power_of_2(closest) + _slopes_power_of_2(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def prepare_4d_causal_attention_mask_with_cache_position(
    attention_mask: Optional[torch.Tensor],
    sequence_length: int,
    target_length: int,
    dtype: torch.dtype,
    device: torch.device,
    cache_position: torch.Tensor,
    batch_size: int,
    sliding_window: Optional[int] = None,
) -> torch.Tensor:
    """
    Creates a causal 4D mask of shape `(batch_size, 1, query_length, key_value_length)` from a 2D
    mask of shape `(batch_size, key_value_length)`, or returns the input `attention_mask` if it is
    already 4D. Masked entries hold `torch.finfo(dtype).min`, visible entries 0.

    Args:
        attention_mask: a 2D padding mask (1 = token, 0 = padding) or a 4D additive mask.
        sequence_length: the number of query tokens.
        target_length: the number of key tokens (past + current).
        cache_position: absolute positions of the query tokens, `(sequence_length,)`.
        sliding_window: if set, keys at distance `>= sliding_window` from the query are masked.
    """
    if attention_mask is not None and attention_mask.dim() == 4:
        return attention_mask
    min_dtype = torch.finfo(dtype).min
    causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype, device=device)
    diagonal_attend_mask = torch.arange(target_length, device=device) > cache_position.reshape(-1, 1)
    if sliding_window is not None:
        sliding_attend_mask = torch.arange(target_length, device=device) <= (cache_position.reshape(-1, 1) - sliding_window)
        diagonal_attend_mask = diagonal_attend_mask | sliding_attend_mask
    causal_mask = causal_mask * diagonal_attend_mask
    causal_mask = causal_mask[None, None, :, :].expand(batch_size, 1, -1, -1)
    if attention_mask is not None:
        causal_mask = causal_mask.clone()  # copy to contiguous memory for in-place edit
        mask_length = attention_mask.shape[-1]
        padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :].to(causal_mask.device)
        padding_mask = padding_mask == 0
        causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(padding_mask, min_dtype)
    return causal_mask


# The masking utilities of ``transformers.masking_utils`` (what the published modeling_ouro.py
# calls through ``create_causal_mask``): a mask function of (batch, head, query, key) indices,
# vmapped over all four, so that Dynamo records the comparison between ``_add_batch_dim`` and
# ``_remove_batch_dim`` calls.
def causal_mask_function(batch_idx: torch.Tensor, head_idx: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
    return kv_idx <= q_idx


def padding_mask_function(padding_mask: torch.Tensor) -> Callable:
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return padding_mask[batch_idx, kv_idx]

    return inner_mask


def and_masks(*mask_functions: Callable) -> Callable:
    def and_mask(batch_idx, head_idx, q_idx, kv_idx):
        result = q_idx.new_ones((), dtype=torch.bool)
        for mask in mask_functions:
            result = result & mask(batch_idx, head_idx, q_idx, kv_idx)
        return result

    return and_mask


def _vmap_for_bhqkv(mask_function: Callable) -> Callable:
    """Vmap over key, then query, head and batch indices: a [B, H, Q, KV] boolean mask."""
    for dims in ((None, None, None, 0), (None, None, 0, None), (None, 0, None, None), (0, None, None, None)):
        mask_function = torch.vmap(mask_function, in_dims=dims, out_dims=0)
    return mask_function


def sdpa_mask(
    batch_size: int,
    cache_position: torch.Tensor,
    kv_length: int,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: Optional[torch.Tensor] = None,
    allow_is_causal_skip: bool = True,
) -> Optional[torch.Tensor]:
    """A boolean [B, 1, Q, KV] mask (True = attend), or None where SDPA's is_causal does the same
    (never while compiling, as in ``transformers``)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex

    q_length = cache_position.shape[0]
    if (
        allow_is_causal_skip
        and attention_mask is None
        and not torch.compiler.is_compiling()
        and (q_length == 1 or kv_length == q_length)
    ):
        return None
    kv_arange = torch.arange(kv_length, device=cache_position.device)
    kv_arange += kv_offset
    if attention_mask is not None:
        mask_function = and_masks(mask_function, padding_mask_function(attention_mask.to(torch.bool)))
    batch_arange = torch.arange(batch_size, device=cache_position.device)
    head_arange = torch.arange(1, device=cache_position.device)
    with TransformGetItemToIndex():  # padding_mask[batch_idx, kv_idx] on 0-d batched indices
        return _vmap_for_bhqkv(mask_function)(batch_arange, head_arange, cache_position, kv_arange)


def eager_mask(
    batch_size: int,
    cache_position: torch.Tensor,
    kv_length: int,
    dtype: torch.dtype,
    kv_offset: int = 0,
    mask_function: Callable = causal_mask_function,
    attention_mask: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The additive float form of :func:`sdpa_mask`: 0 where attended, the dtype's minimum elsewhere."""
    mask = sdpa_mask(batch_size, cache_position, kv_length, kv_offset, mask_function, attention_mask, allow_is_causal_skip=False)
    return torch.where(mask, torch.tensor(0.0, device=mask.device, dtype=dtype), torch.finfo(dtype).min)


# ------------------------------------------------------------------------------------------------
# Layers
# ------------------------------------------------------------------------------------------------
class OuroAttention(nn.Module):
    """Multi-headed attention from 'Attention Is All You Need' paper"""

    def __init__(self, config: HFStyleOuroConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]],
        attention_mask: Optional[torch.Tensor],
        past_key_value: Optional[LoopedDynamicCache] = None,
        cache_position: Optional[torch.LongTensor] = None,
        current_ut: int = 0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)

        query_states = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        if position_embeddings is not None:  # None for ALiBi: the position bias lives in the mask
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if past_key_value is not None:
            cache_kwargs = {"cache_position": cache_position}
            cache_index = current_ut * self.config.num_hidden_layers + self.layer_idx
            key_states, value_states = past_key_value.update(key_states, value_states, cache_index, cache_kwargs)

        attention_interface = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            **kwargs,
        )

        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        attn_output = self.o_proj(attn_output)
        return attn_output, attn_weights


class OuroMLP(nn.Module):
    def __init__(self, config: HFStyleOuroConfig) -> None:
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
        return down_proj


class OuroDecoderLayer(nn.Module):
    def __init__(self, config: HFStyleOuroConfig, layer_idx: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = OuroAttention(config=config, layer_idx=layer_idx)
        self.mlp = OuroMLP(config)
        self.input_layernorm = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.input_layernorm_2 = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm_2 = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_type = config.layer_types[layer_idx]

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_value: Optional[LoopedDynamicCache] = None,
        use_cache: Optional[bool] = False,
        cache_position: Optional[torch.LongTensor] = None,
        position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        current_ut: int = 0,
        **kwargs: Any,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)

        # Self Attention
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_value=past_key_value,
            cache_position=cache_position,
            current_ut=current_ut,
            **kwargs,
        )
        hidden_states = self.input_layernorm_2(hidden_states)
        hidden_states = residual + hidden_states

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_attention_layernorm_2(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------
class OuroModelOutput(NamedTuple):
    last_hidden_state: torch.Tensor
    past_key_values: Optional[LoopedDynamicCache]
    hidden_states_list: list[torch.Tensor]  # every recurrent step's normalized state
    gate_list: list[torch.Tensor]  # every recurrent step's early-exit gate logits [B, T, 1]


class OuroCausalLMOutputWithPast(NamedTuple):
    logits: torch.Tensor
    past_key_values: Optional[LoopedDynamicCache]
    hidden_states_list: list[torch.Tensor]
    gate_list: list[torch.Tensor]


class _MaskMixin:
    """Mask / position preparation shared by the HF-style models (``_update_causal_mask``)."""

    config: HFStyleOuroConfig

    def _update_causal_mask(
        self,
        attention_mask: Optional[torch.Tensor],
        input_tensor: torch.Tensor,
        cache_position: torch.Tensor,
        past_key_values: Optional[LoopedDynamicCache],
    ) -> Optional[torch.Tensor]:
        past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
        dtype, device = input_tensor.dtype, input_tensor.device
        batch_size, sequence_length = input_tensor.shape[0], input_tensor.shape[1]
        uses_alibi = self.config.position_embedding_type == "alibi"

        if self.config.mask_implementation == "masking_utils":
            if uses_alibi or self.config.sliding_window is not None:
                raise NotImplementedError("mask_implementation='masking_utils' builds the plain causal mask only")
            kv_length = past_seen_tokens + sequence_length
            if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
                kv_length = attention_mask.shape[-1]
            if self.config._attn_implementation == "sdpa":
                return sdpa_mask(batch_size, cache_position, kv_length, attention_mask=attention_mask)
            return eager_mask(batch_size, cache_position, kv_length, dtype, attention_mask=attention_mask)

        # SDPA: rely on `is_causal` (or nothing, for one decode query) when no mask is needed.
        if (
            self.config._attn_implementation == "sdpa"
            and attention_mask is None
            and self.config.sliding_window is None
            and not uses_alibi
            and (sequence_length == 1 or past_seen_tokens == 0)
        ):
            return None

        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
            target_length = attention_mask.shape[-1]
        else:
            target_length = past_seen_tokens + sequence_length

        causal_mask = prepare_4d_causal_attention_mask_with_cache_position(
            attention_mask,
            sequence_length=sequence_length,
            target_length=target_length,
            dtype=dtype,
            device=device,
            cache_position=cache_position,
            batch_size=batch_size,
            sliding_window=self.config.sliding_window,
        )
        if uses_alibi:
            # Bloom-style ALiBi: slope_h * key_position (softmax is shift-invariant per query row,
            # so this equals -slope_h * (query_position - key_position)). [B, H, T, S].
            key_positions = torch.arange(target_length, device=device, dtype=torch.float32)
            alibi = self.alibi_slopes.to(device)[:, None, None] * key_positions[None, None, :]
            causal_mask = causal_mask + alibi[None].to(dtype)
        return causal_mask


class OuroModel(_MaskMixin, nn.Module):
    """Embeddings, the shared decoder stack applied ``total_ut_steps`` times, a norm after each step."""

    def __init__(self, config: HFStyleOuroConfig) -> None:
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [OuroDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.position_embedding_type == "rope":
            self.rotary_emb = OuroRotaryEmbedding(config=config)
        else:
            self.rotary_emb = None
            self.register_buffer("alibi_slopes", build_alibi_slopes(config.num_attention_heads), persistent=False)
        self.total_ut_steps = getattr(self.config, "total_ut_steps", 4)
        self.early_exit_gate = nn.Linear(config.hidden_size, 1)
        self.gradient_checkpointing = False

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[LoopedDynamicCache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        use_cache: Optional[bool] = None,
        cache_position: Optional[torch.LongTensor] = None,
        use_early_exit_gate: bool = True,
        **kwargs: Any,
    ) -> OuroModelOutput:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        if use_cache is None:
            use_cache = past_key_values is not None
        if use_cache and past_key_values is None:
            past_key_values = LoopedDynamicCache(self.total_ut_steps * self.config.num_hidden_layers)

        if cache_position is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            cache_position = torch.arange(
                past_seen_tokens, past_seen_tokens + inputs_embeds.shape[1], device=inputs_embeds.device
            )

        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)

        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position, past_key_values)

        hidden_states = inputs_embeds

        # create position embeddings to be shared across the decoder layers (and recurrent steps)
        position_embeddings = self.rotary_emb(hidden_states, position_ids) if self.rotary_emb is not None else None

        hidden_states_list: list[torch.Tensor] = []
        gate_list: list[torch.Tensor] = []

        for current_ut in range(self.total_ut_steps):
            for decoder_layer in self.layers[: self.config.num_hidden_layers]:
                hidden_states = decoder_layer(
                    hidden_states,
                    attention_mask=causal_mask,
                    position_ids=position_ids,
                    past_key_value=past_key_values if use_cache else None,
                    use_cache=use_cache,
                    cache_position=cache_position,
                    position_embeddings=position_embeddings,
                    current_ut=current_ut,
                    **kwargs,
                )
            hidden_states = self.norm(hidden_states)
            if use_early_exit_gate:
                hidden_states_list.append(hidden_states)
                gate_list.append(self.early_exit_gate(hidden_states))

        return OuroModelOutput(
            last_hidden_state=hidden_states,
            past_key_values=past_key_values if use_cache else None,
            hidden_states_list=hidden_states_list,
            gate_list=gate_list,
        )


class OuroForCausalLM(nn.Module):
    _tied_weights_keys = ["lm_head.weight"]

    def __init__(self, config: Any, **config_overrides: Any) -> None:
        """``config``: an :class:`HFStyleOuroConfig` or ``flashloop_compile``'s ``OuroConfig``;
        ``config_overrides`` (e.g. ``attn_implementation="sdpa"``) are applied on top."""
        super().__init__()
        config = _as_hf_config(config, **config_overrides)
        self.config = config
        self.model = OuroModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_flashloop(cls, flashloop_model: nn.Module, **config_overrides: Any) -> "OuroForCausalLM":
        """Same weights as a ``flashloop_compile.models.ouro.OuroForCausalLM`` (and its dtype/device)."""
        ref = flashloop_model.lm_head.weight
        with torch.device(ref.device):
            model = cls(flashloop_model.config, **config_overrides)
        model.to(ref.dtype)
        model.load_state_dict(flashloop_model.state_dict())
        return model.train(flashloop_model.training)

    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[LoopedDynamicCache] = None,
        cache_position: Optional[torch.LongTensor] = None,
        use_cache: bool = False,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        logits_to_keep: int = 0,
        use_early_exit_gate: bool = True,
        **kwargs: Any,
    ) -> OuroCausalLMOutputWithPast:
        r"""Logits of the last recurrent step, ``[batch, tokens, vocab]``.

        ``use_cache=True`` (or passing ``past_key_values``) writes every (step, layer)'s K/V into
        ``past_key_values`` (created when None) and returns it in ``.past_key_values``.
        """
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache or past_key_values is not None,
            cache_position=cache_position,
            use_early_exit_gate=use_early_exit_gate,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        # Only compute necessary logits
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])
        return OuroCausalLMOutputWithPast(
            logits=logits,
            past_key_values=outputs.past_key_values,
            hidden_states_list=outputs.hidden_states_list,
            gate_list=outputs.gate_list,
        )


# ------------------------------------------------------------------------------------------------
# Negative-test variant: a plain Llama-style decoder (pre-norm, distinct layers, no recurrence)
# ------------------------------------------------------------------------------------------------
class LlamaStyleDecoderLayer(nn.Module):
    def __init__(self, config: HFStyleOuroConfig, layer_idx: int) -> None:
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = OuroAttention(config=config, layer_idx=layer_idx)
        self.mlp = OuroMLP(config)
        self.input_layernorm = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_value: Optional[LoopedDynamicCache] = None,
        cache_position: Optional[torch.LongTensor] = None,
        position_embeddings: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_value=past_key_value,
            cache_position=cache_position,
            **kwargs,
        )
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class LlamaStyleModel(_MaskMixin, nn.Module):
    def __init__(self, config: HFStyleOuroConfig) -> None:
        super().__init__()
        self.config = config
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [LlamaStyleDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = OuroRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = OuroRotaryEmbedding(config=config)

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[LoopedDynamicCache] = None,
        use_cache: bool = False,
        cache_position: Optional[torch.LongTensor] = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Optional[LoopedDynamicCache]]:
        inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and past_key_values is None:
            past_key_values = LoopedDynamicCache(self.config.num_hidden_layers)
        if cache_position is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            cache_position = torch.arange(
                past_seen_tokens, past_seen_tokens + inputs_embeds.shape[1], device=inputs_embeds.device
            )
        if position_ids is None:
            position_ids = cache_position.unsqueeze(0)
        causal_mask = self._update_causal_mask(attention_mask, inputs_embeds, cache_position, past_key_values)

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=causal_mask,
                past_key_value=past_key_values if use_cache else None,
                cache_position=cache_position,
                position_embeddings=position_embeddings,
                **kwargs,
            )
        hidden_states = self.norm(hidden_states)
        return hidden_states, past_key_values if use_cache else None


class LlamaStyleForCausalLM(nn.Module):
    """A standard (non-looped, pre-norm) decoder: the backend must report it as unsupported."""

    def __init__(self, config: Any, **config_overrides: Any) -> None:
        super().__init__()
        config = _as_hf_config(config, **config_overrides)
        self.config = config
        self.model = LlamaStyleModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        past_key_values: Optional[LoopedDynamicCache] = None,
        cache_position: Optional[torch.LongTensor] = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        **kwargs: Any,
    ) -> OuroCausalLMOutputWithPast:
        hidden_states, past_key_values = self.model(
            input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            use_cache=use_cache or past_key_values is not None,
            cache_position=cache_position,
            **kwargs,
        )
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])
        return OuroCausalLMOutputWithPast(logits=logits, past_key_values=past_key_values, hidden_states_list=[], gate_list=[])
