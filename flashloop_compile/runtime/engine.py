"""Batched generation on the compiled model: prefill (whole or in window-aligned chunks), decode
under CUDA graphs captured per bucket key, sampling, per-request stop tokens, timings.

    engine = Engine(model, FlashLoopConfig.all_on(), max_batch=8, max_seq=4096)
    result = engine.generate([prompt_a, prompt_b], max_new_tokens=64)
    result.tokens, result.ttft_s, result.token_latency_s

The engine allocates the caches once (static addresses), compiles the model with the flashloop
backend (prefill with a dynamic token dimension, so prompt lengths do not recompile; a prompt's
first chunk is called without positions, a fresh prompt whose attention the backend runs as causal
SDPA, and later chunks at their positions: a chunked prefill compiles these two graphs), writes the
step plan (which rows are real, where prompts end) before every forward, and replays decode from
CUDA graphs keyed by (phase, batch bucket, config hash; and k for a verify step). A batch larger
than the last bucket runs the same compiled code without a graph and says so; it never falls back
to dense.

``engine.warm_up(prompt_len)`` compiles (and on CUDA captures) ahead of the first request, with a
progress bar on a terminal (``progress=``).

A host engine that schedules requests itself drives the steps: ``prefill`` (rows 0..B-1),
``decode`` (rows 0..B-1, a row it does not serve fed token 0 at position 0, as graph padding is),
``snapshot(row, position)`` and ``restore(snapshot, row)`` to move one request's cache to another
row, engine or process (runtime/snapshot.py), ``verify`` (k = 2..8 tokens per row, causal among
themselves: speculative verification; CUDA graphs keyed by (batch bucket, k)) and ``accept(row, n)``
to keep the first n of them (runtime/verify.py: the cache becomes that of a step of n tokens), and
``reuse_prefix(src_row, dst_row, length)`` with ``prefill(prompts, cached=...)`` to start a request
from the cache of a prompt prefix another row holds (prefix reuse: only the rest is prefilled).
"""

from __future__ import annotations

import logging
import numbers
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.lowering.packed_layout import LAYER_TENSOR_NAMES, MODEL_TENSOR_NAMES, PackedGeometry
from flashloop_compile.runtime.packed_kv import PackedKVCache
from flashloop_compile.runtime.snapshot import (CacheGeometry, RowCaches, RowSnapshot, check_prefix, copy_prefix,
                                                restore_row, snapshot_row)
from flashloop_compile.runtime.state import state_for_model
from flashloop_compile.runtime.verify import MAX_VERIFY_TOKENS, MIN_VERIFY_TOKENS, StepUndo

__all__ = ["Engine", "Sampling", "GenerationResult", "BATCH_BUCKETS"]

