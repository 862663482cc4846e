"""Quality of FlashLoop configurations against dense, with uncertainty.

Every number comes from one request per document, on the model's device, through one of two
engines (``quality_table(engine=...)``, ``flashloop-compile eval --engine``):
:class:`~flashloop_compile.reference.ReferenceFlashLoop` (the explicit eager FlashLoop, the
default) or :class:`CompiledEngine` (the production path: each config's compiled engine, whose
decode runs one compiled step per token; test_evaluate checks it scores what the reference does).
With the compiled engine the first ``agreement_docs`` documents of each context also run on the
reference, and ``report.agreement`` compares every logits row (argmax agreement, logit error).

Perplexity (held-out documents, one window per document). A document of at least C + M tokens
(BOS, then its bytes) is prefilled with its first C tokens, then its next M - 1 tokens are fed
teacher-forced as one decode call of M - 1 query rows. Two numbers per document:

* **continuation** NLL: the M tokens after the context, the first predicted by the prefill's last
  row, the others by the decode rows. Every feature acts on it: token-sparse prefill (the
  context's later-loop K/V and, unless ``keep_last_token``, the last row's state), KV residual
  quantization (the context's K/V are read back from the quantized store) and sparse decode
  attention (the decode rows). One decode call of M - 1 rows equals M - 1 one-token decode steps
  as long as the store's tail flushes no group meanwhile: with C a multiple of 64 the tail holds
  64 tokens after the prefill, so M <= 64 keeps it exact (rows attend causally and each row's
  sparse-decode reference is its own).
* **prefill** NLL: the C - 1 next-token predictions inside the context. Only token-sparse prefill
  changes them (inactive rows keep the state of their last active loop).

Perplexity = exp(sum NLL / sum tokens) over documents; tokens are bytes, so NLL / ln 2 is
bits per byte. Deltas are relative (%) to dense, with 95% percentile bootstrap intervals over
documents, resampled *paired* (the same documents for the config and for dense).

Retrieval (needle in held-out code). A prompt of exactly C tokens: BOS, held-out text, a line
``{key} = "{value}"`` inserted at a line boundary at relative depth d (needle start / C; d = 0.1
is far back from the question), more held-out text, and finally ``\\n{key} = "``. The answer is
the value (6 random lowercase letters and digits); a trial scores 1 if greedy decoding reproduces
it exactly. It is scored teacher-forced: the prefill's last row and one decode call over the
answer's first len - 1 bytes give the argmax at every answer position, and greedy decoding
reproduces the answer iff every one of those argmaxes is the answer byte (it follows the answer
for as long as they agree), so exact match is the same as token-by-token greedy decoding's (the
one-call equivalence above; ``greedy=True`` decodes step by step instead). "answer bytes right"
is the share of answer positions whose teacher-forced argmax is right. Accuracy per depth and its
delta to dense in points, with paired bootstrap intervals over trials.

Multi-needle retrieval (``EvalSettings.multi_needles`` = N > 1, ``--multi-needles N``): prompts
built the same way from the same fillers (their own keys) with N needles, the asked one at depth d
and N - 1 distractors (other keys, other values) at random line boundaries; the question asks the
first. It is scored as above and reported as its
own table: the case where a sparse key set or a token-sparse loop must keep the right one of
several similar lines.

Speed: flushed blocks of the reference's quantized KV store never change, so the evaluation
memoizes each block's reconstruction per depth (:class:`MemoizedQuantizedKVStore`: same
values, computed once instead of at every read).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from flashloop_compile.config import ConfigError, FlashLoopConfig
from flashloop_compile.quality.corpus import ByteTokenizer, Corpus, needle_line, query_prefix, random_needle
from flashloop_compile.reference.kvstore import QuantizedKVStore

__all__ = [
    "EvalSettings",
    "RetrievalCase",
    "QualityReport",
    "CONFIG_SETS",
    "CompiledEngine",
    "document_logits",
    "logit_agreement",
    "named_config",
    "named_configs",
    "parse_configs",
    "device_context",
    "score_document",
    "build_retrieval_case",
    "run_retrieval_case",
    "bootstrap_indices",
    "quality_table",
]

LN2 = math.log(2.0)


# -- configurations ---------------------------------------------------------------------------------

_FEATURE_NAMES = {"tsp": "token_sparse_prefill", "sda": "sparse_decode_attention", "kvq": "kv_residual_quantization"}


def _combo_name(tsp: bool, sda: bool, kvq: bool) -> str:
    on = [n for n, flag in zip(_FEATURE_NAMES, (tsp, sda, kvq)) if flag]
    return "dense" if not on else "all-on" if len(on) == 3 else "+".join(on)


def _base_config(name: str) -> FlashLoopConfig:
    for tsp in (False, True):
        for sda in (False, True):
            for kvq in (False, True):
                if _combo_name(tsp, sda, kvq) == name:
                    return FlashLoopConfig.from_switches(tsp, sda, kvq)
    raise ConfigError(
        f"unknown configuration {name!r}: use dense, tsp, sda, kvq, tsp+sda, tsp+kvq, sda+kvq, all-on "
        f"(optionally with @modifiers), a set name ({', '.join(CONFIG_SETS)}) or a .json file"
    )


def _apply_modifier(cfg: FlashLoopConfig, mod: str, num_loops: int) -> FlashLoopConfig:
    flat = cfg.to_dict()
    key, _, value = mod.partition("=")
    if key == "retention":
        vals = [float(v) for v in value.split("/")]
        vals = [1.0] * (num_loops - len(vals)) + vals
        flat["token_sparse_prefill.retention"] = vals
    elif key in ("key_fraction", "kf"):
        flat["sparse_decode_attention.key_fraction"] = [float(v) for v in value.split("/")]
    elif key == "window":
        flat["token_sparse_prefill.window"] = None if value in ("global", "none", "None") else int(value)
    elif key in ("keep_last", "keep_last_token"):
        flat["token_sparse_prefill.keep_last_token"] = value.lower() not in ("0", "false", "off", "no") if value else True
    elif key == "group_size":
        flat["kv_residual_quantization.group_size"] = int(value)
        flat["kv_residual_quantization.tail"] = int(value)  # the tail equals the group size
    elif key in ("reuse", "reuse_selected_probabilities"):
        flat["sparse_decode_attention.reuse_selected_probabilities"] = value.lower() not in ("0", "false", "off", "no") if value else True
    else:
        raise ConfigError(
            f"unknown modifier {mod!r}: use retention=a/b, key_fraction=f, window=W|global, keep_last[=0|1], group_size=G, reuse[=0|1]"
        )
    return FlashLoopConfig.from_dict(flat)


def named_config(spec: str, num_loops: int = 4) -> FlashLoopConfig:
    """``base[@modifier...]``: base one of the 8 switch combinations (``dense``, ``tsp``, ``sda``,
    ``kvq``, ``tsp+sda``, ``tsp+kvq``, ``sda+kvq``, ``all-on``), modifiers ``retention=0.25/0.10``
    (loops 3..R; earlier loops are 1), ``key_fraction=0.10``, ``window=256`` or ``window=global``,
    ``keep_last`` / ``keep_last=0``, ``group_size=32``, ``reuse`` (sparse decode's
    reuse_selected_probabilities). Default parameters otherwise."""
    base, *mods = spec.split("@")
    cfg = _base_config(base)
    for mod in mods:
        cfg = _apply_modifier(cfg, mod, num_loops)
    return cfg.resolve(num_loops)


CONFIG_SETS: dict[str, list[str]] = {
    # The GPU script's short run: dense, each feature alone, all on (the default), the paper's engine.
    "default": ["dense", "all-on", "tsp", "sda", "kvq", "all-on@keep_last"],
    "combos": ["dense", "tsp", "sda", "kvq", "tsp+sda", "tsp+kvq", "sda+kvq", "all-on"],
    "sweep": [
        "dense",
        "all-on",
        "all-on@retention=0.5/0.25",
        "all-on@retention=0.10/0.05",
        "all-on@key_fraction=0.05",
        "all-on@key_fraction=0.25",
        "all-on@window=256",
        "all-on@window=256@keep_last",
        "all-on@keep_last",
        "tsp@keep_last",
        "all-on@reuse",
    ],
}
CONFIG_SETS["full"] = list(dict.fromkeys(CONFIG_SETS["combos"] + CONFIG_SETS["sweep"]))


def named_configs(set_name: str = "default", num_loops: int = 4) -> dict[str, FlashLoopConfig]:
    """The configurations of a named set (``default``, ``combos``, ``sweep``, ``full``)."""
    if set_name not in CONFIG_SETS:
        raise ConfigError(f"unknown configuration set {set_name!r}: choose one of {sorted(CONFIG_SETS)}")
    return {name: named_config(name, num_loops) for name in CONFIG_SETS[set_name]}


def parse_configs(specs: Iterable[str], num_loops: int = 4) -> dict[str, FlashLoopConfig]:
    """Set names, config names (see :func:`named_config`) and ``.json`` files (a flat
    FlashLoopConfig dict, named after the file). Dense is always included, first."""
    out: dict[str, FlashLoopConfig] = {"dense": FlashLoopConfig()}
    for spec in specs:
        for part in [p for p in str(spec).split(",") if p]:
            if part in CONFIG_SETS:
                out.update(named_configs(part, num_loops))
            elif part.endswith(".json"):
                data = json.loads(Path(part).read_text())
                data = data.get("config", data)
                out[Path(part).stem] = FlashLoopConfig.from_dict(data).resolve(num_loops)
            else:
                out[part] = named_config(part, num_loops)
    return out


# -- settings, device -------------------------------------------------------------------------------


class MemoizedQuantizedKVStore(QuantizedKVStore):
    """The reference's quantized store, each flushed block's ``reconstruct(depth)`` computed once.

    A block is immutable once ``_flush_block`` has appended it, so memoizing its reconstruction
    returns exactly the values the reference reads (checked by test_evaluate).
    """

    def _flush_block(self, layer: int) -> None:
        super()._flush_block(layer)
        block = self.blocks[layer][-1]
        block.reconstruct = functools.lru_cache(maxsize=None)(block.reconstruct)


def new_request(engine):
    """``engine.request()`` with the quantized store memoized (see :class:`MemoizedQuantizedKVStore`)."""
    req = engine.request()
    st = req.store
    if type(st) is QuantizedKVStore and not st.blocks[0] and st.tail_k[0][0] is None:
        req.store = MemoizedQuantizedKVStore(len(st.blocks), st.num_depths, st.group_size, st.tail_min)
    return req


class CompiledEngine:
    """The production path behind the reference's request interface: the compiled
    :class:`~flashloop_compile.runtime.engine.Engine` of ``config`` (one row, caches of ``max_seq``
    positions, rounded up to whole quantization groups), so that the harness measures the kernels
    users run. A request prefills its prompt (the logits of every prompt token, one compiled
    forward) and decodes tokens teacher-forced, one compiled decode step each (on CUDA a
    CUDA-graph replay). Each engine starts from a reset Dynamo: one evaluation compiles the same
    model for many configs in turn, and the earlier configs' graphs must neither be reused nor
    count towards the engine's recompile limit."""

    def __init__(self, model, config: FlashLoopConfig, max_seq: int, *, backend: Any = None) -> None:
        from flashloop_compile.runtime.engine import Engine

        torch._dynamo.reset()
        quant = config.kv_residual_quantization
        if quant.enabled:  # the packed cache holds whole groups of positions
            max_seq = -(-max_seq // quant.group_size) * quant.group_size
        self.model = model
        self.engine = Engine(model, config, max_batch=1, max_seq=max_seq, backend=backend)

    def request(self) -> "CompiledRequest":
        return CompiledRequest(self.engine)


class CompiledRequest:
    """One prompt through a :class:`CompiledEngine` (``prefill`` once, then ``decode``)."""

    store = None  # the reference's quantized store (new_request memoizes it): none here

    def __init__(self, engine) -> None:
        self.engine = engine
        self.pos = 0

    def prefill(self, tokens: Tensor) -> SimpleNamespace:
        logits = self.engine.prefill([tokens], all_logits=True)[0]
        self.pos = tokens.numel()
        return SimpleNamespace(logits=logits)

    def decode(self, tokens: Tensor) -> SimpleNamespace:
        if self.pos == 0:
            raise RuntimeError("decode before prefill: a compiled request starts with its prompt")
        rows = []
        for tok in tokens.reshape(-1):
            pos = torch.tensor([self.pos], device=self.engine.device)
            rows.append(self.engine.decode(tok.reshape(1), pos)[0].float().clone())  # a graph's output is reused
            self.pos += 1
        return SimpleNamespace(logits=torch.stack(rows))


ENGINES = ("reference", "compiled")


@dataclass
class EvalSettings:
    """Evaluation sizes (small by default: the reference is slow)."""

    docs: int = 16
    contexts: tuple[int, ...] = (1024, 2048)
    continuation: int = 32
    retrieval_context: int = 1024
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    retrieval_trials: int = 8
    value_len: int = 6
    n_boot: int = 1000
    seed: int = 0
    split: str = "heldout"
    agreement_docs: int = 2  # with the compiled engine: documents per context also run on the reference
    multi_needles: int = 0  # > 1: also retrieval prompts with this many needles, one asked (0: none)

    def __post_init__(self) -> None:
        self.contexts = tuple(int(c) for c in self.contexts)
        self.depths = tuple(float(d) for d in self.depths)
        if self.continuation < 1 or any(c < 2 for c in self.contexts):
            raise ValueError("continuation must be >= 1 and every context >= 2 tokens")
        if any(not (0.0 <= d <= 1.0) for d in self.depths):
            raise ValueError(f"retrieval depths must lie in [0, 1], got {self.depths}")
        if self.multi_needles < 0 or self.multi_needles == 1:
            raise ValueError(f"multi_needles must be 0 (no multi-needle prompts) or at least 2, got {self.multi_needles} "
                             "(one needle is the single-needle retrieval every run has)")


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def device_context(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Make the reference's factory calls (``torch.arange`` etc.) allocate on the model's device
    (a no-op on CPU, where the device mode would only add overhead)."""
    dev = model_device(model)
    return contextlib.nullcontext() if dev.type == "cpu" else torch.device(dev)


# -- perplexity -------------------------------------------------------------------------------------


@dataclass
class DocScore:
    prefill_nll: float
    prefill_n: int
    cont_nll: float
    cont_n: int


def document_logits(engine, tokens: Tensor, context: int, continuation: int) -> Tensor:
    """Prefill ``tokens[:context]``, decode ``tokens[context:context + continuation - 1]``
    teacher-forced: every logits row, the prefill's then the decode's ([context + continuation - 1,
    V], float32)."""
    if tokens.numel() < context + continuation:
        raise ValueError(f"document of {tokens.numel()} tokens is shorter than context {context} + continuation {continuation}")
    tokens = tokens.to(model_device(engine.model))
    with device_context(engine.model):
        req = new_request(engine)
        rows = [req.prefill(tokens[:context]).logits.float()]
        if continuation > 1:
            rows.append(req.decode(tokens[context : context + continuation - 1]).logits.float())
    return torch.cat(rows)


def score_logits(logits: Tensor, tokens: Tensor, context: int, continuation: int) -> DocScore:
    """The prompt's and the continuation's NLL from a document's :func:`document_logits`."""
    tokens = tokens.to(logits.device)
    logp = F.log_softmax(logits, dim=-1)
    pre = -logp[: context - 1].gather(-1, tokens[1:context, None]).squeeze(-1)
    cont = -logp[context - 1 : context + continuation - 1].gather(-1, tokens[context : context + continuation, None]).squeeze(-1)
    return DocScore(float(pre.sum()), int(pre.numel()), float(cont.sum()), int(cont.numel()))


def score_document(engine, tokens: Tensor, context: int, continuation: int) -> DocScore:
    """A document's scores: its first ``context`` tokens prefilled, the next ``continuation`` scored."""
    return score_logits(document_logits(engine, tokens, context, continuation), tokens, context, continuation)


def logit_agreement(a: Tensor, b: Tensor) -> dict[str, float]:
    """How far logits ``a`` (compiled) are from ``b`` (reference), both [N, V]: the share of rows
    whose argmax agrees (%), the largest absolute difference, and that over b's largest magnitude."""
    diff = (a - b).abs().max().item()
    return {"token_agreement": 100.0 * (a.argmax(-1) == b.argmax(-1)).float().mean().item(), "max_abs_err": diff,
            "max_rel_err": diff / max(b.abs().max().item(), 1e-12), "rows": int(a.shape[0])}


# -- retrieval --------------------------------------------------------------------------------------


@dataclass
class RetrievalCase:
    """One needle prompt: ``tokens`` [C]; the needle line starts at token ``needle_pos``."""

    tokens: Tensor
    key: str
    value: str
    needle: bytes
    query: bytes
    needle_pos: int
    depth: float

    @property
    def answer(self) -> bytes:
        """The expected continuation's bytes (the value; latin-1 so any byte string fits)."""
        return self.value.encode("latin-1")


def build_retrieval_case(
    filler: bytes, context: int, depth: float, rng: random.Random, tokenizer: ByteTokenizer, value_len: int = 6,
    needles: int = 1,
) -> RetrievalCase:
    """A prompt of exactly ``context`` tokens with the asked needle at relative ``depth`` (see module
    doc). ``needles`` > 1 adds needles - 1 distractors, lines of the same form with other keys, each
    at a random line boundary of the filler; the question asks the first needle's key."""
    if needles < 1:
        raise ValueError(f"a retrieval prompt needs at least one needle, got needles={needles}")
    key, value = random_needle(rng, value_len)
    lines = [needle_line(key, value)]
    keys = {key}
    while len(lines) < needles:
        k, v = random_needle(rng, value_len)
        if k not in keys:
            keys.add(k)
            lines.append(needle_line(k, v))
    query = query_prefix(key)
    head = tokenizer.encode(b"", bos=True)
    avail = context - len(head) - sum(len(n) for n in lines) - len(query)
    if avail < 0:
        raise ValueError(f"context {context} is too short for {needles} needle(s) of {len(lines[0])} bytes and a query "
                         f"of {len(query)} bytes")
    if len(filler) < avail:
        raise ValueError(f"filler of {len(filler)} bytes is shorter than the {avail} bytes the prompt needs")

    def boundary(target: int) -> int:  # at a line boundary when one is near
        nl = filler.rfind(b"\n", 0, target)
        return nl + 1 if nl >= 0 and target - nl <= 256 else target

    cuts = [boundary(round(depth * avail))] + [boundary(rng.randrange(avail + 1)) for _ in lines[1:]]
    order = sorted(range(needles), key=lambda i: (cuts[i], i))
    body, last, pos = [], 0, 0
    for i in order:
        body += [filler[last : cuts[i]], lines[i]]
        if i == 0:
            pos = len(head) + sum(len(b) for b in body[:-1])
        last = cuts[i]
    body.append(filler[last:avail])
    ids = head + list(b"".join(body)) + list(query)
    assert len(ids) == context
    return RetrievalCase(torch.tensor(ids, dtype=torch.long), key, value, lines[0], query, pos, pos / context)


def run_retrieval_case(engine, case: RetrievalCase, *, greedy: bool = False) -> tuple[int, float]:
    """(exact match 0/1, share of answer bytes right): teacher-forced (see the module doc) or,
    with ``greedy``, by token-by-token greedy decoding (bytes right = positions that agree)."""
    model = engine.model
    dev = model_device(model)
    want = list(case.answer)
    with device_context(model):
        req = new_request(engine)
        first = req.prefill(case.tokens.to(dev)).logits[-1].argmax()
        if greedy:
            out = [int(first)]
            tok = first
            for _ in range(len(want) - 1):
                tok = req.decode(tok[None]).logits[-1].argmax()
                out.append(int(tok))
        else:
            out = [int(first)]
            if len(want) > 1:
                forced = torch.tensor(want[:-1], dtype=torch.long, device=dev)
                out += req.decode(forced).logits.argmax(-1).tolist()
    right = sum(a == b for a, b in zip(out, want))
    return int(right == len(want)), right / len(want)


def retrieval_cases(
    fillers: Sequence[bytes], settings: EvalSettings, tokenizer: ByteTokenizer, needles: int = 1
) -> dict[float, list[RetrievalCase]]:
    """``retrieval_trials`` cases per depth; trial i's filler starts at held-out document i.
    ``needles`` > 1: the multi-needle prompts (their own random stream: the single-needle cases
    do not change when they are added)."""
    rng = random.Random(settings.seed if needles == 1 else settings.seed * 1000 + needles)
    cases: dict[float, list[RetrievalCase]] = {}
    for depth in settings.depths:
        cases[depth] = []
        for i in range(settings.retrieval_trials):
            parts, n, j = [], 0, i
            while n < settings.retrieval_context and j < i + len(fillers) * 4:
                parts.append(fillers[j % len(fillers)])
                n += len(parts[-1]) + 1
                j += 1
            cases[depth].append(build_retrieval_case(
                b"\n".join(parts), settings.retrieval_context, depth, rng, tokenizer, settings.value_len, needles))
    return cases


# -- statistics -------------------------------------------------------------------------------------


def bootstrap_indices(n: int, n_boot: int, seed: int) -> Tensor:
    """[n_boot, n] resampling indices (with replacement), seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n, (n_boot, n), generator=g)


def _quantiles(x: Tensor) -> tuple[float, float]:
    q = torch.quantile(x.double(), torch.tensor([0.025, 0.975], dtype=torch.float64))
    return float(q[0]), float(q[1])


def ppl_stats(nll: Sequence[float], cnt: Sequence[int], base_nll: Sequence[float], base_cnt: Sequence[int], idx: Tensor) -> dict[str, float]:
    """Perplexity with its CI, and the paired relative delta (%) to the base with its CI."""
    a, n = torch.tensor(nll, dtype=torch.float64), torch.tensor(cnt, dtype=torch.float64)
    b, m = torch.tensor(base_nll, dtype=torch.float64), torch.tensor(base_cnt, dtype=torch.float64)
    ppl = math.exp(float(a.sum() / n.sum()))
    base = math.exp(float(b.sum() / m.sum()))
    pb = torch.exp(a[idx].sum(1) / n[idx].sum(1))
    bb = torch.exp(b[idx].sum(1) / m[idx].sum(1))
    lo, hi = _quantiles(pb)
    dlo, dhi = _quantiles((pb / bb - 1) * 100)
    return {"ppl": ppl, "ppl_lo": lo, "ppl_hi": hi, "bits_per_byte": float(a.sum() / n.sum()) / LN2,
            "delta_pct": (ppl / base - 1) * 100, "delta_lo": dlo, "delta_hi": dhi}


def acc_stats(hits: Sequence[float], base_hits: Sequence[float], idx: Tensor) -> dict[str, float]:
    """Accuracy (points) with its CI, and the paired delta (points) to the base with its CI."""
    a, b = torch.tensor(hits, dtype=torch.float64), torch.tensor(base_hits, dtype=torch.float64)
    ab, bb = a[idx].mean(1) * 100, b[idx].mean(1) * 100
    lo, hi = _quantiles(ab)
    dlo, dhi = _quantiles(ab - bb)
    return {"acc": float(a.mean()) * 100, "acc_lo": lo, "acc_hi": hi,
            "delta_pts": float(a.mean() - b.mean()) * 100, "delta_lo": dlo, "delta_hi": dhi}


# -- the table --------------------------------------------------------------------------------------


@dataclass
class QualityReport:
    settings: dict[str, Any]
    model: dict[str, Any]
    configs: dict[str, dict[str, Any]]
    perplexity: dict[str, dict[str, dict[str, list]]] = field(default_factory=dict)  # ctx -> config -> per-doc lists
    retrieval: dict[str, dict[str, dict[str, list]]] = field(default_factory=dict)  # depth -> config -> per-trial lists
    multi_retrieval: dict[str, dict[str, dict[str, list]]] = field(default_factory=dict)  # the same, multi-needle prompts
    rows: list[dict[str, Any]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    # compiled engine only: config -> context -> logit_agreement over the first agreement_docs documents
    agreement: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def _retrieval_table(self, depths: list[str], prefix: str) -> list[str]:
        head = ["config"]
        for d in depths:
            head += [f"acc d={d}", f"Δ pts d={d} [95% CI]"]
        head += ["acc all", "Δ pts all [95% CI]", "answer bytes right %"]
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in self.rows:
            cells = [f"`{r['config']}`"]
            for d in depths:
                a = r[f"{prefix}@{d}"]
                cells += [f"{a['acc']:.1f} [{a['acc_lo']:.0f}, {a['acc_hi']:.0f}]", _fmt_delta(a, "delta_pts", "")]
            a = r[f"{prefix}@all"]
            cells += [f"{a['acc']:.1f}", _fmt_delta(a, "delta_pts", ""), f"{r[f'{prefix}_chars']:.1f}"]
            out.append("| " + " | ".join(cells) + " |")
        return out + [""]

    def to_markdown(self, title: str = "Quality vs dense") -> str:
        s = self.settings
        out = [f"### {title}", ""]
        out.append(
            f"Model: {self.model.get('name', '?')} ({self.model.get('layers')} layers x {self.model.get('loops')} loops, "
            f"hidden {self.model.get('hidden')}); held-out documents: {s['docs']} per context; "
            f"{'the compiled engine' if s.get('engine') == 'compiled' else 'reference FlashLoop'} "
            f"({self.model.get('dtype')}, {self.model.get('device')}). Deltas vs dense with 95% paired bootstrap CIs "
            f"({s['n_boot']} resamples over documents / trials)."
        )
        out.append("")
        ctxs = list(self.perplexity)
        if ctxs:
            out.append(f"Perplexity per byte of the {s['continuation']} tokens after a context of C tokens "
                       "(all features act on it), and inside the context (prefill: only token-sparse prefill acts on it).")
            out.append("")
            head = ["config"]
            for c in ctxs:
                head += [f"ppl C={c}", f"Δ% C={c} [95% CI]", f"prefill ppl C={c}", f"prefill Δ% C={c} [95% CI]"]
            out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for r in self.rows:
                cells = [f"`{r['config']}`"]
                for c in ctxs:
                    p, q = r.get(f"cont@{c}"), r.get(f"prefill@{c}")
                    if p is None:
                        cells += ["", "", "", ""]
                        continue
                    cells += [f"{p['ppl']:.4f} [{p['ppl_lo']:.3f}, {p['ppl_hi']:.3f}]", _fmt_delta(p, "delta_pct", "%"),
                              f"{q['ppl']:.4f}", _fmt_delta(q, "delta_pct", "%")]
                out.append("| " + " | ".join(cells) + " |")
            out.append("")
        if self.retrieval:
            out.append(f"Retrieval exact match (%), context {s['retrieval_context']}, {s['retrieval_trials']} trials per depth "
                       "(depth = needle start / context; 0.1 is far back).")
            out.append("")
            out += self._retrieval_table(list(self.retrieval), "retrieval")
        if self.multi_retrieval:
            n = s.get("multi_needles")
            out.append(f"Multi-needle retrieval exact match (%), context {s['retrieval_context']}: {n} needles per prompt "
                       f"(the asked one at depth d, {n - 1} with other keys at random line boundaries), "
                       f"{s['retrieval_trials']} trials per depth.")
            out.append("")
            out += self._retrieval_table(list(self.multi_retrieval), "multi")
        if self.agreement:
            out.append("The compiled engine against the reference on the same documents (every prefill and decode "
                       "logits row): argmax agreement, largest absolute logit difference and that over the reference's "
                       "largest logit.")
            out.append("")
            out += ["| config | context | docs | token agreement % | max abs err | max rel err |", "|---|---|---|---|---|---|"]
            for name, per in self.agreement.items():
                for c, a in per.items():
                    out.append(f"| `{name}` | {c} | {a['docs']} | {a['token_agreement']:.2f} | {a['max_abs_err']:.3g} | "
                               f"{a['max_rel_err']:.3g} |")
            out.append("")
        if self.skipped:
            out += [f"Not evaluated (time budget): {', '.join(f'`{n}`' for n in self.skipped)}.", ""]
        out.append("Configurations:")
        out.append("")
        for name, flat in self.configs.items():
            out.append(f"- `{name}`: {FlashLoopConfig.from_dict(flat)}")
        out.append("")
        return "\n".join(out)


def _fmt_delta(d: dict[str, float], key: str, unit: str) -> str:
    return f"{d[key]:+.2f}{unit} [{d['delta_lo']:+.2f}, {d['delta_hi']:+.2f}]"


def _model_info(model, name: str) -> dict[str, Any]:
    c = model.config
    p = next(model.parameters())
    return {"name": name, "layers": c.num_hidden_layers, "loops": c.num_loops, "hidden": c.hidden_size,
            "vocab_size": c.vocab_size, "dtype": str(p.dtype).replace("torch.", ""), "device": str(p.device)}


def _compute_rows(report: QualityReport, settings: EvalSettings) -> None:
    """(Re)build ``report.rows`` for every config evaluated so far (dense is the base)."""
    report.rows = []
    for name in report.seconds:
        row: dict[str, Any] = {"config": name}
        for c, per in report.perplexity.items():
            n_docs = len(per[name]["cont_nll"])
            idx = bootstrap_indices(n_docs, settings.n_boot, settings.seed + 1000 + int(c))
            base = per["dense"]
            row[f"cont@{c}"] = ppl_stats(per[name]["cont_nll"], per[name]["cont_n"], base["cont_nll"], base["cont_n"], idx)
            row[f"prefill@{c}"] = ppl_stats(per[name]["prefill_nll"], per[name]["prefill_n"], base["prefill_nll"], base["prefill_n"], idx)
        for prefix, results, salt in (("retrieval", report.retrieval, 2000), ("multi", report.multi_retrieval, 4000)):
            if not results:
                continue
            all_hits, all_base, all_chars = [], [], []
            for j, (d, per) in enumerate(results.items()):
                idx = bootstrap_indices(len(per[name]["exact"]), settings.n_boot, settings.seed + salt + j)
                row[f"{prefix}@{d}"] = acc_stats(per[name]["exact"], per["dense"]["exact"], idx)
                all_hits += per[name]["exact"]
                all_base += per["dense"]["exact"]
                all_chars += per[name]["chars"]
            idx = bootstrap_indices(len(all_hits), settings.n_boot, settings.seed + salt + 1000)
            row[f"{prefix}@all"] = acc_stats(all_hits, all_base, idx)
            row[f"{prefix}_chars"] = 100.0 * sum(all_chars) / max(len(all_chars), 1)
        row["seconds"] = report.seconds[name]
        report.rows.append(row)


def quality_table(
    model,
    configs: dict[str, FlashLoopConfig],
    settings: EvalSettings | None = None,
    *,
    corpus: Corpus | None = None,
    documents: dict[int, list[Tensor]] | None = None,
    fillers: Sequence[bytes] | None = None,
    model_name: str = "model",
    retrieval: bool = True,
    max_seconds: float | None = None,
    progress: Callable[[str], None] | None = None,
    on_config: Callable[[QualityReport], None] | None = None,
    engine: str = "reference",
) -> QualityReport:
    """Evaluate every config (dense included, as the base) and build the table.

    ``engine``: "reference" (the explicit reference, ReferenceFlashLoop) or "compiled" (the
    production path: each config's compiled Engine, :class:`CompiledEngine`).

    ``documents`` maps a context length to token sequences of at least context + continuation
    tokens; by default the first ``settings.docs`` long-enough held-out documents of ``corpus``.
    ``fillers``: the held-out texts the retrieval prompts are cut from (default: the corpus').
    ``max_seconds``: configs are evaluated in order (dense first); one whose expected time (the
    mean so far) would end past this budget is skipped and listed in ``report.skipped``.
    ``on_config``: called with the report (rows of the configs done so far) after each config,
    e.g. to save partial results.
    """
    from flashloop_compile.reference import ReferenceFlashLoop

    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    settings = settings or EvalSettings()
    say = progress or (lambda msg: None)
    configs = dict(configs)
    if "dense" not in configs:
        configs = {"dense": FlashLoopConfig(), **configs}
    num_loops = model.config.num_loops
    tok = ByteTokenizer(model.config.vocab_size)
    if documents is None or (retrieval and fillers is None):
        corpus = corpus or Corpus()
    if documents is None:
        documents = {}
        for c in settings.contexts:
            docs = corpus.long_documents(settings.split, c + settings.continuation, settings.docs)
            documents[c] = [torch.tensor(tok.encode(d, bos=True)[: c + settings.continuation], dtype=torch.long) for _, d in docs]
    if retrieval and fillers is None:
        fillers = [d for _, d in corpus.long_documents(settings.split, 256, max(settings.retrieval_trials, 1) * 4)]
    report = QualityReport(asdict(settings), _model_info(model, model_name),
                           {n: c.resolve(num_loops).to_dict() for n, c in configs.items()})
    cases = retrieval_cases(fillers, settings, tok) if retrieval and settings.depths and settings.retrieval_trials else {}
    multi_cases = retrieval_cases(fillers, settings, tok, settings.multi_needles) if cases and settings.multi_needles else {}
    # a compiled engine's caches hold the longest prompt plus what is decoded after it
    max_seq = max([c + settings.continuation for c in documents]
                  + [case.tokens.numel() + settings.value_len for cs in (*cases.values(), *multi_cases.values()) for case in cs]
                  + [2])
    report.settings["engine"] = engine

    t_start = time.perf_counter()
    configs = {"dense": configs.pop("dense"), **configs}
    for name, cfg in configs.items():
        t0 = time.perf_counter()
        if max_seconds is not None and report.seconds:
            mean = sum(report.seconds.values()) / len(report.seconds)
            if t0 - t_start + mean > max_seconds:
                report.skipped.append(name)
                say(f"skipped {name}: the {max_seconds:.0f} s budget would be exceeded")
                continue
        runner = ReferenceFlashLoop(model, cfg) if engine == "reference" else CompiledEngine(model, cfg, max_seq)
        for c, docs in documents.items():
            # with the compiled engine, the first agreement_docs documents' logits are kept and
            # compared with the reference's (compiled == reference at the model level; the
            # reference is slow, so a subset)
            keep = settings.agreement_docs if engine == "compiled" else 0
            scores, got = [], []
            for i, d in enumerate(docs):
                logits = document_logits(runner, d, c, settings.continuation)
                scores.append(score_logits(logits, d, c, settings.continuation))
                if i < keep:
                    got.append(logits)
            if got:
                ref = ReferenceFlashLoop(model, cfg)
                want = torch.cat([document_logits(ref, d, c, settings.continuation) for d in docs[: len(got)]])
                report.agreement.setdefault(name, {})[str(c)] = {**logit_agreement(torch.cat(got), want), "docs": len(got)}
            report.perplexity.setdefault(str(c), {})[name] = {
                "cont_nll": [s.cont_nll for s in scores], "cont_n": [s.cont_n for s in scores],
                "prefill_nll": [s.prefill_nll for s in scores], "prefill_n": [s.prefill_n for s in scores],
            }
        for results, per_depth in ((report.retrieval, cases), (report.multi_retrieval, multi_cases)):
            for depth, cs in per_depth.items():
                res = [run_retrieval_case(runner, case) for case in cs]
                results.setdefault(str(depth), {})[name] = {
                    "exact": [r[0] for r in res], "chars": [r[1] for r in res], "needle_pos": [case.needle_pos for case in cs],
                }
        report.seconds[name] = round(time.perf_counter() - t0, 2)
        say(f"evaluated {name} in {report.seconds[name]:.1f} s")
        if on_config is not None:
            _compute_rows(report, settings)
            on_config(report)

    _compute_rows(report, settings)
    return report
