"""Snapshot and restore of one request's cache: the bytes of one batch row, with a versioned
encoding descriptor, restored into any row of a cache of the same encoding (another slot, another
engine, another process); generation then continues as if the request had never moved.

A row's state is what the forwards wrote for it (runtime/engine.py ``state_tensors``): the dense
K/V of every (loop, layer) up to the row's length, or its part of the packed cache
(lowering/packed_layout.py): payload and parameters up to its length (tokens or G-token blocks),
the compact residual rows it uses per depth (``row_count``), the tail ring slots it has used,
``flushed``,
``row_count``, its ``rows`` maps and ``depth_count`` up to its length. Nothing else persists
between forwards: the step plan is written before each one. The host adds the request's position
(tokens in the cache) and, optionally, the logits its next token is sampled from.

The descriptor (format version, FlashLoopConfig hash, geometry, dtype) travels in the safetensors
header; :func:`restore_row` checks it, the row and every tensor's shape against the target before
writing anything, so a mismatch leaves the target bit-unchanged.

:func:`copy_prefix` moves a row's first tokens to another row of the same cache on the device (no
host round trip): prefix reuse. A row cut at a position is the cache of a row of that many tokens
when :func:`check_prefix` says so: always for dense K/V, and for the packed cache while the row has
flushed only what a row of that length has (its tail ring still holds the rest exactly).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import load as _load_tensors
from safetensors.torch import save as _save_tensors
from torch import Tensor

from flashloop_compile.lowering.packed_layout import LAYER_TENSOR_NAMES, MODEL_TENSOR_NAMES, tensor_specs
from flashloop_compile.runtime.packed_kv import PackedKVCache
from flashloop_compile.runtime.verify import flushed_after

__all__ = ["FORMAT_VERSION", "CacheGeometry", "SnapshotDescriptor", "RowSnapshot", "RowCaches", "SnapshotMismatchError",
           "snapshot_row", "restore_row", "check_prefix", "copy_prefix"]

FORMAT_VERSION = 1
_METADATA_KEY = "flashloop_snapshot"

class SnapshotMismatchError(ValueError):
    """A snapshot that does not fit the cache it is restored into (nothing was written)."""


@dataclass(frozen=True)
class CacheGeometry:
    """What fixes the meaning of a row's bytes: the storage kind and the model's cache shape (the
    packed cache's group size and tail; None for dense). Batch slots, context length and residual
    capacities are the allocator's choice: a row fits any cache that has room for it."""

    storage: str  # "dense" or "packed"
    num_layers: int
    num_loops: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    group_size: int | None = None
    tail: int | None = None


@dataclass(frozen=True)
class SnapshotDescriptor:
    """The encoding of a snapshot's bytes: a restore needs each field to equal the target's."""

    format_version: int
    config_hash: str
    geometry: CacheGeometry
    dtype: str  # the compute dtype (dense K/V, packed tails), e.g. "torch.bfloat16"


@dataclass
class RowSnapshot:
    """One request's cache on the host: its descriptor, position (tokens in the cache: the next
    token's position), the tensors of its row and the logits its next token is sampled from."""

    descriptor: SnapshotDescriptor
    position: int
    tensors: dict[str, Tensor]
    logits: Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def to_bytes(self) -> bytes:
        meta = {"descriptor": dataclasses.asdict(self.descriptor), "position": self.position}
        tensors = dict(self.tensors)
        if self.logits is not None:
            tensors["logits"] = self.logits
        return _save_tensors(tensors, metadata={_METADATA_KEY: json.dumps(meta, sort_keys=True)})

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.write_bytes(self.to_bytes())
        return path

    @classmethod
    def from_bytes(cls, data: bytes) -> "RowSnapshot":
        meta = _read_metadata(data)
        d = meta["descriptor"]
        _check_version(d["format_version"])  # a later version may lay out the rest differently
        descriptor = SnapshotDescriptor(d["format_version"], d["config_hash"], CacheGeometry(**d["geometry"]), d["dtype"])
        tensors = _load_tensors(data)
        logits = tensors.pop("logits", None)
        return cls(descriptor, int(meta["position"]), tensors, logits)

    @classmethod
    def load(cls, source: "bytes | str | os.PathLike | RowSnapshot") -> "RowSnapshot":
        """A snapshot from its bytes, a file path, or itself."""
        if isinstance(source, RowSnapshot):
            return source
        if isinstance(source, (bytes, bytearray, memoryview)):
            return cls.from_bytes(bytes(source))
        return cls.from_bytes(Path(source).read_bytes())


def _read_metadata(data: bytes) -> dict:
    """The snapshot's JSON metadata from the safetensors header (8-byte length, then JSON)."""
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        return json.loads(header["__metadata__"][_METADATA_KEY])
    except (struct.error, ValueError, KeyError, TypeError) as e:
        raise SnapshotMismatchError(
            f"not a flashloop_compile cache snapshot (no '{_METADATA_KEY}' in a safetensors header: {e}): "
            "give the bytes or file that Engine.snapshot / RowSnapshot.to_bytes wrote"
        ) from None


@dataclass
class RowCaches:
    """The cache objects a model's forwards write, as snapshot and restore see them: the dense
    K/V pairs of every (loop, layer) that has storage, or the packed cache (one of the two)."""

    config_hash: str
    geometry: CacheGeometry
    dtype: torch.dtype
    max_batch: int
    max_seq: int
    dense: list[tuple[Tensor, Tensor]] = dataclasses.field(default_factory=list)
    packed: PackedKVCache | None = None

    @property
    def descriptor(self) -> SnapshotDescriptor:
        return SnapshotDescriptor(FORMAT_VERSION, self.config_hash, self.geometry, str(self.dtype))

    def row_views(self, row: int, position: int, compact_rows: dict[str, list[int]]) -> Iterator[tuple[str, Tensor]]:
        """(name, view) of every tensor part that holds row ``row``'s first ``position`` tokens;
        ``compact_rows``: per layer name, the compact residual rows used per depth 1..R-1."""
        for i, (k, v) in enumerate(self.dense):
            yield f"dense.{i}.k", k[row, :, :position]
            yield f"dense.{i}.v", v[row, :, :position]
        p = self.packed
        if p is None:
            return
        specs = tensor_specs(p.geometry, 0, p.dtype)  # where each tensor holds a row (the layout's axes)
        extent = {"token": position, "block": -(-position // p.group_size), "ring": min(position, 2 * p.tail)}

        def views(prefix: str, name: str, t: Tensor) -> Iterator[tuple[str, Tensor]]:
            spec = specs[name]
            if spec.row_axis is None:  # shared by every row (res_layout, overflow)
                return
            r = t.select(spec.row_axis, row)
            axis = None if spec.extent_axis is None else spec.extent_axis - (spec.extent_axis > spec.row_axis)
            if spec.extent == "compact":
                for d, (off, n) in enumerate(zip(p.residual_offset, compact_rows[prefix]), start=1):
                    yield f"packed.{prefix}.{name}.depth{d}", r.narrow(axis, off, n)
            elif axis is None:
                yield f"packed.{prefix}.{name}", r
            else:
                yield f"packed.{prefix}.{name}", r.narrow(axis, 0, extent[spec.extent])

        for layer in range(p.num_layers):
            for name, t in zip(LAYER_TENSOR_NAMES, p.layer_tensors(layer)):
                yield from views(f"layer{layer}", name, t)
        for name, t in zip(MODEL_TENSOR_NAMES, p.model_tensors()):
            for key, view in views("model", name, t):
                yield key.replace("packed.model.", "packed."), view

    def compact_rows(self, row: int) -> dict[str, list[int]]:
        """Per layer, the compact residual rows row ``row`` uses at depths 1..R-1 (its row_count)."""
        p = self.packed
        if p is None:
            return {}
        return {f"layer{i}": p.layers[i].row_count[row, 1:].tolist() for i in range(p.num_layers)}


def _synchronize(device: torch.device) -> None:
    # writes of a request in flight (a replayed graph, a forward on another stream) land first
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device(caches: RowCaches) -> torch.device:
    return caches.packed.device if caches.packed is not None else caches.dense[0][0].device


def _check_row(caches: RowCaches, row: int, error: type[ValueError] = ValueError) -> None:
    if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < caches.max_batch:
        raise error(
            f"row {row!r} is out of range: this cache has rows 0..{caches.max_batch - 1} (max_batch={caches.max_batch})"
        )


def _check_position(caches: RowCaches, position: int) -> None:
    if isinstance(position, bool) or not isinstance(position, int) or not 1 <= position <= caches.max_seq:
        raise ValueError(f"position must be the row's token count in 1..max_seq={caches.max_seq}, got {position!r}")


def _check_compact_rows(caches: RowCaches, row: int, compact: dict[str, list[int]], what: str) -> None:
    for layer, used in compact.items():
        for d, (n, cap) in enumerate(zip(used, caches.packed.residual_capacity), start=1):
            if n > cap:
                raise ValueError(f"row {row} overflowed its compact residual rows ({layer}, depth {d}: {n} needed, "
                                 f"capacity {cap}); its cache is not exact and cannot be {what}")


def snapshot_row(caches: RowCaches, row: int, position: int, logits: Tensor | None = None) -> RowSnapshot:
    """Copy row ``row``'s cache (its first ``position`` tokens) to the host, after the device
    finished every write queued so far (CUDA: the device is synchronized first)."""
    _check_row(caches, row)
    _check_position(caches, position)
    if logits is not None and tuple(logits.shape) != (caches.geometry.vocab_size,):
        raise ValueError(f"logits must be the row's [vocab_size={caches.geometry.vocab_size}] logits, got shape "
                         f"{tuple(logits.shape)}")
    _synchronize(_device(caches))
    compact = caches.compact_rows(row)
    if caches.packed is not None:
        p = caches.packed
        _check_compact_rows(caches, row, compact, "snapshotted")
        flushed = int(p.layers[0].flushed[row].max())
        if flushed > position:
            raise ValueError(f"position={position} is behind row {row}'s cache, which has {flushed} tokens flushed: give "
                             "the row's token count (the next token's position)")
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in caches.row_views(row, position, compact)}
    host_logits = None if logits is None else logits.detach().to("cpu", dtype=torch.float32, copy=True)
    return RowSnapshot(caches.descriptor, position, tensors, host_logits)


def _check_version(version: int) -> None:
    if version != FORMAT_VERSION:
        raise SnapshotMismatchError(
            f"snapshot format version {version} is not readable here: this flashloop_compile reads version "
            f"{FORMAT_VERSION}; take the snapshot again with this version"
        )


def _check_descriptor(caches: RowCaches, snap: RowSnapshot) -> None:
    got, want = snap.descriptor, caches.descriptor
    _check_version(got.format_version)
    if got.config_hash != want.config_hash:
        raise SnapshotMismatchError(
            f"snapshot taken under FlashLoopConfig hash {got.config_hash}, this engine runs {want.config_hash}: restore it "
            "into an engine built with the same FlashLoopConfig (the cache's encoding depends on it)"
        )
    if got.geometry != want.geometry:
        diff = ", ".join(f"{f.name}={getattr(got.geometry, f.name)!r} (here {getattr(want.geometry, f.name)!r})"
                         for f in dataclasses.fields(CacheGeometry)
                         if getattr(got.geometry, f.name) != getattr(want.geometry, f.name))
        raise SnapshotMismatchError(f"snapshot geometry differs: {diff}; restore it into an engine of the same model "
                                    "and FlashLoopConfig")
    if got.dtype != want.dtype:
        raise SnapshotMismatchError(f"snapshot dtype {got.dtype} differs from this engine's {want.dtype}: restore it into "
                                    f"an engine whose model runs in {got.dtype}")


def restore_row(caches: RowCaches, snapshot: "RowSnapshot | bytes | str | os.PathLike", row: int) -> RowSnapshot:
    """Write a snapshot into row ``row`` of ``caches`` (that row's previous request is replaced).
    Every check runs before the first write: on an error the caches are unchanged. Returns the
    snapshot (its position and logits continue the request)."""
    snap = RowSnapshot.load(snapshot)
    _check_descriptor(caches, snap)
    _check_row(caches, row, SnapshotMismatchError)
    position = snap.position
    if position > caches.max_seq:
        raise SnapshotMismatchError(f"snapshot holds {position} tokens, this engine's max_seq is {caches.max_seq}: restore "
                                    f"it into an engine with max_seq > {position}")
    compact = {}
    if caches.packed is not None:
        p = caches.packed
        for layer in range(p.num_layers):
            codes = [snap.tensors.get(f"packed.layer{layer}.k_res.depth{d}") for d in range(1, p.num_loops)]
            used = [0 if t is None else t.shape[1] for t in codes]  # [H, rows used, D/2]
            for d, (n, cap) in enumerate(zip(used, p.residual_capacity), start=1):
                if n > cap:
                    raise SnapshotMismatchError(
                        f"snapshot uses {n} compact residual rows at depth {d}, this engine's capacity is {cap}: build the "
                        f"engine with a larger residual capacity (max_new_tokens, or none for max_seq)"
                    )
            compact[f"layer{layer}"] = used
    views = dict(caches.row_views(row, position, compact))
    if views.keys() != snap.tensors.keys():
        missing, extra = sorted(views.keys() - snap.tensors.keys()), sorted(snap.tensors.keys() - views.keys())
        raise SnapshotMismatchError(f"snapshot tensors do not match this cache: missing {missing[:4]}, unexpected {extra[:4]}")
    for name, view in views.items():
        t = snap.tensors[name]
        if t.shape != view.shape or t.dtype != view.dtype:
            raise SnapshotMismatchError(f"snapshot tensor {name} is {tuple(t.shape)} {t.dtype}, this cache expects "
                                        f"{tuple(view.shape)} {view.dtype}")
    if caches.packed is not None:
        # past the row's length, the maps read as a fresh slot (payload and tails are not read there)
        caches.packed.reset(torch.tensor([row]))
    for name, view in views.items():
        view.copy_(snap.tensors[name])
    return snap


def check_prefix(caches: RowCaches, row: int, position: int) -> None:
    """Check that row ``row``'s first ``position`` tokens are, as they stand, the cache of a row of
    ``position`` tokens, so that a forward at ``position`` may follow them (in this row, or in
    another after :func:`copy_prefix`). Dense K/V: always (a position past a row's length is never
    read before a forward writes it). Packed: the row has flushed exactly the whole blocks a row of
    ``position`` tokens has (:func:`~flashloop_compile.runtime.verify.flushed_after`), at every layer
    and depth, so its tail ring still holds the K/V of the positions from there to ``position``
    exactly and no later block has been quantized. Reads the row's counters (a host sync)."""
    _check_row(caches, row)
    _check_position(caches, position)
    p = caches.packed
    if p is None:
        return
    want = flushed_after(position, p.group_size)
    flushed = torch.stack([lay.flushed[row] for lay in p.layers])  # [layers, R]
    if bool((flushed != want).any()):
        got = int(flushed.max())
        why = (f"the positions {want}..{min(got, position) - 1} of its prefix are quantized, which a row of {position} tokens keeps "
               f"exact in its tail. A packed row's first {position} tokens stay reusable while it is shorter than "
               f"{want + 2 * p.group_size} tokens: keep the prefix in a row of its own (prefill it "
               "there alone, copy it from there)") if got > want else "it holds fewer tokens than that"
        raise ValueError(f"row {row} has flushed {got} tokens into quantized blocks where a row of {position} tokens "
                         f"has flushed {want}: {why}")
    _check_compact_rows(caches, row, caches.compact_rows(row), "reused")


def copy_prefix(caches: RowCaches, src: int, dst: int, position: int) -> None:
    """Copy row ``src``'s first ``position`` tokens into row ``dst`` on the device (the request in
    ``dst`` is replaced; every other row is untouched): dense K/V up to ``position``; packed,
    payload and parameters up to it (tokens, blocks), the compact residual rows ``src`` uses, its
    tail ring, counters and maps up to it, the maps past it reset. Checks first
    (:func:`check_prefix`): on an error nothing is written. Queued on the current stream after the
    writes before it, without a host round trip of the bytes."""
    _check_row(caches, dst)
    if dst == src:
        raise ValueError(f"copy_prefix: the source and destination are both row {src}: a row already holds its own "
                         "prefix (prefill the rest there with cached=)")
    check_prefix(caches, src, position)
    compact = caches.compact_rows(src)
    if caches.packed is not None:
        caches.packed.reset(torch.tensor([dst]))  # past the prefix, the maps read as a fresh slot
    for (_, to), (_, frm) in zip(caches.row_views(dst, position, compact), caches.row_views(src, position, compact)):
        to.copy_(frm)
