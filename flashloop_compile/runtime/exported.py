"""Run a package written by :func:`flashloop_compile.export` without the model's Python class.

    model = flashloop_compile.load_exported("model.pt2")
    result = model.generate([prompt_a, prompt_b], max_new_tokens=32)

The loader reads the package's description, checks it against this process (package format,
cache-layout version, torch version, device, dtype and, when given, the expected config), allocates
the caches it describes (dense, or the packed cache of runtime/packed_kv.py) and the step plan, and
runs the AOTInductor programs: prefill at the exported batch (rows past the request padded) and
decode at the smallest exported bucket that holds the batch. ``prefill`` / ``decode`` /
``generate`` keep the engine's semantics (runtime/engine.py): ragged prompts, greedy or seeded
sampling, per-request stop tokens. Importing this module registers the ``flashloop`` ops (a CPU
package calls their CPU bodies); it never imports ``flashloop_compile.models``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

# the programs call these ops: importing the modules registers them
import flashloop_compile.lowering.ops  # noqa: F401
import flashloop_compile.lowering.packed_ops  # noqa: F401
import flashloop_compile.lowering.packed_sparse_ops  # noqa: F401
import flashloop_compile.lowering.prefill_ops  # noqa: F401
import flashloop_compile.lowering.selection_ops  # noqa: F401
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.lowering.packed_layout import LAYER_TENSOR_NAMES, MODEL_TENSOR_NAMES, PACKED_LAYOUT_VERSION, PackedGeometry
from flashloop_compile.runtime.engine import Generation, _bucket, _token_ids
from flashloop_compile.runtime.packed_kv import PackedKVCache
from flashloop_compile.runtime.state import StepPlan

__all__ = ["ExportError", "ExportedModel", "load_exported"]

FORMAT = "flashloop-export"
FORMAT_VERSION = 1
DENSE_LAYOUT_VERSION = 1
METADATA_FILE = "flashloop.json"
# a prefill program takes at least this many tokens per row (torch.export specializes a size of 1);
# shorter prompts are padded, the padding planned as such
MIN_PROMPT_TOKENS = 2


class ExportError(Exception):
    """A package that cannot be written or run here: the message says what to change."""


def prefill_name(index: int) -> str:
    return f"prefill{index}"


def decode_name(bucket: int) -> str:
    return f"decode_b{bucket}"


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The package's description (what :func:`flashloop_compile.export` recorded)."""
    from torch.export.pt2_archive._package import PT2ArchiveReader

    path = Path(path)
    if not path.is_file():
        raise ExportError(f"{path}: no such package (flashloop_compile.export writes one)")
    try:
        with PT2ArchiveReader(str(path)) as reader:
            name = next((n for n in reader.get_file_names() if n.endswith("/" + METADATA_FILE)), None)
            text = reader.read_string(name) if name is not None else None
    except RuntimeError as e:  # not a PT2 archive at all
        raise ExportError(f"{path} is not a .pt2 package ({e}): it was not written by flashloop_compile.export; "
                          "export the model with it") from None
    if text is None:
        raise ExportError(f"{path} is a .pt2 package without {METADATA_FILE}: it was not written by "
                          "flashloop_compile.export; export the model with it")
    return json.loads(text)


