"""The packed KV cache of KV residual quantization (SPEC.md section 3, DESIGN.md "Packed KV storage").

One :class:`PackedKVCache` per model, allocated once for ``max_batch`` slots of ``max_seq``
positions, with static addresses (CUDA-graph friendly). Batch row ``b`` of an op addresses slot
``b``. G = ``group_size``, D = ``head_dim``, H = ``kv_heads``, S = ``max_seq``, NB = S / G,
R = ``num_loops``, CAP_d = ``residual_capacity`` of depth d (1..R-1), CAPT = sum of CAP_d.

The tensors, their shapes and dtypes are the layout of lowering/packed_layout.py (one
:class:`PackedKVLayer` per layer, then ``rows``, ``depth_count``, ``res_layout`` and ``overflow``
per model); this module allocates them and keeps their state.

The DESIGN.md per-depth tensors are views: ``k_res(layer, d)`` = ``k_res[:, :, off_d:off_d+CAP_d]``
([B, H, CAP_d, D/2]), ``k_res_min(layer, d)`` = ``k_res_min[d-1]`` ([B, H, NB, D]), ``rows(d)`` =
``rows[d-1]`` ([B, S]) and so on. One allocation per kind and layer lets one kernel address every
depth through a single pointer; the bytes are exactly the layout table's.

``flushed`` and ``row_count`` are per layer (DESIGN.md lists them per model): every layer's write
op advances its own blocks, and a write must know where *its* layer stood before the step while a
reader of that layer must see where it stands after -- one shared counter cannot serve both when
layers are written one after the other. The values are identical across layers after each full
step, so ``rows`` and ``depth_count`` (written identically by every layer) stay per model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from flashloop_compile.lowering.packed_layout import LAYER_TENSOR_NAMES, PackedGeometry, res_layout, tensor_specs

__all__ = ["PackedKVCache", "PackedKVLayer", "PackedKVBytes", "PackedKVOverflowError"]

_COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class PackedKVOverflowError(RuntimeError):
    """The compact residual rows of some depth exceeded their capacity."""


# One layer's tensors, in the order the ``flashloop.packed_*`` ops take them.
PackedKVLayer = NamedTuple("PackedKVLayer", [(name, Tensor) for name in LAYER_TENSOR_NAMES])


@dataclass
class PackedKVBytes:
    """Bytes of the allocation by kind; ``dense_equivalent`` is a BF16 cache of every depth of
    every layer for max_batch x max_seq tokens (what the packed cache replaces)."""

    payload: int  # uint8 codes (base + residual)
    params: int  # fp16 minimum/scale
    maps: int  # rows + depth_count + counters (flushed, row_count, res_layout, overflow)
    tails: int  # compute-dtype rings
    dense_equivalent: int

    @property
    def total(self) -> int:
        return self.payload + self.params + self.maps + self.tails

    @property
    def ratio(self) -> float:
        """Dense BF16 bytes per packed byte."""
        return self.dense_equivalent / max(self.total, 1)

    def as_dict(self) -> dict[str, float]:
        return {
            "payload": self.payload,
            "params": self.params,
            "maps": self.maps,
            "tails": self.tails,
            "total": self.total,
            "dense_equivalent": self.dense_equivalent,
            "ratio": self.ratio,
        }


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class PackedKVCache:
    """Static packed KV storage for ``num_layers`` layers of a model run for ``num_loops`` loops.

    Args:
        num_layers, num_loops (R >= 2), max_batch, max_seq (a multiple of group_size), kv_heads,
        head_dim (a multiple of group_size).
        group_size: values per affine INT4 group (a power of two, 16..128).
        tail: recent tokens kept in the compute dtype; must equal group_size (the ring has
            2 * tail slots and holds tail..tail+group_size-1 tokens after each write).
        residual_capacity: compact residual rows per slot for depths 1..R-1 (an int for every
            depth or one per depth); default max_seq (every token may get a residual).
        dtype: the compute dtype of the tails and of what readers return (bf16 by default).
    """

    def __init__(
        self,
        num_layers: int,
        num_loops: int,
        max_batch: int,
        max_seq: int,
        kv_heads: int,
        head_dim: int,
        *,
        group_size: int = 64,
        tail: int = 64,
        residual_capacity: int | Sequence[int] | None = None,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        caps = self._validate(num_layers, num_loops, max_batch, max_seq, kv_heads, head_dim, group_size, tail, residual_capacity, dtype)
        self.num_layers, self.num_loops, self.max_batch, self.max_seq = num_layers, num_loops, max_batch, max_seq
        self.kv_heads, self.head_dim, self.group_size, self.tail = kv_heads, head_dim, group_size, tail
        self.dtype = dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.residual_capacity: tuple[int, ...] = tuple(caps)  # depths 1..R-1
        self.residual_offset: tuple[int, ...] = tuple(sum(caps[:i]) for i in range(len(caps)))
        self.num_blocks = max_seq // group_size

        self.geometry = PackedGeometry(num_layers, num_loops, max_batch, max_seq, kv_heads, head_dim, group_size, tail)
        specs = tensor_specs(self.geometry, sum(caps), dtype)

        def alloc(name: str) -> Tensor:
            spec = specs[name]
            return torch.full(spec.shape, spec.fill, dtype=spec.dtype, device=self.device)

        self.layers: list[PackedKVLayer] = [PackedKVLayer(*map(alloc, LAYER_TENSOR_NAMES)) for _ in range(num_layers)]
        self.rows, self.depth_count = alloc("rows"), alloc("depth_count")
        self.res_layout = torch.tensor(res_layout(max_seq, caps), dtype=specs["res_layout"].dtype).to(self.device)
        self.overflow = alloc("overflow")

    @classmethod
    def for_geometry(
        cls, geometry: PackedGeometry, *, residual_capacity: int | Sequence[int] | None = None,
        dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
    ) -> "PackedKVCache":
        """The cache of ``geometry`` (lowering/packed_layout.py)."""
        g = geometry
        return cls(g.num_layers, g.num_loops, g.max_batch, g.max_seq, g.kv_heads, g.head_dim, group_size=g.group_size,
                   tail=g.tail, residual_capacity=residual_capacity, dtype=dtype, device=device)

    # ------------------------------------------------------------------------------------------
    # validation
    # ------------------------------------------------------------------------------------------

    @staticmethod
    def _validate(num_layers, num_loops, max_batch, max_seq, kv_heads, head_dim, group_size, tail, residual_capacity, dtype) -> list[int]:
        def positive(name, value):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"PackedKVCache: {name} must be a positive int, got {value!r}")

        for name, value in [("num_layers", num_layers), ("max_batch", max_batch), ("max_seq", max_seq),
                            ("kv_heads", kv_heads), ("head_dim", head_dim), ("group_size", group_size), ("tail", tail)]:
            positive(name, value)
        if not isinstance(num_loops, int) or num_loops < 2:
            raise ValueError(
                f"PackedKVCache: num_loops must be >= 2 (a looped model; depths 1..R-1 hold residuals), got {num_loops!r}; "
                "use the dense KV cache for a model run with one loop"
            )
        if group_size & (group_size - 1) or not 16 <= group_size <= 128:
            raise ValueError(f"PackedKVCache: group_size must be a power of two in 16..128 (the kernels tile by it), got {group_size}")
        if head_dim % group_size:
            fits = [g for g in (128, 64, 32, 16) if head_dim % g == 0]
            hint = f"use group_size={fits[0]}" if fits else "no group size in 16..128 divides it: use a head_dim multiple of 16"
            raise ValueError(
                f"PackedKVCache: head_dim={head_dim} must be a multiple of group_size={group_size} (a V group must not straddle "
                f"heads); {hint}"
            )
        if max_seq % group_size:
            up = -(-max_seq // group_size) * group_size
            raise ValueError(
                f"PackedKVCache: max_seq={max_seq} must be a multiple of group_size={group_size} (K groups are {group_size}-token "
                f"blocks); round max_seq up to {up}"
            )
        if tail != group_size:
            raise ValueError(
                f"PackedKVCache: tail={tail} must equal group_size={group_size} (the ring has 2*tail slots and flushes whole "
                f"{group_size}-token blocks, holding tail..tail+group_size-1 tokens); set tail={group_size}"
            )
        if dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"PackedKVCache: dtype must be one of {_COMPUTE_DTYPES} (the compute dtype), got {dtype}")
        n_res = num_loops - 1
        if residual_capacity is None:
            caps = [max_seq] * n_res
        elif isinstance(residual_capacity, int) and not isinstance(residual_capacity, bool):
            caps = [residual_capacity] * n_res
        else:
            caps = list(residual_capacity)
            if len(caps) != n_res:
                raise ValueError(
                    f"PackedKVCache: residual_capacity needs one entry per residual depth 1..{n_res} (num_loops - 1 = {n_res}), "
                    f"got {len(caps)}: {caps}"
                )
        for d, cap in enumerate(caps, start=1):
            if not isinstance(cap, int) or isinstance(cap, bool) or not 1 <= cap <= max_seq:
                raise ValueError(
                    f"PackedKVCache: residual_capacity of depth {d} must be an int in 1..max_seq={max_seq} "
                    f"(compact rows per slot), got {cap!r}"
                )
        return caps

    # ------------------------------------------------------------------------------------------
    # access
    # ------------------------------------------------------------------------------------------

    def layer_tensors(self, layer: int) -> tuple[Tensor, ...]:
        """The layer's tensors in the order the ops take them (see ``LAYER_TENSOR_NAMES``)."""
        return tuple(self.layers[layer])

    def model_tensors(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """(rows, depth_count, res_layout, overflow), shared by every layer."""
        return self.rows, self.depth_count, self.res_layout, self.overflow

    def op_tensors(self, layer: int) -> tuple[Tensor, ...]:
        """layer_tensors(layer) + model_tensors(): the tensor arguments of every packed op."""
        return self.layer_tensors(layer) + self.model_tensors()

    def _depth(self, d: int) -> None:
        if not 1 <= d < self.num_loops:
            raise IndexError(f"residual depth must be in 1..{self.num_loops - 1}, got {d}")

    def k_res(self, layer: int, d: int) -> Tensor:
        """[B, H, CAP_d, D/2] view of depth d's K residual codes."""
        self._depth(d)
        o, c = self.residual_offset[d - 1], self.residual_capacity[d - 1]
        return self.layers[layer].k_res[:, :, o : o + c]

    def v_res(self, layer: int, d: int) -> Tensor:
        self._depth(d)
        o, c = self.residual_offset[d - 1], self.residual_capacity[d - 1]
        return self.layers[layer].v_res[:, :, o : o + c]

    def v_res_params(self, layer: int, d: int) -> tuple[Tensor, Tensor]:
        """([B, H, CAP_d, D/G] minimum, scale) of depth d."""
        self._depth(d)
        o, c = self.residual_offset[d - 1], self.residual_capacity[d - 1]
        lay = self.layers[layer]
        return lay.v_res_min[:, :, o : o + c], lay.v_res_scale[:, :, o : o + c]

    def k_res_params(self, layer: int, d: int) -> tuple[Tensor, Tensor]:
        """([B, H, NB, D] minimum, scale) of depth d."""
        self._depth(d)
        lay = self.layers[layer]
        return lay.k_res_min[d - 1], lay.k_res_scale[d - 1]

    def rows_of(self, d: int) -> Tensor:
        """[B, S] position -> compact row map of depth d (-1 = inherit)."""
        self._depth(d)
        return self.rows[d - 1]

    # ------------------------------------------------------------------------------------------
    # state
    # ------------------------------------------------------------------------------------------

    def reset(self, slots: Tensor | None = None) -> None:
        """Forget the requests in ``slots`` (all slots when None): nothing flushed, no rows used,
        every map entry -1, depth_count 0. No reallocation and no host sync (``slots`` may be a
        device index tensor or a bool mask [max_batch]); payload and tails are left as they are,
        since no reader looks at a position that was not written after the reset. A full reset
        also clears the overflow flag."""
        if slots is None:
            for lay in self.layers:
                lay.flushed.zero_()
                lay.row_count.zero_()
            self.rows.fill_(-1)
            self.depth_count.zero_()
            self.overflow.zero_()
            return
        slots = slots.to(self.device)
        if slots.dtype == torch.bool:
            if slots.shape != (self.max_batch,):
                raise ValueError(f"reset: a bool slot mask must have shape [{self.max_batch}], got {tuple(slots.shape)}")
            m = slots[:, None]
            for lay in self.layers:
                lay.flushed.masked_fill_(m, 0)
                lay.row_count.masked_fill_(m, 0)
            self.rows.masked_fill_(m[None], -1)
            self.depth_count.masked_fill_(m, 0)
            return
        idx = slots.reshape(-1).long()
        for lay in self.layers:
            lay.flushed.index_fill_(0, idx, 0)
            lay.row_count.index_fill_(0, idx, 0)
        self.rows.index_fill_(1, idx, -1)
        self.depth_count.index_fill_(0, idx, 0)

    def check_overflow(self) -> None:
        """Raise :class:`PackedKVOverflowError` if a write ran out of compact residual rows.

        Syncs with the device: call it outside captured regions (e.g. once per step)."""
        if int(self.overflow.item()) == 0:
            return
        demand = torch.stack([lay.row_count for lay in self.layers]).amax(dim=(0, 1)).tolist()  # [R]
        parts = []
        for d in range(1, self.num_loops):
            cap = self.residual_capacity[d - 1]
            if demand[d] > cap:
                parts.append(f"depth {d}: {demand[d]} rows needed, capacity {cap}")
        detail = "; ".join(parts) if parts else "see row_count"
        raise PackedKVOverflowError(
            f"packed KV cache: compact residual rows exceeded their capacity ({detail}). The tokens past the capacity "
            f"were stored without their residual (they read as their previous depth). Allocate the cache with a larger "
            f"residual_capacity (per depth, up to max_seq={self.max_seq}) or serve fewer/shorter requests per slot."
        )

    def nbytes(self) -> PackedKVBytes:
        payload = params = maps = tails = 0
        for lay in self.layers:
            payload += sum(_nbytes(t) for t in (lay.k_base, lay.v_base, lay.k_res, lay.v_res))
            params += sum(
                _nbytes(t)
                for t in (lay.k_base_min, lay.k_base_scale, lay.v_base_min, lay.v_base_scale,
                          lay.k_res_min, lay.k_res_scale, lay.v_res_min, lay.v_res_scale)
            )
            maps += _nbytes(lay.flushed) + _nbytes(lay.row_count)
            tails += _nbytes(lay.k_tail) + _nbytes(lay.v_tail)
        maps += _nbytes(self.rows) + _nbytes(self.depth_count) + _nbytes(self.res_layout) + _nbytes(self.overflow)
        dense = self.max_batch * self.max_seq * self.num_loops * self.num_layers * self.kv_heads * self.head_dim * 2 * 2
        return PackedKVBytes(payload, params, maps, tails, dense)

    def __repr__(self) -> str:
        return (
            f"PackedKVCache(layers={self.num_layers}, loops={self.num_loops}, max_batch={self.max_batch}, max_seq={self.max_seq}, "
            f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, group_size={self.group_size}, "
            f"residual_capacity={list(self.residual_capacity)}, dtype={self.dtype}, device={self.device})"
        )