log = logging.getLogger("flashloop_compile.runtime")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class Sampling:
    """Greedy when temperature is 0; otherwise temperature + nucleus (top_p) sampling, seeded."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or not (0 < self.top_p <= 1):
            raise ValueError(f"sampling needs temperature >= 0 and top_p in (0, 1], got {self}")


GREEDY = Sampling()


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new tokens per request (stop token included when hit)
    ttft_s: list[float]  # time to first token per request
    token_latency_s: list[float]  # wall time of each decode step
    prefill_s: float = 0.0
    capture_s: float = 0.0
    graphs: int = 0
    stats: dict[str, Any] = field(default_factory=dict)

    @property
    def tpot_s(self) -> float:
        lat = self.token_latency_s
        return sorted(lat)[len(lat) // 2] if lat else float("nan")


def _bucket(n: int, buckets: Sequence[int]) -> int | None:
    return next((b for b in buckets if b >= n), None)


class Generation:
    """Batched generation over ``prefill`` / ``decode`` (rows 0..B-1): the loop the Engine and an
    exported package's loader share. A subclass provides prefill, decode, packed (or None),
    device, max_batch, max_seq, vocab_size, ``_start_wave`` and ``_too_long``."""

    def generate(
        self,
        prompts: Sequence[Sequence[int] | Tensor],
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        stop_tokens: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> GenerationResult:
        """Generate for up to max_batch prompts at once; longer lists run in waves."""
        prompts = [_token_ids(p, i, self.vocab_size) for i, p in enumerate(prompts)]
        if not prompts:
            return GenerationResult([], [], [])
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_seq:
            raise self._too_long(longest, max_new_tokens)
        stops = _per_request_stops(stop_tokens, len(prompts))
        out = GenerationResult([], [], [])
        for w in range(0, len(prompts), self.max_batch):
            part = self._generate_wave(prompts[w : w + self.max_batch], max_new_tokens, sampling, stops[w : w + self.max_batch])
            out.tokens += part.tokens
            out.ttft_s += part.ttft_s
            out.token_latency_s += part.token_latency_s
            out.prefill_s += part.prefill_s
        return out

    def _generate_wave(self, prompts, max_new_tokens, sampling, stops) -> GenerationResult:
        gen = torch.Generator(device=self.device).manual_seed(sampling.seed) if sampling.temperature > 0 else None
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self._start_wave()
        sync()
        t0 = time.perf_counter()
        logits = self.prefill(prompts)
        if self.packed is not None:
            self.packed.check_overflow()  # outside any captured region
        tok = _sample(logits, sampling, gen)
        sync()
        prefill_s = time.perf_counter() - t0
        b = len(prompts)
        tokens = [[int(x)] for x in tok.tolist()]
        done = [tokens[i][0] in stops[i] for i in range(b)]
        pos = torch.tensor([len(p) for p in prompts], device=self.device)
        latencies = []
        for _ in range(max_new_tokens - 1):
            if all(done):
                break
            t1 = time.perf_counter()
            logits = self.decode(tok, pos)
            tok = _sample(logits, sampling, gen)
            host = tok.tolist()
            latencies.append(time.perf_counter() - t1)
            pos = pos + 1
            for i in range(b):
                if not done[i]:
                    tokens[i].append(host[i])
                    done[i] = host[i] in stops[i]
        if self.packed is not None:
            self.packed.check_overflow()
        return GenerationResult(tokens, [prefill_s] * b, latencies, prefill_s=prefill_s)


class Engine(Generation):
    def __init__(
        self,
        model: torch.nn.Module,
        config: FlashLoopConfig | None = None,
        *,
        max_batch: int,
        max_seq: int,
        prefill_chunk: int | None = None,
        max_new_tokens: int | None = None,
        cuda_graphs: bool | None = None,
        batch_buckets: Sequence[int] = BATCH_BUCKETS,
        backend: Any = None,
        progress: bool | None = None,
    ) -> None:
        from flashloop_compile.backend import make_backend

        self.model = model.eval()
        self.config = (config or FlashLoopConfig()).resolve(model.config.num_loops, head_dim=model.config.head_dim)
        limit = model.config.max_position_embeddings
        if max_batch < 1 or max_seq < 2:
            raise ValueError(f"an engine needs max_batch >= 1 and max_seq >= 2, got max_batch={max_batch}, max_seq={max_seq}")
        if max_seq > limit:
            raise ValueError(f"max_seq={max_seq} exceeds the model's max_position_embeddings={limit}: "
                             f"give max_seq <= {limit} (prompt + new tokens)")
        if max_new_tokens is not None and not 1 <= max_new_tokens < max_seq:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be in [1, max_seq={max_seq})")
        self.max_batch, self.max_seq = max_batch, max_seq
        self.progress = progress
        self._warming = False
        window = self.config.token_sparse_prefill.window
        if prefill_chunk is not None and self.config.token_sparse_prefill.selects:
            if window is None:
                raise ValueError("prefill_chunk needs token_sparse_prefill.window (global selection needs the whole prompt)")
            if prefill_chunk % window:
                raise ValueError(f"prefill_chunk={prefill_chunk} must be a multiple of token_sparse_prefill.window={window}")
        self.prefill_chunk = prefill_chunk
        self.device = next(model.parameters()).device
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        self.buckets = tuple(b for b in batch_buckets if b <= max_batch) or (max_batch,)
        quant = self.config.kv_residual_quantization
        # with KV quantization the compiled graphs keep K/V in the packed cache only: the model's
        # dense cache buffers are zero-byte stand-ins that describe the shape
        model.setup_caches(max_batch, max_seq, storage=not quant.enabled)
        self.state = state_for_model(model)
        self.packed = None
        if quant.enabled:
            self.packed = self._allocate_packed(max_new_tokens)
        # fullgraph: a graph break would hand the backend fragments; the limit: Dynamo falls back to
        # running eagerly (dense) when it is hit, which must be an error here.
        self.backend = backend or make_backend(self.config)
        self.compiled = torch.compile(model, backend=self.backend, fullgraph=True)
        self._verify_compiled = None  # the multi-query decode graphs' (compiled on first use)
        self._pending: _PendingStep | None = None  # the last verify step, until the next forward
        # tokens in each row's cache, as the forwards, restore and reuse_prefix left them (the host
        # gives decode its positions: this is what prefix reuse checks a row against)
        self._lengths = [0] * max_batch
        self._dynamo_config = dict(recompile_limit=64, fail_on_recompile_limit_hit=True)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, Tensor, Tensor, Tensor]] = {}
        self.capture_s = 0.0

    def _allocate_packed(self, max_new_tokens: int | None):
        """The packed cache, sized for the config (compact residual rows for retained tokens)."""
        from flashloop_compile.runtime.memory import residual_capacity

        cfg, q = self.model.config, self.config.kv_residual_quantization
        dtype = next(self.model.parameters()).dtype
        geometry = PackedGeometry(cfg.num_hidden_layers, cfg.num_loops, self.max_batch, self.max_seq,
                                  cfg.num_key_value_heads, cfg.head_dim, q.group_size, q.tail)
        # the compiled graphs take the model state's cache of their geometry (runtime/provider.py)
        self.state.packed = PackedKVCache.for_geometry(
            geometry, dtype=dtype, device=self.device,
            residual_capacity=residual_capacity(self.config, cfg.num_loops, self.max_seq, max_new_tokens),
        )
        return self.state.packed

    def memory(self):
        """KV bytes of this engine's caches (see runtime/memory.py)."""
        from flashloop_compile.runtime.memory import KVMemory

        cfg = self.model.config
        elem = next(self.model.parameters()).element_size()
        dense = 2 * cfg.num_loops * cfg.num_hidden_layers * self.max_batch * cfg.num_key_value_heads * self.max_seq * cfg.head_dim * elem
        return KVMemory(dense, self.packed.nbytes().as_dict() if self.packed is not None else None)

    def state_tensors(self) -> dict[str, Tensor]:
        """Every tensor a forward writes, by name: the dense caches that have storage
        (``dense.{loop * N + layer}.k_cache``) and the packed cache (``packed.layer{i}.{name}``,
        ``packed.{name}``). Restore them in place (``copy_``): captured graphs hold these addresses."""
        out = {}
        for i, cache in enumerate(self.model.model.kv_caches):
            if cache.has_storage:
                out[f"dense.{i}.k_cache"], out[f"dense.{i}.v_cache"] = cache.k_cache, cache.v_cache
        if self.packed is not None:
            for layer in range(self.packed.num_layers):
                out.update({f"packed.layer{layer}.{n}": t for n, t in zip(LAYER_TENSOR_NAMES, self.packed.layer_tensors(layer))})
            out.update({f"packed.{n}": t for n, t in zip(MODEL_TENSOR_NAMES, self.packed.model_tensors())})
        return out

    # -- one request's cache ----------------------------------------------------------------------
    def row_caches(self) -> RowCaches:
        """This engine's caches as snapshot and restore see them (runtime/snapshot.py)."""
        cfg, q = self.model.config, self.config.kv_residual_quantization
        packed = self.packed is not None
        geometry = CacheGeometry("packed" if packed else "dense", cfg.num_hidden_layers, cfg.num_loops,
                                 cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size,
                                 q.group_size if packed else None, q.tail if packed else None)
        dense = [(c.k_cache, c.v_cache) for c in self.model.model.kv_caches if c.has_storage]
        return RowCaches(self.config.hash(), geometry, next(self.model.parameters()).dtype, self.max_batch, self.max_seq,
                         dense, self.packed)

    def snapshot(self, row: int, position: int, *, logits: Tensor | None = None,
                 path: str | os.PathLike | None = None) -> bytes | os.PathLike:
        """Row ``row``'s cache (``position`` tokens: the next token's position) and, if given, the
        logits [V] its next token is sampled from, as safetensors bytes (or written to ``path``,
        returned). On CUDA the device is synchronized first: the bytes hold every write queued so
        far, never a torn step."""
        snap = snapshot_row(self.row_caches(), row, position, logits)
        return snap.save(path) if path is not None else snap.to_bytes()

    def restore(self, snapshot: bytes | str | os.PathLike | RowSnapshot, row: int) -> RowSnapshot:
        """Put a snapshot's request into row ``row`` (replacing what was there; other rows are
        untouched); its ``position`` and ``logits`` continue it. A snapshot of another config,
        geometry, dtype or format version is an error before any byte is written. The returned
        logits are on this engine's device."""
        snap = restore_row(self.row_caches(), snapshot, row)
        if self._pending is not None:
            self._pending.open.discard(row)  # the restored request replaces the step's row
        self._lengths[row] = snap.position
        if snap.logits is not None:
            snap.logits = snap.logits.to(self.device)
        return snap

    def reuse_prefix(self, src_row: int, dst_row: int, length: int) -> int:
        """Start row ``dst_row`` from the cache of row ``src_row``'s first tokens (prefix reuse) and
        return n, how many: ``length`` (the tokens the two rows' prompts share) rounded down to
        whole token_sparse_prefill windows where token-sparse prefill selects (a window's selection
        needs all its tokens). The cache of those n tokens is copied on the device (no host round
        trip of the bytes; the request in ``dst_row`` is replaced, every other row untouched); then
        ``prefill(prompts, cached=...)`` with n for ``dst_row`` prefills only the rest of its prompt.
        n = 0 (a prefix shorter than a window) copies nothing.

        The copy holds what ``src_row``'s forwards wrote for those tokens (its prefill, and its
        decode steps for tokens it generated), so ``dst_row`` continues as ``src_row``'s run cut at
        n followed by a prefill of the rest as a chunk at position n. Without KV quantization that
        equals prefilling the whole prompt (chunks on window boundaries are exact). With it, the
        rest reads the prefix from the packed cache (its closed blocks quantized, its last tokens
        exact from the tail ring), as the second chunk of a prompt prefilled in two does; so
        ``src_row`` must not have flushed more blocks than a row of n tokens has (it holds the
        prefix alone, or it is continued where it stands), else the prefix's last tokens are no
        longer exact and it is an error. Errors leave every row unchanged: rows out of range or
        equal, a row whose verify step awaits ``accept`` (busy), an empty source or ``length`` past
        the tokens ``src_row`` holds, token-sparse selection without a window.
        """
        for name, row in (("src_row", src_row), ("dst_row", dst_row)):
            if isinstance(row, bool) or not isinstance(row, numbers.Integral) or not 0 <= row < self.max_batch:
                raise ValueError(f"reuse_prefix: {name}={row!r} is not a row of this engine (0..{self.max_batch - 1})")
        if src_row == dst_row:
            raise ValueError(f"reuse_prefix: src_row and dst_row are both {src_row}: a row already holds its own prefix "
                             "(prefill the rest of its prompt with cached=)")
        if isinstance(length, bool) or not isinstance(length, numbers.Integral) or length < 0:
            raise ValueError(f"reuse_prefix: length must be the shared prefix's token count, an int >= 0, got {length!r}")
        for what, row in (("source", src_row), ("destination", dst_row)):
            if self._pending is not None and row in self._pending.open:
                raise ValueError(f"reuse_prefix: the {what} row {row} is busy: its last verify step awaits accept({row}, n) "
                                 "(its cache holds tokens that may still be rolled back); accept it first")
        held = self._lengths[src_row]
        if held == 0 and length > 0:
            raise ValueError(f"reuse_prefix: row {src_row} is empty (no prefill, decode, restore or reuse_prefix has "
                             "filled it): prefill the prefix there first")
        if length > held:
            raise ValueError(f"reuse_prefix: row {src_row} holds {held} tokens (as its last prefill, decode, verify, "
                             f"restore or reuse_prefix left it), fewer than length={length}")
        window = self._prefix_window("reuse_prefix")
        n = int(length) // window * window
        if n:
            copy_prefix(self.row_caches(), int(src_row), int(dst_row), n)
            self._lengths[dst_row] = n
        return n

    def _prefix_window(self, what: str) -> int:
        """What a reused prefix's length is a multiple of: the selection window where token-sparse
        prefill selects (a later chunk starts on a window boundary), else 1."""
        tsp = self.config.token_sparse_prefill
        if not tsp.selects:
            return 1
        if tsp.window is None:
            raise ValueError(f"{what} needs token_sparse_prefill.window: global selection (window None) takes the whole "
                             "prompt in one forward; set a window (e.g. 1024) to prefill after a prefix")
        return tsp.window

    # -- forwards ---------------------------------------------------------------------------------
    @torch.no_grad()
    def _forward(self, ids: Tensor, pos: Tensor | None, seq_lens: list[int], last_pos: list[int] | None, dynamic: bool,
                 compiled=None) -> Tensor:
        """One compiled forward; ``pos`` None: a fresh prompt at positions 0..T-1, which the model
        builds in the graph (the backend then attends it with causal SDPA, passes/position_attention.py)."""
        self.state.plan.set(seq_lens, last_pos)
        if dynamic:
            torch._dynamo.mark_dynamic(ids, 1)
            if pos is not None:
                torch._dynamo.mark_dynamic(pos, 1)
        with torch._dynamo.config.patch(**self._dynamo_config):
            compiled = self.compiled if compiled is None else compiled
            return compiled(ids) if pos is None else compiled(ids, pos)

    def prefill(self, prompts: list[Tensor], *, cached: Sequence[int] | None = None, all_logits: bool = False) -> Tensor:
        """Prefill every prompt (rows = slots 0..B-1); the logits of each prompt's last token [B, V].

        ``all_logits``: the logits of every prefilled token instead, [B, T, V] (float32; row i's
        first ``len(prompts[i]) - cached[i]`` positions are its tokens, the rest padding), as a
        perplexity over the prompt needs (quality/evaluate.py).

        ``cached[i]`` (default 0): the first tokens of prompt i that row i's cache already holds
        (copied there by ``reuse_prefix``, restored, or left by the row's own forwards); only the
        tokens from there on are prefilled, at their positions, reading the cached ones from the
        cache. It must leave at least one token to prefill, not exceed what the row holds, and be
        a multiple of token_sparse_prefill.window where token-sparse prefill selects. A row with
        nothing cached starts from an empty packed slot.
        """
        prompts = [_token_ids(p, i, self.model.config.vocab_size) for i, p in enumerate(prompts)]
        b = len(prompts)
        lengths = [len(p) for p in prompts]
        if max(lengths) > self.max_seq:
            raise ValueError(f"a prompt of {max(lengths)} tokens exceeds max_seq={self.max_seq}")
        starts = self._cached_starts(cached, lengths)
        t = max(n - c for n, c in zip(lengths, starts))
        ids = torch.zeros(b, t, dtype=torch.long, device=self.device)
        for i, (p, c) in enumerate(zip(prompts, starts)):
            ids[i, : len(p) - c] = p[c:].to(self.device)
        # a row's padding (past its prompt) may run past the cache after a long prefix: it sits at
        # max_seq - 1 there, where nothing is stored for padding and the dense cache's scratch slot is
        pos = (torch.tensor(starts)[:, None] + torch.arange(t)).clamp_max(self.max_seq - 1).to(self.device)
        full = [i for i, (n, c) in enumerate(zip(lengths, starts)) if n == self.max_seq and n - c < t]
        if full:
            raise ValueError(f"prompt {full[0]} fills max_seq={self.max_seq} and is padded after a shorter cached "
                             "prefix than other rows': prefill it in a call of its own")
        self._pending = None  # checked: the forwards end the last verify step's rollback window
        if self.packed is not None and 0 in starts:
            self.packed.reset(torch.tensor([i for i, c in enumerate(starts) if c == 0]))  # fresh prompts: empty slots
        chunk = self.prefill_chunk or t
        last = torch.empty(b, self.model.config.vocab_size, device=self.device)
        every = []
        for start in range(0, t, chunk):
            end = min(start + chunk, t)
            valid = [min(n, c + end) for n, c in zip(lengths, starts)]
            last_pos = [n - 1 if c + start < n <= c + end else -1 for n, c in zip(lengths, starts)]
            # a fresh prompt's first chunk has its own graph; later chunks attend a stored prefix
            chunk_pos = None if start == 0 and not any(starts) else pos[:, start:end].contiguous()
            logits = self._forward(ids[:, start:end].contiguous(), chunk_pos, valid, last_pos, dynamic=True)
            if all_logits:
                every.append(logits.float())
            for i, (n, c) in enumerate(zip(lengths, starts)):
                if c + start < n <= c + end:
                    last[i] = logits[i, n - 1 - c - start].float()
        self._lengths[:b] = lengths
        return torch.cat(every, 1) if all_logits else last

    def _cached_starts(self, cached: Sequence[int] | None, lengths: list[int]) -> list[int]:
        """Each prompt's first position to prefill: ``cached`` checked against the rows (see prefill)."""
        if cached is None:
            return [0] * len(lengths)
        cached = list(cached)
        if len(cached) != len(lengths):
            raise ValueError(f"cached has {len(cached)} entries for {len(lengths)} prompts: give one per prompt (0: none)")
        for i, (c, n) in enumerate(zip(cached, lengths)):
            if isinstance(c, bool) or not isinstance(c, numbers.Integral) or not 0 <= c < n:
                raise ValueError(f"cached[{i}]={c!r} must be an int in 0..{n - 1}: the tokens of prompt {i} that row {i} "
                                 "already holds (its last token is always prefilled: its logits start the generation)")
            if c == 0:
                continue
            window = self._prefix_window("prefill with cached tokens")
            if c % window:
                raise ValueError(f"cached[{i}]={c} is not a multiple of token_sparse_prefill.window={window}: a chunk "
                                 "after a prefix starts on a selection-window boundary (reuse_prefix returns such a length)")
            if c > self._lengths[i]:
                raise ValueError(f"cached[{i}]={c}: row {i} holds {self._lengths[i]} tokens (as its last prefill, decode, "
                                 "verify, restore or reuse_prefix left it)")
            check_prefix(self.row_caches(), i, int(c))
        return [int(c) for c in cached]

    def _decode_eager(self, tok: Tensor, pos: Tensor, ends: list[int] | None = None) -> Tensor:
        """Decode tokens [B, 1] at positions [B, 1] without a CUDA graph; ``ends``: each row's length
        after the step (pos + 1 when not given: the exporter traces the step this way)."""
        if ends is None:
            ends = [int(p) + 1 for p in pos[:, 0].tolist()]
        return self._forward(tok, pos, ends, None, dynamic=False)[:, -1]

    def decode(self, tok: Tensor, pos: Tensor, *, graph: bool = True) -> Tensor:
        """One decode step for rows 0..B-1 (tokens [B], positions [B]); logits [B, V].

        With CUDA graphs the step replays the graph of the batch's bucket (captured on its first
        use) and the logits are a view of that graph's static output, overwritten by its next
        replay. ``graph=False`` runs the compiled model directly at the batch's own size, as a
        batch past the last bucket does (e.g. to check a replay against direct execution on the
        same cache state).
        """
        self._pending = None
        b = tok.shape[0]
        ends = [int(p) + 1 for p in pos.tolist()]
        self._lengths[:b] = ends
        use_graph = self.cuda_graphs and graph
        bucket = _bucket(b, self.buckets) if use_graph else None
        if bucket is None:
            if use_graph:
                warnings.warn(f"decode batch {b} is outside the CUDA-graph buckets {self.buckets}: running without a graph")
            return self._decode_eager(tok[:, None], pos[:, None], ends)
        key = ("decode", bucket, self.config.hash())
        if key not in self._graphs:
            self._graphs[key] = self._capture(bucket)
        cuda_graph, static_tok, static_pos, static_out = self._graphs[key]
        static_tok.zero_()
        static_pos.zero_()
        static_tok[:b, 0] = tok
        static_pos[:b, 0] = pos
        # plan: real rows only; padded rows write position 0 of their (unused) slots
        self.state.plan.set(ends + [1] * (bucket - b))
        cuda_graph.replay()
        return static_out[:b]

    # -- multi-query decode (speculative verification) --------------------------------------------
    def verify(self, tokens: Tensor, pos: Tensor, *, graph: bool = True) -> Tensor:
        """A decode step of k = 2..8 tokens per row for rows 0..B-1 (tokens [B, k] at positions
        pos[b] .. pos[b] + k - 1, pos [B] each row's length); logits [B, k, V].

        Row j of a row's step attends to the cache and the step's tokens 0..j (causal), with its own
        loop-2 selection and corrections under sparse decode; every token is written (packed under
        KV quantization). It reads the cache as it stood before the step (the reference's multi-row
        decode): where k one-token decodes would flush a packed block between two of the tokens, the
        later rows see that block's tokens exactly instead of quantized. All k tokens stay in the
        cache unless ``accept(row, n)`` keeps fewer, before the next forward.

        With CUDA graphs the step replays the graph of (batch bucket, k), captured on first use;
        padded rows feed token 0 at the scratch position max_seq - 1 and store nothing packed. The
        logits are a view of the graph's static output. ``graph=False`` runs it directly.
        """
        if not isinstance(tokens, Tensor) or tokens.dim() != 2:
            raise ValueError(f"verify takes tokens [B, k], got {getattr(tokens, 'shape', type(tokens).__name__)}")
        b, k = tokens.shape
        if not MIN_VERIFY_TOKENS <= k <= MAX_VERIFY_TOKENS:
            raise ValueError(f"verify takes k in {MIN_VERIFY_TOKENS}..{MAX_VERIFY_TOKENS} tokens per row, got k={k}"
                             + (": feed one token with decode()" if k == 1 else ""))
        if not 1 <= b <= self.max_batch:
            raise ValueError(f"verify batch {b} must be in 1..max_batch={self.max_batch}")
        if tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise TypeError(f"verify tokens have dtype {tokens.dtype}: token ids must be integers")
        if tuple(pos.shape) != (b,):
            raise ValueError(f"verify takes pos [B={b}] (each row's length), got shape {tuple(pos.shape)}")
        starts = [int(p) for p in pos.tolist()]
        bad = [(i, p) for i, p in enumerate(starts) if not 1 <= p <= self.max_seq - k]
        if bad:
            i, p = bad[0]
            raise ValueError(f"row {i} at position {p}: a verify step of k={k} tokens needs a prefilled row with "
                             f"position + k <= max_seq={self.max_seq}")
        compiled = self._verify_model()
        self._pending = None
        undo = StepUndo.capture(self.packed, starts, k) if self.packed is not None else None
        tokens = tokens.to(self.device, torch.long)
        positions = torch.tensor(starts, device=self.device)[:, None] + torch.arange(k, device=self.device)
        use_graph = self.cuda_graphs and graph
        bucket = _bucket(b, self.buckets) if use_graph else None
        if bucket is None:
            if use_graph:
                warnings.warn(f"verify batch {b} is outside the CUDA-graph buckets {self.buckets}: running without a graph")
            torch._dynamo.mark_static(tokens, 1)
            torch._dynamo.mark_static(positions, 1)
            logits = self._forward(tokens, positions, [p + k for p in starts], None, dynamic=False, compiled=compiled)
        else:
            key = ("verify", bucket, k, self.config.hash())
            if key not in self._graphs:
                self._graphs[key] = self._capture(bucket, k)
            cuda_graph, static_tok, static_pos, static_out = self._graphs[key]
            static_tok.zero_()
            static_pos.fill_(self.max_seq - 1)
            static_tok[:b] = tokens
            static_pos[:b] = positions
            self.state.plan.set([p + k for p in starts] + [self.max_seq - 1] * (bucket - b))
            cuda_graph.replay()
            logits = static_out[:b]
        self._pending = _PendingStep(undo, starts, k, set(range(b)))
        self._lengths[:b] = [p + k for p in starts]
        return logits

    def accept(self, row: int, n: int) -> int:
        """Keep the first ``n`` (0..k) of row ``row``'s tokens of the last verify step; the other
        k - n are forgotten: the cache becomes exactly what a step of those n tokens would have left
        (tail ring, row maps, depth counts, flushed blocks: runtime/verify.py). Returns the row's
        next position (its length). A row not accepted keeps all k tokens; the next forward ends the
        step's rollback window."""
        p = self._pending
        if isinstance(row, bool) or not isinstance(row, numbers.Integral):
            raise TypeError(f"accept takes a row index, got {row!r}")
        if p is None or row not in p.open:
            why = ("no verify step is open (accept follows verify, before the next prefill, decode, verify or "
                   "restore)") if p is None else (f"row {row} was already accepted" if 0 <= row < len(p.starts)
                                                  else f"the last verify step has rows 0..{len(p.starts) - 1}")
            raise ValueError(f"accept(row={row}, n={n!r}): {why}")
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 0 <= n <= p.k:
            raise ValueError(f"accept(row={row}, n={n!r}): n must be an int in 0..k={p.k} (the tokens to keep)")
        if p.undo is not None:
            p.undo.roll_back(self.packed, int(row), int(n))
        p.open.discard(row)
        self._lengths[row] = p.starts[row] + int(n)
        return p.starts[row] + int(n)

    def _verify_model(self):
        """The model compiled with the backend's decode phase for every graph (k query rows)."""
        if self._verify_compiled is None:
            from flashloop_compile.backend import make_backend

            options = getattr(self.backend, "flashloop_options", None)
            if options is None:
                raise ValueError("verify needs the engine's backend to be flashloop_compile.backend.make_backend(...)'s: "
                                 f"it compiles the k-token step as a decode graph, which {self.backend!r} cannot be told")
            config, inner, _ = options
            self._verify_compiled = torch.compile(self.model, backend=make_backend(config, inner=inner, phase="decode"),
                                                  fullgraph=True)
        return self._verify_compiled

    def _capture_inputs(self, bucket: int, k: int = 1) -> tuple[Tensor, Tensor]:
        """Static inputs of a bucket's decode graph, planned for the warm-up and capture forwards.

        Those forwards run at a bucket's first decode step, while requests are live in slots
        0..bucket-1, so they must leave their state alone: every row feeds token 0 at the scratch
        position max_seq - 1, planned as padding (length max_seq - 1). The packed cache stores
        nothing for a padding token; the dense cache is written at max_seq - 1 only, a position
        generation never feeds (prompt + new tokens <= max_seq) and that any forward feeding it
        writes before reading it (attention is causal). Feeding position 0 instead overwrote the
        first prompt token's K/V (and, packed, a live tail slot) of every row.
        """
        scratch = self.max_seq - 1  # every token of a verify step's row too (all padding)
        static_tok = torch.zeros(bucket, k, dtype=torch.long, device=self.device)
        static_pos = torch.full((bucket, k), scratch, dtype=torch.long, device=self.device)
        self.state.plan.set([scratch] * bucket)
        return static_tok, static_pos

    def _capture(self, bucket: int, k: int | None = None):
        from flashloop_compile.runtime.progress import COMPILE_HINT, Progress

        # warm_up's bar already says what runs; a bucket first met while serving gets its own
        what = f"decode CUDA graph, batch bucket {bucket}" + (f", {k} tokens per row" if k else "")
        bar = Progress(1, what, enabled=False if self._warming else self.progress, leave=False)
        bar.stage(f"compiling and capturing ({COMPILE_HINT})")
        try:
            return self._capture_graph(bucket, k)
        finally:
            bar.close()

    def _capture_graph(self, bucket: int, k: int | None = None):
        """The decode graph of a batch bucket (k None: one token per row, the last logits) or the
        verify graph of (bucket, k) (every row's k logits)."""
        t0 = time.perf_counter()
        static_tok, static_pos = self._capture_inputs(bucket, k or 1)
        compiled = self.compiled if k is None else self._verify_model()
        if k is not None:
            torch._dynamo.mark_static(static_tok, 1)
            torch._dynamo.mark_static(static_pos, 1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.no_grad(), torch._dynamo.config.patch(**self._dynamo_config):
            for _ in range(3):  # compile + warm up outside the capture
                compiled(static_tok, static_pos)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), torch.no_grad(), torch._dynamo.config.patch(**self._dynamo_config):
            out = compiled(static_tok, static_pos)
            static_out = out[:, -1] if k is None else out
        self.capture_s += time.perf_counter() - t0
        log.info("captured %s graph for batch bucket %d%s in %.1f s", "decode" if k is None else "verify", bucket,
                 "" if k is None else f", k={k}", time.perf_counter() - t0)
        return graph, static_tok, static_pos, static_out

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # -- warm-up ----------------------------------------------------------------------------------
    def warm_up(self, prompt_len: int, batch: int | None = None) -> float:
        """Compile prefill and decode (and capture the decode graph of ``batch``'s bucket on CUDA)
        before the first request, showing a progress bar; the seconds it took. Prefill is compiled
        with a dynamic token dimension, so other prompt lengths reuse it."""
        from flashloop_compile.runtime.progress import COMPILE_HINT, Progress

        batch = batch or self.max_batch
        if not 1 <= prompt_len < self.max_seq or not 1 <= batch <= self.max_batch:
            raise ValueError(f"warm_up needs 1 <= prompt_len < max_seq={self.max_seq} and 1 <= batch <= "
                             f"max_batch={self.max_batch}, got prompt_len={prompt_len}, batch={batch}")
        t0 = time.perf_counter()
        prompts = [torch.zeros(prompt_len, dtype=torch.long)] * batch
        decode = "compiling decode" + (f" and capturing its CUDA graph (batch {_bucket(batch, self.buckets) or batch})"
                                       if self.cuda_graphs else "")
        self._warming = True
        try:
            with Progress(2, f"warm-up ({config_label(self.config)})", enabled=self.progress, leave=False) as bar:
                if self.packed is not None:
                    self.packed.reset()
                bar.stage(f"compiling prefill ({COMPILE_HINT})")
                logits = self.prefill(prompts)
                bar.advance()
                bar.stage(decode)
                self.decode(logits.argmax(-1), torch.full((batch,), prompt_len, device=self.device))
                bar.advance()
                if self.packed is not None:
                    self.packed.reset()
                self._lengths = [0] * self.max_batch
        finally:
            self._warming = False
        seconds = time.perf_counter() - t0
        log.info("warm-up (compile%s) took %.1f s", " + capture" if self.cuda_graphs else "", seconds)
        return seconds

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    # -- generation -------------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[Sequence[int] | Tensor],
        max_new_tokens: int,
        sampling: Sampling = GREEDY,
        stop_tokens: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> GenerationResult:
        """Generate for up to max_batch prompts at once; longer lists run in waves."""
        out = super().generate(prompts, max_new_tokens, sampling, stop_tokens)
        out.capture_s, out.graphs = self.capture_s, self.num_graphs
        return out

    def _start_wave(self) -> None:
        self._pending = None
        self._lengths = [0] * self.max_batch
        if self.packed is not None:
            self.packed.reset()  # a wave's requests start with empty slots

    def _too_long(self, longest: int, max_new_tokens: int) -> Exception:
        return ValueError(f"a prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds max_seq={self.max_seq}: "
                          f"allocate a larger engine (max_seq <= max_position_embeddings="
                          f"{self.model.config.max_position_embeddings}) or shorten the prompt")