def _check(meta: dict[str, Any], path: Path, *, config: FlashLoopConfig | dict | None, device: Any,
           dtype: torch.dtype | None) -> None:
    where = str(path)
    if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
        raise ExportError(f"{where}: package format {meta.get('format')!r} version {meta.get('format_version')!r}; this "
                          f"flashloop_compile reads {FORMAT!r} version {FORMAT_VERSION}: export the model again with it")
    layout = meta["cache_layout"]
    expected = {"dense": DENSE_LAYOUT_VERSION, "packed": PACKED_LAYOUT_VERSION}.get(layout.get("kind"))
    if expected is None:
        raise ExportError(f"{where}: unknown cache layout {layout.get('kind')!r}: export the model again with this flashloop_compile")
    if layout.get("version") != expected:
        raise ExportError(f"{where}: {layout['kind']} cache layout version {layout.get('version')}, this flashloop_compile "
                          f"allocates version {expected}: export the model again with this flashloop_compile (or load "
                          "the package with the flashloop_compile that wrote it)")
    if meta["torch_version"] != torch.__version__:
        raise ExportError(f"{where}: exported with torch {meta['torch_version']}, this process runs torch {torch.__version__}: "
                          f"AOTInductor programs run on the torch that compiled them; export again under torch "
                          f"{torch.__version__} or install torch {meta['torch_version']}")
    stored = FlashLoopConfig.from_dict(meta["config"])
    if stored.hash() != meta["config_hash"]:
        raise ExportError(f"{where}: its config hashes to {stored.hash()} here, the package records {meta['config_hash']}: "
                          "the config's meaning changed since the export; export the model again")
    if config is not None:
        want = FlashLoopConfig.coerce(config)
        if _resolved_hash(want, meta) != meta["config_hash"]:
            raise ExportError(f"{where}: exported for FlashLoop config {meta['config_hash']} ({stored}), you asked for "
                              f"{want.hash()} ({want}): export the model with this config, or load without config=")
    if device is not None and torch.device(device).type != meta["device"]:
        raise ExportError(f"{where}: exported for {meta['device']}, you asked for {torch.device(device).type}: export the "
                          f"model on a {torch.device(device).type} device, or load without device=")
    if meta["device"] == "cuda" and not torch.cuda.is_available():
        raise ExportError(f"{where}: exported for cuda and this process has no CUDA device: load it on a GPU machine, "
                          "or export the model on cpu")
    if dtype is not None and str(dtype).removeprefix("torch.") != meta["dtype"]:
        raise ExportError(f"{where}: exported in {meta['dtype']}, you asked for {str(dtype).removeprefix('torch.')}: export "
                          "the model in that dtype (model.to(dtype)), or load without dtype=")


def _resolved_hash(want: FlashLoopConfig, meta: dict[str, Any]) -> str:
    """The hash of ``want`` resolved for the exported model, as the export resolved its config."""
    return want.resolve(meta["num_loops"], head_dim=meta["head_dim"]).hash()