@dataclass
class _PendingStep:
    """The last verify step: what undoes its packed writes (None: dense), each row's length before
    it, k, and the rows not yet accepted."""

    undo: StepUndo | None
    starts: list[int]
    k: int
    open: set[int]


def config_label(config: FlashLoopConfig) -> str:
    """The enabled features, e.g. ``token_sparse_prefill+kv_residual_quantization``, or ``dense``."""
    on = [g for g in ("token_sparse_prefill", "sparse_decode_attention", "kv_residual_quantization")
          if getattr(config, g).enabled]
    return "+".join(on) or "dense"


def _token_ids(prompt: Sequence[int] | Tensor, index: int, vocab_size: int) -> Tensor:
    """One prompt as a 1-D long tensor of token ids in [0, vocab_size); anything else is an error
    (a float prompt would otherwise be cast to integers silently)."""
    t = prompt if isinstance(prompt, Tensor) else torch.as_tensor(prompt)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"prompt {index} has dtype {t.dtype}: token ids must be integers (tokenize text first)")
    if t.dim() != 1:
        raise ValueError(f"prompt {index} has shape {tuple(t.shape)}: give each prompt as a 1-D sequence of token ids")
    if t.numel() == 0:
        raise ValueError(f"prompt {index} is empty: every prompt needs at least one token")
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"prompt {index} has token ids in [{lo}, {hi}]: the model's vocabulary is [0, {vocab_size})")
    return t.to(torch.long)


def _per_request_stops(stop_tokens, n: int) -> list[set[int]]:
    if stop_tokens is None:
        return [set() for _ in range(n)]
    if all(isinstance(s, int) for s in stop_tokens):
        return [set(stop_tokens) for _ in range(n)]
    if len(stop_tokens) != n:
        raise ValueError(f"stop_tokens: give one list for all requests or one per request ({n})")
    return [set(s) for s in stop_tokens]


def _sample(logits: Tensor, sampling: Sampling, gen: torch.Generator | None) -> Tensor:
    if sampling.temperature == 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        keep = torch.cumsum(sorted_p, -1) - sorted_p < sampling.top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs / probs.sum(-1, keepdim=True), 1, generator=gen)[:, 0]