class ExportedModel(Generation):
    """The loaded programs and their caches; see the module docstring."""

    def __init__(self, path: Path, meta: dict[str, Any], runners: dict[str, Any]) -> None:
        self.path, self.meta = path, meta
        self.form = meta["form"]  # "aoti": AOTInductor programs
        self.config = FlashLoopConfig.from_dict(meta["config"])
        self.config_hash = meta["config_hash"]
        self.model_config = meta["model_config"]
        self.vocab_size = int(meta["vocab_size"])
        self.max_batch, self.max_seq = int(meta["max_batch"]), int(meta["max_seq"])
        self.prompt_bounds = (min(r["min"] for r in meta["prefill"]), max(r["max"] for r in meta["prefill"]))
        self.buckets = tuple(meta["buckets"])
        self.device = torch.device(meta["device"], 0) if meta["device"] == "cuda" else torch.device(meta["device"])
        self.dtype = getattr(torch, meta["dtype"])
        self._runners = runners
        self.plan = StepPlan.allocate(self.max_batch, self.device)
        self.packed: PackedKVCache | None = None
        self.caches: dict[str, Tensor] = self._allocate(meta["cache_layout"])

    def _allocate(self, layout: dict[str, Any]) -> dict[str, Tensor]:
        out = {"plan.seq_lens": self.plan.seq_lens, "plan.last_pos": self.plan.last_pos}
        if layout["kind"] == "dense":
            dtype = getattr(torch, layout["dtype"])
            for i in range(layout["caches"]):
                for n in ("k_cache", "v_cache"):
                    out[f"dense.{i}.{n}"] = torch.zeros(layout["shape"], dtype=dtype, device=self.device)
            return out
        geometry = PackedGeometry(**layout["geometry"])
        self.packed = PackedKVCache.for_geometry(geometry, residual_capacity=layout["residual_capacity"],
                                                 dtype=getattr(torch, layout["dtype"]), device=self.device)
        for layer in range(self.packed.num_layers):
            out.update({f"packed.layer{layer}.{n}": t for n, t in zip(LAYER_TENSOR_NAMES, self.packed.layer_tensors(layer))})
        out.update({f"packed.{n}": t for n, t in zip(MODEL_TENSOR_NAMES, self.packed.model_tensors())})
        return out

    def __repr__(self) -> str:
        return (f"ExportedModel({str(self.path)!r}, form={self.form}, config {self.config_hash} ({self.config}), "
                f"{self.meta['dtype']} on {self.meta['device']}, max_batch={self.max_batch}, max_seq={self.max_seq}, "
                f"prompts {self.prompt_bounds[0]}..{self.prompt_bounds[1]} tokens, buckets={self.buckets}, cache {self.meta['cache_layout']['kind']})")

    def _run(self, name: str, ids: Tensor, pos: Tensor) -> Tensor:
        state = [self.caches[n] for n in self.meta["programs"][name]["state"]]
        return self._runners[name](ids, pos, state)

    def reset(self) -> None:
        """Forget every request (the packed cache's slots; a dense cache needs no reset)."""
        if self.packed is not None:
            self.packed.reset()

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int] | Tensor]) -> Tensor:
        """Prefill every prompt (rows = slots 0..B-1); the logits of each prompt's last token [B, V]."""
        prompts = [_token_ids(p, i, self.vocab_size) for i, p in enumerate(prompts)]
        b = len(prompts)
        if not 1 <= b <= self.max_batch:
            raise ExportError(f"prefill of {b} prompts: the package was exported with max_batch={self.max_batch}; "
                              f"give at most {self.max_batch} prompts per call (generate runs longer lists in waves) "
                              "or export with a larger max_batch")
        lengths = [len(p) for p in prompts]
        t = max(max(lengths), MIN_PROMPT_TOKENS)
        program = next((r["name"] for r in self.meta["prefill"] if r["min"] <= t <= r["max"]), None)
        if program is None:
            lo, hi = min(r["min"] for r in self.meta["prefill"]), max(r["max"] for r in self.meta["prefill"])
            if t > hi:
                raise ExportError(f"a prompt of {t} tokens is beyond the exported prefill bound of {hi} tokens (max_seq): "
                                  "shorten the prompt or export with a larger max_seq")
            raise ExportError(f"the longest prompt has {t} tokens, below the exported prefill bound of {lo} tokens "
                              f"(min_prompt): give a prompt of at least {lo} tokens or export with min_prompt <= {t}")
        ids = torch.zeros(self.max_batch, t, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = p.to(self.device)
        pos = torch.arange(t, device=self.device)[None].expand(self.max_batch, -1).contiguous()
        pad = self.max_batch - b
        # rows past the request: one token each, in slots no request uses
        self.plan.set(lengths + [1] * pad, [n - 1 for n in lengths] + [0] * pad)
        logits = self._run(program, ids, pos)
        return torch.stack([logits[i, n - 1].float() for i, n in enumerate(lengths)])

    @torch.no_grad()
    def decode(self, tok: Tensor, pos: Tensor) -> Tensor:
        """One decode step for rows 0..B-1 (tokens [B], positions [B]); logits [B, V], run by the
        program of the smallest exported batch bucket that holds B (padding rows write position 0
        of their unused slots, as the engine's captured graphs do)."""
        b = tok.shape[0]
        bucket = _bucket(b, self.buckets)
        if bucket is None:
            raise ExportError(f"decode batch {b} is beyond the largest exported batch bucket {self.buckets[-1]} "
                              f"(buckets {self.buckets}): decode at most {self.buckets[-1]} rows at once or export "
                              "with a larger max_batch")
        ids = torch.zeros(bucket, 1, dtype=torch.long, device=self.device)
        p = torch.zeros(bucket, 1, dtype=torch.long, device=self.device)
        ids[:b, 0] = tok.to(self.device)
        p[:b, 0] = pos.to(self.device)
        self.plan.set([int(x) + 1 for x in pos.tolist()] + [1] * (bucket - b))
        return self._run(decode_name(bucket), ids, p)[:b, -1]

    def _start_wave(self) -> None:
        self.reset()

    def _too_long(self, longest: int, max_new_tokens: int) -> Exception:
        return ExportError(f"a prompt of {longest} tokens + max_new_tokens={max_new_tokens} is beyond the exported "
                           f"bound max_seq={self.max_seq}: shorten the prompt, generate fewer tokens or export with "
                           "a larger max_seq")


def load_exported(path: str | Path, *, config: FlashLoopConfig | dict | None = None, device: Any = None,
                  dtype: torch.dtype | None = None) -> ExportedModel:
    """Load a package of :func:`flashloop_compile.export`. ``config``, ``device`` and ``dtype``, when
    given, are what the caller expects: a package exported otherwise is an error."""
    from torch.export.pt2_archive._package import load_pt2

    path = Path(path)
    meta = read_metadata(path)
    _check(meta, path, config=config, device=device, dtype=dtype)
    names = list(meta["programs"])
    contents = load_pt2(str(path), load_weights_from_disk=True, device_index=0 if meta["device"] == "cuda" else -1)
    missing = [n for n in names if n not in contents.aoti_runners]
    if missing:
        raise ExportError(f"{path}: the package lacks the programs {missing} its description lists: export the model again")
    return ExportedModel(path, meta, {n: contents.aoti_runners[n] for n in names})
