"""Train a small Ouro (looped) model from scratch on the stdlib corpus: torch + stdlib only.

    python -m flashloop_compile.cli train --out ckpt --seconds 300 --layers 6 --hidden 256

The model is :class:`~flashloop_compile.models.ouro.OuroForCausalLM` itself (``total_ut_steps``
loops over N shared layers), trained on random windows of the packed byte stream of the train
split (:mod:`.corpus`). The training forward is the model's own layers with causal
``scaled_dot_product_attention`` (``is_causal=True``, so the fused flash kernel runs) instead of
the explicit position mask that the cached forward builds; ``test_train`` checks they agree.

Loss: cross-entropy of the last loop's logits, plus ``aux_weight`` times the mean cross-entropy
of the earlier loops' logits (Ouro trains every loop's readout; this keeps the early loops'
states meaningful, which is what FlashLoop's redundancy relies on). AdamW (no decay on norms,
biases, embeddings), linear warm-up then cosine decay to ``min_lr_ratio * lr`` over the time
budget (progress ``max(step / max_steps, time since step 1 / time left after step 1)``, so a
``torch.compile`` warm-up inside step 1 does not eat the schedule), gradient
clipping, BF16 autocast on CUDA, residual dropout (training only). Every ``eval_every`` steps the
last loop's bits per byte on fixed windows of the *valid* split (disjoint from train and from the
held-out evaluation split, see :mod:`.corpus`) is logged, and the best of those weights is what is
saved (the corpus on an Ubuntu image is ~10 MB, so a few minutes are many epochs). The run
stops at ``seconds`` (or ``max_steps``), rounds the weights to ``save_dtype`` (BF16 by default:
10 MiB for the default shape, and what is evaluated is exactly what is stored) and saves with
``save_pretrained`` beside ``command.txt`` and ``train_log.txt`` (written as it runs; its last
line is a JSON summary).

Resumable training (``resumable=True`` or ``train(..., resume=DIR)``; CLI ``--resumable``,
``--resume DIR``) splits one run over several processes, e.g. device calls of a few minutes whose
state travels as files. The LR schedule is then a function of the step alone (warm-up over the
first ``warmup_steps`` of the whole run, cosine over ``max_steps``, which is required), so every
call continues it where the last stopped, and ``seconds`` is only the wall budget of one call.
Besides the checkpoint, the output directory holds ``train_state.json`` (step, tokens, schedule
position, best valid bits/byte and its step, the config, the data's fingerprint, the RNG states,
seconds so far) and ``train_state-00001.safetensors``, ...: the last step's weights and AdamW's
``exp_avg`` and ``exp_avg_sq`` in BF16, in shards of at most 15 MiB. BF16 is what fits the
transfer limits (:data:`STATE_CAP_MIB`); it rounds the FP32 master weights once per resume (by at
most ``2**-8`` of each weight: for weights of ~0.06, about one update at the schedule's final LR)
and the moments to 8 significant bits, which Adam's normalized update barely notices.
The checkpoint's weights (``model.safetensors``, or its shards) are the selected best; a resumed
run compares its evaluations with the recorded best bits/byte and keeps those weights unless it
beats them.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import math
import os
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from flashloop_compile.models.ouro import OuroConfig, OuroForCausalLM, apply_rope, rope_cos_sin
from flashloop_compile.quality.corpus import (
    BOS, EOS, VOCAB_SIZE, ByteTokenizer, Corpus, retrieval_document, token_stream, unigram_bits_per_byte,
)

__all__ = [
    "STATE_CAP_MIB", "TrainConfig", "build_model", "count_parameters", "load_train_state", "loop_logits", "loss_fn",
    "mix_retrieval_documents", "save_train_state", "state_bytes", "train",
]

LN2 = math.log(2.0)
STATE_FORMAT = 1
STATE_FILE = "train_state.json"
SHARD_NAME = "train_state-{:05d}.safetensors"
# One file back from a device call may be 16 MiB; 15 leaves room for the header.
SHARD_BYTES = 15 * 2**20
# A call sends at most 64 MiB, the repository (~14 MiB) included: 48 MiB are left for the state
# a resumed call carries in (the shards plus model.safetensors).
STATE_CAP_MIB = 48.0
# Options a resumed run may change: none of them touches the model, the data order or the
# optimizer's trajectory (``seconds`` is one call's wall budget; the schedule spans max_steps).
RESUME_MAY_CHANGE = ("seconds", "call_steps", "log_every", "eval_every", "device", "state_cap_mib")


@dataclass
class TrainConfig:
    """Model shape and optimization settings (defaults: the committed checkpoint's)."""

    layers: int = 6
    hidden: int = 256
    head_dim: int = 64
    intermediate: int | None = None  # default 3 * hidden
    loops: int = 4
    vocab_size: int = VOCAB_SIZE
    rope_theta: float = 10_000.0
    max_position_embeddings: int = 4096
    seq_len: int = 1024
    batch: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    aux_weight: float = 0.3
    dropout: float = 0.1
    seconds: float = 300.0
    max_steps: int | None = None
    call_steps: int | None = None  # stop this call after this many steps (a per-call budget, like seconds)
    log_every: int = 25
    eval_every: int = 100
    eval_batches: int = 4
    select_best: bool = True
    seed: int = 0
    heldout_percent: int = 5
    valid_percent: int = 3
    compile: bool = False
    save_dtype: str = "bfloat16"  # FP32 master weights are rounded to this for the checkpoint
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    corpus_max_doc_bytes: int | None = None
    corpus_max_docs: int | None = None
    corpus_packages: tuple[str, ...] = ()  # installed packages' sources added to the stdlib (corpus.py)
    retrieval_fraction: float = 0.0  # share of the training bytes that are synthetic retrieval documents
    retrieval_pairs: int = 4  # needles per synthetic retrieval document
    resumable: bool = False  # write train_state* files; the schedule spans max_steps instead of seconds
    state_cap_mib: float = STATE_CAP_MIB  # largest resumable state (shards + model.safetensors) allowed

    def model_config(self) -> OuroConfig:
        if self.hidden % self.head_dim:
            raise ValueError(f"hidden={self.hidden} must be a multiple of head_dim={self.head_dim}")
        heads = self.hidden // self.head_dim
        return OuroConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate or 3 * self.hidden,
            num_hidden_layers=self.layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            total_ut_steps=self.loops,
            bos_token_id=BOS if self.vocab_size > EOS else None,
            eos_token_id=EOS if self.vocab_size > EOS else None,
        )


def build_model(cfg: TrainConfig, device: Any = "cpu") -> OuroForCausalLM:
    """A freshly initialized FP32 model (fan-in scaled normal init, unit norms, zero biases)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        with torch.device(device):
            model = OuroForCausalLM(cfg.model_config())
        model.init_random_()
    return model


def loop_logits(model: OuroForCausalLM, ids: Tensor, *, all_loops: bool = True, dropout: float = 0.0) -> list[Tensor]:
    """Per-loop logits [B, T, V] of ``ids`` [B, T] at positions 0..T-1 (no cache).

    The model's own modules, with ``is_causal`` attention (flash kernel); the same function as
    ``model.forward_loops`` without caches when ``dropout`` is 0. ``dropout`` (training only)
    drops elements of each sub-block's normalized output before it is added to the residual.
    """
    inner, cfg = model.model, model.config
    bsz, seqlen = ids.shape
    h = inner.embed_tokens(ids)
    pos = torch.arange(seqlen, device=ids.device)[None]
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, h.dtype)
    out = []
    for loop in range(cfg.num_loops):
        for layer in inner.layers:
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(bsz, seqlen, attn.n_heads, attn.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(bsz, seqlen, attn.n_kv, attn.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(bsz, seqlen, attn.n_kv, attn.head_dim).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=attn.n_kv != attn.n_heads)
            y = attn.o_proj(y.transpose(1, 2).reshape(bsz, seqlen, -1))
            h = h + F.dropout(layer.input_layernorm_2(y), dropout, training=dropout > 0)
            h = h + F.dropout(layer.post_attention_layernorm_2(layer.mlp(layer.post_attention_layernorm(h))), dropout, training=dropout > 0)
        h = inner.norm(h)
        if all_loops or loop == cfg.num_loops - 1:
            out.append(model.lm_head(h))
    return out


def loss_fn(model: OuroForCausalLM, batch: Tensor, aux_weight: float, dropout: float = 0.0) -> tuple[Tensor, Tensor]:
    """(training loss, last-loop mean cross-entropy in nats) of rows [B, T + 1]."""
    ids, targets = batch[:, :-1], batch[:, 1:]
    logits = loop_logits(model, ids, all_loops=aux_weight > 0, dropout=dropout)
    ces = [F.cross_entropy(lg.float().reshape(-1, lg.shape[-1]), targets.reshape(-1)) for lg in logits]
    last = ces[-1]
    loss = last if len(ces) == 1 else last + aux_weight * torch.stack(ces[:-1]).mean()
    return loss, last.detach()


def _param_groups(model: OuroForCausalLM, weight_decay: float) -> list[dict[str, Any]]:
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed_tokens" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _lr_at(cfg: TrainConfig, step: int, elapsed: float, first_step: float = 0.0) -> float:
    """Warm-up, then cosine over the time left after the first step (``first_step`` seconds), or,
    for a resumable run, over ``max_steps``: a function of the global step alone, so a resumed
    call continues the schedule (and warms up only if the whole run is still in its warm-up)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.resumable:
        progress = min(step / cfg.max_steps, 1.0)
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    span = cfg.seconds - first_step
    progress = (elapsed - first_step) / span if span > 0 else 1.0
    if cfg.max_steps:
        progress = max(progress, step / cfg.max_steps)
    progress = min(max(progress, 0.0), 1.0)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def _heldout_bpb(model: OuroForCausalLM, rows: Tensor, batch: int, autocast: bool) -> float:
    """Bits per byte of the last loop on fixed held-out rows (targets that are bytes only)."""
    model.eval()
    nll, n = 0.0, 0
    for i in range(0, rows.shape[0], batch):
        chunk = rows[i : i + batch]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            logits = loop_logits(model, chunk[:, :-1], all_loops=False)[-1]
        tgt = chunk[:, 1:]
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
        is_byte = tgt.reshape(-1) < 256
        nll += float(ce[is_byte].sum())
        n += int(is_byte.sum())
    model.train()
    return nll / max(n, 1) / LN2


def mix_retrieval_documents(docs: list[bytes], fraction: float, *, length: int, pairs: int = 4, seed: int = 0) -> list[bytes]:
    """``docs`` with synthetic retrieval documents (corpus.retrieval_document) inserted at random
    places until they make up ``fraction`` of the bytes. Each one's filler is a random piece of
    the documents' own text, between length / 4 and ``length`` bytes (``length``: the training
    window), so that its needles sit at every distance from their questions inside one window.
    Deterministic in ``seed``; the documents keep their order."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"retrieval_fraction must lie in [0, 1), got {fraction}")
    if fraction == 0.0 or not docs:
        return list(docs)
    rng = random.Random(seed)
    text = b"\n".join(docs)
    want = fraction / (1.0 - fraction) * len(text)
    synthetic, n = [], 0
    while n < want:
        size = rng.randint(max(length // 4, 64), max(length, 64))
        start = rng.randrange(max(len(text) - size, 1))
        doc = retrieval_document(text[start : start + size], rng, pairs=pairs)
        synthetic.append(doc)
        n += len(doc)
    slots = sorted(rng.randrange(len(docs) + 1) for _ in synthetic)
    out, j = [], 0
    for i, doc in enumerate(docs):
        while j < len(slots) and slots[j] == i:
            out.append(synthetic[j])
            j += 1
        out.append(doc)
    return out + synthetic[j:]


# -- resumable state (train_state.json + train_state-NNNNN.safetensors) ------------------------------


def count_parameters(cfg: TrainConfig) -> int:
    """Parameters of ``cfg``'s model (built on the meta device: no memory, no init)."""
    with torch.device("meta"):
        model = OuroForCausalLM(cfg.model_config())
    return sum(p.numel() for p in model.parameters())


def _entry_bytes(name: str) -> int:
    """An upper bound of a tensor's entry in a safetensors header (name, dtype, shape, offsets)."""
    return len(name) + 96


_HEADER_BYTES = 128  # the header's length field, braces, metadata and padding


def state_bytes(cfg: TrainConfig) -> int:
    """Bytes of the tensors a resumed run reads: the shards (BF16 weights, exp_avg, exp_avg_sq)
    plus ``model.safetensors`` (the BF16 best weights), i.e. 8 bytes a parameter plus headers."""
    with torch.device("meta"):
        model = OuroForCausalLM(cfg.model_config())
    names = [n for n, _ in model.named_parameters()]
    n_params = sum(p.numel() for p in model.parameters())
    headers = sum(_entry_bytes(f"exp_avg_sq/{n}") for n in names) * 4 + _HEADER_BYTES * 5
    return 8 * n_params + headers


def _check_state_cap(cfg: TrainConfig) -> None:
    """Raise before training if the resumable state would not fit ``state_cap_mib``, naming the
    sizes that fit (a run that fails this after minutes of training is a call wasted)."""
    cap = int(cfg.state_cap_mib * 2**20)
    need = state_bytes(cfg)
    if need <= cap:
        return
    n_params = count_parameters(cfg)
    fits = []
    layers = next((n for n in range(cfg.layers - 1, 0, -1) if state_bytes(dataclasses.replace(cfg, layers=n)) <= cap), None)
    if layers:
        fits.append(f"{layers} layers at hidden {cfg.hidden}")
    hidden = next((h for h in range(cfg.hidden - cfg.head_dim, 0, -cfg.head_dim)
                   if state_bytes(dataclasses.replace(cfg, hidden=h)) <= cap), None)
    if hidden:
        fits.append(f"hidden {hidden} at {cfg.layers} layers")
    raise ValueError(
        f"the resumable state of this model is {need / 2**20:.1f} MiB ({n_params:,} parameters x 8 bytes: BF16 weights, "
        f"AdamW exp_avg and exp_avg_sq in train_state-*.safetensors, BF16 best weights in model.safetensors), over "
        f"state_cap_mib={cfg.state_cap_mib:g} (--state-cap-mib; what one call can carry in beside the repository). "
        f"About {cap / 8 / 1e6:.2f} M parameters fit"
        + (f": e.g. {' or '.join(fits)}" if fits else ": no smaller depth or width of this shape does")
    )


def _plan_shards(tensors: dict[str, Tensor], shard_bytes: int) -> list[list[str]]:
    """Names per shard, in order, each shard's file at most ``shard_bytes`` (header included)."""
    shards: list[list[str]] = [[]]
    size = _HEADER_BYTES
    for name, t in tensors.items():
        need = t.numel() * t.element_size() + _entry_bytes(name)
        if _HEADER_BYTES + need > shard_bytes:
            raise ValueError(f"tensor {name} ({need / 2**20:.1f} MiB) does not fit in one shard of {shard_bytes / 2**20:g} MiB")
        if shards[-1] and size + need > shard_bytes:
            shards.append([])
            size = _HEADER_BYTES
        shards[-1].append(name)
        size += need
    return shards


def _b64(t: Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def save_train_state(out_dir: str | os.PathLike, state: dict[str, Any], tensors: dict[str, Tensor], *,
                     shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """Write ``tensors`` as ``train_state-00001.safetensors``, ... (each file at most
    ``shard_bytes``), remove older shards the new ones do not replace, then ``train_state.json``
    (``state`` plus the shard list), written last so that a complete JSON means complete shards.
    Returns the files written."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for i, names in enumerate(_plan_shards(tensors, shard_bytes), start=1):
        f = out / SHARD_NAME.format(i)
        save_file({n: tensors[n].detach().contiguous().cpu() for n in names}, str(f), metadata={"format": "pt"})
        if f.stat().st_size > shard_bytes:  # the plan's header bound is off: never return an oversized file
            raise RuntimeError(f"{f} is {f.stat().st_size:,} bytes, over the shard limit of {shard_bytes:,}")
        files.append(f)
    for old in out.glob("train_state-*.safetensors"):
        if old not in files:
            old.unlink()
    meta = dict(state, format=STATE_FORMAT, shards=[f.name for f in files])
    tmp = out / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out / STATE_FILE)
    return files + [out / STATE_FILE]


def load_train_state(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """(train_state.json's content, the shards' tensors) of a directory a resumable run wrote."""
    from safetensors.torch import load_file

    path = Path(path)
    f = path / STATE_FILE
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found: --resume needs the output directory of a --resumable run")
    state = json.loads(f.read_text())
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"{f} has format {state.get('format')!r}; this version reads format {STATE_FORMAT}")
    tensors: dict[str, Tensor] = {}
    for name in state["shards"]:
        if not (path / name).is_file():
            raise FileNotFoundError(f"{path / name} not found (listed in {f})")
        tensors.update(load_file(str(path / name)))
    return state, tensors


def _resume_mismatches(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """The config fields that differ from the saved run's, except those a resume may change."""
    given = json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples as lists, as the JSON holds them
    return [f"{k}: saved {saved.get(k)!r}, given {given.get(k)!r}" for k in sorted(set(saved) | set(given))
            if k not in RESUME_MAY_CHANGE and saved.get(k) != given.get(k)]


def _state_tensors(model: OuroForCausalLM, opt: torch.optim.Optimizer) -> dict[str, Tensor]:
    """The last step's weights and AdamW moments, rounded to BF16 (on the CPU)."""
    params = list(model.named_parameters())
    out = {f"weights/{n}": p.detach().to(torch.bfloat16).cpu() for n, p in params}
    for kind in ("exp_avg", "exp_avg_sq"):
        for n, p in params:
            st = opt.state.get(p)
            out[f"{kind}/{n}"] = (st[kind] if st else torch.zeros_like(p)).detach().to(torch.bfloat16).cpu()
    return out


def _load_state_tensors(model: OuroForCausalLM, opt: torch.optim.Optimizer, tensors: dict[str, Tensor], step: int) -> None:
    """Put saved weights and moments into ``model`` and ``opt`` (up-cast to their FP32)."""
    params = list(model.named_parameters())
    want = {f"{kind}/{n}" for kind in ("weights", "exp_avg", "exp_avg_sq") for n, _ in params}
    if want != tensors.keys():
        raise ValueError(f"the saved state does not match the model: missing {sorted(want - tensors.keys())[:4]}, "
                         f"unexpected {sorted(tensors.keys() - want)[:4]}")
    with torch.no_grad():
        for n, p in params:
            p.copy_(tensors[f"weights/{n}"])
    names = {id(p): n for n, p in params}
    sd = opt.state_dict()  # load_state_dict casts the moments to each parameter's dtype and device
    order = [names[id(p)] for group in opt.param_groups for p in group["params"]]
    sd["state"] = {i: {"step": torch.tensor(float(step)), "exp_avg": tensors[f"exp_avg/{n}"],
                       "exp_avg_sq": tensors[f"exp_avg_sq/{n}"]} for i, n in enumerate(order)}
    opt.load_state_dict(sd)


def _rng_states(gen: torch.Generator, device: torch.device) -> dict[str, Any]:
    """What the data order and dropout continue from: the batch sampler's generator and the
    global torch (and CUDA) generators; Python's too, though training draws nothing from it."""
    return {
        "batch_generator": {"device": device.type, "state": _b64(gen.get_state())},
        "torch": _b64(torch.get_rng_state()),
        "torch_cuda": _b64(torch.cuda.get_rng_state(device)) if device.type == "cuda" else None,
        "python": random.getstate(),
    }


def _restore_rng_states(rng: dict[str, Any], gen: torch.Generator, device: torch.device, seed: int, step: int) -> bool:
    """Restore :func:`_rng_states`; True if the batch order continues exactly. A generator of
    another device type has another state format: then the batch sampler and dropout are reseeded
    from (seed, step), deterministic but not the batches an uninterrupted run would draw."""
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_unb64(rng["torch"]))
    if rng["batch_generator"]["device"] != device.type:
        gen.manual_seed(seed * 1_000_003 + step)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed * 1_000_003 + step)
        return False
    gen.set_state(_unb64(rng["batch_generator"]["state"]))
    if device.type == "cuda" and rng["torch_cuda"] is not None:
        torch.cuda.set_rng_state(_unb64(rng["torch_cuda"]), device)
    return True


def _data_fingerprint(stream: Tensor) -> dict[str, Any]:
    """Length and sha256 of the training token stream: a resume must sample the same data."""
    return {"tokens": int(stream.numel()), "sha256": hashlib.sha256(stream.cpu().numpy().tobytes()).hexdigest()}


def train(
    cfg: TrainConfig,
    out_dir: str | os.PathLike | None,
    *,
    corpus: Corpus | None = None,
    command: str | None = None,
    log: Callable[[str], None] = print,
    resume: str | os.PathLike | None = None,
) -> tuple[OuroForCausalLM, dict[str, Any]]:
    """Train, save to ``out_dir`` (unless None) and return (model, summary).

    ``resume``: a directory a resumable run wrote (it may be ``out_dir`` itself: everything is read
    before anything is written). The run continues from its step with its weights, moments, RNG
    states and best weights; ``cfg`` must equal its config except for :data:`RESUME_MAY_CHANGE`.
    """
    t_start = time.perf_counter()
    resumed: tuple[dict[str, Any], dict[str, Tensor]] | None = None
    previous_log = ""
    if resume is not None:
        resumed = load_train_state(resume)
        cfg = dataclasses.replace(cfg, resumable=True)
        differ = _resume_mismatches(resumed[0]["config"], cfg)
        if differ:
            raise ValueError(f"cannot resume {resume}: options differ from the saved run's ({'; '.join(differ)}); "
                             f"a resume may change only {', '.join(RESUME_MAY_CHANGE)}")
        if (Path(resume) / "train_log.txt").is_file():
            previous_log = (Path(resume) / "train_log.txt").read_text()
    if cfg.resumable:
        if not cfg.max_steps:
            raise ValueError("resumable training needs max_steps (--max-steps): the LR schedule of a run split over "
                             "several calls spans a step budget, and seconds is only one call's wall budget")
        _check_state_cap(cfg)
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    log_file = None
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "command.txt").write_text((command or "(library call)") + "\n")
        log_file = open(Path(out_dir) / "train_log.txt", "w")
        log_file.write(previous_log)

    def emit(msg: str) -> None:
        log(msg)
        if log_file is not None:
            log_file.write(msg + "\n")
            log_file.flush()

    corpus = corpus or Corpus(heldout_percent=cfg.heldout_percent, valid_percent=cfg.valid_percent,
                               max_doc_bytes=cfg.corpus_max_doc_bytes, packages=tuple(cfg.corpus_packages))
    tok = ByteTokenizer(cfg.vocab_size)
    train_paths, valid_paths, held_paths = corpus.train_paths, corpus.valid_paths, corpus.heldout_paths
    if cfg.corpus_max_docs:
        k = max(cfg.corpus_max_docs // 10, 2)
        train_paths, valid_paths, held_paths = train_paths[: cfg.corpus_max_docs], valid_paths[:k], held_paths[:k]
    train_docs = [corpus.read(p) for p in train_paths]
    held_docs = [corpus.read(p) for p in held_paths]
    unigram = unigram_bits_per_byte(train_docs, held_docs)
    train_docs = mix_retrieval_documents(train_docs, cfg.retrieval_fraction, length=cfg.seq_len, pairs=cfg.retrieval_pairs,
                                         seed=cfg.seed)
    stream = token_stream(train_docs, tok)
    data = _data_fingerprint(stream) if cfg.resumable else None
    if resumed is not None and resumed[0]["data"] != data:
        raise ValueError(f"cannot resume {resume}: the training data differ from the saved run's "
                         f"({resumed[0]['data']['tokens']:,} tokens, sha256 {resumed[0]['data']['sha256'][:12]}; now "
                         f"{data['tokens']:,} tokens, sha256 {data['sha256'][:12]}): the corpus (the interpreter's "
                         f"stdlib, --packages, --corpus-root) is not the one the run started on")
    stream = stream.to(device)

    def eval_rows(docs: list[bytes], seed: int) -> Tensor | None:
        """Fixed random windows of a split's stream (at most eval_batches * batch of them)."""
        st = token_stream(docs, tok)
        if st.numel() < cfg.seq_len + 2:
            return None
        n = min(cfg.eval_batches * cfg.batch, max((st.numel() - 1) // cfg.seq_len, 1))
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, st.numel() - cfg.seq_len - 1, (n,), generator=g)
        return torch.stack([st[s : s + cfg.seq_len + 1].long() for s in starts.tolist()]).to(device)

    held_rows = eval_rows(held_docs, cfg.seed + 1)
    valid_rows = eval_rows([corpus.read(p) for p in valid_paths], cfg.seed + 2)
    if held_rows is None:
        raise ValueError("the held-out split is too small for one evaluation window")

    model = build_model(cfg, device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    use_cuda = device.type == "cuda"
    opt_kwargs: dict[str, Any] = {"lr": cfg.lr, "betas": cfg.betas}
    if use_cuda:
        opt_kwargs["fused"] = True
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), **opt_kwargs)
    step_fn = loss_fn
    if cfg.compile:
        step_fn = torch.compile(loss_fn)

    if resumed is not None:
        emit(f"=== resumed from {resume} at step {resumed[0]['step']} of {cfg.max_steps}")
    emit(f"command: {command or '(library call)'}")
    emit(f"python {platform.python_version()} torch {torch.__version__} device {device}"
         + (f" ({torch.cuda.get_device_name(device)})" if use_cuda else ""))
    emit(f"corpus: {corpus.root}{''.join(' + ' + n for n in corpus.packages)}: train {len(train_paths)} files {stream.numel():,} tokens; valid {len(valid_paths)} files; "
         f"held-out {len(held_paths)} files (bucket sha256(path) % 100: held-out < {corpus.heldout_percent} <= valid "
         f"< {corpus.heldout_percent + corpus.valid_percent} <= train)")
    emit(f"unigram baseline (train byte frequencies, add-one) on held-out: {unigram:.3f} bits/byte")
    emit(f"model: {json.dumps(model.config.to_dict(), sort_keys=True)}")
    emit(f"parameters: {n_params:,} ({n_params * 4 / 2**20:.1f} MiB in fp32)")
    emit(f"train config: {json.dumps(dataclasses.asdict(cfg), sort_keys=True)}")

    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    offsets = torch.arange(cfg.seq_len + 1, device=device)
    high = stream.numel() - cfg.seq_len - 1
    step, tokens_seen, history = 0, 0, []
    select_rows = valid_rows if valid_rows is not None else held_rows
    select_name = "valid" if valid_rows is not None else "held-out"
    best: tuple[float, int, dict[str, Tensor]] | None = None
    seconds_before, calls = 0.0, 1
    if resumed is not None:
        state, tensors = resumed
        step, tokens_seen = state["step"], state["tokens"]
        seconds_before, calls = state["train_seconds"], state["calls"] + 1
        _load_state_tensors(model, opt, tensors, step)
        del tensors
        if cfg.select_best and state["best"] is not None:
            best_weights = OuroForCausalLM.from_pretrained(resume, dtype=torch.float32, device=device).state_dict()
            best = (state["best"]["bits_per_byte"], state["best"]["step"], best_weights)
        exact = _restore_rng_states(state["rng"], gen, device, cfg.seed, step)
        emit(f"resumed: step {step} of {cfg.max_steps}, {tokens_seen / 1e6:.1f}M tokens, {seconds_before:.1f} s in "
             f"{calls - 1} earlier run(s); weights and AdamW moments read back from BF16; best "
             + (f"{select_name} {best[0]:.3f} bits/byte at step {best[1]}" if best else "none")
             + ("" if exact else "; the state's generators were of another device type: batches reseeded from (seed, step)"))
    step_start, tokens_start = step, tokens_seen
    t_loop = time.perf_counter()
    t_log, tok_log = t_loop, tokens_seen
    first_step = 0.0  # seconds step 1 took (torch.compile's warm-up happens there)
    loss_acc, ce_acc, n_acc = torch.zeros((), device=device), torch.zeros((), device=device), 0
    last_eval: float | None = None
    while True:
        elapsed = time.perf_counter() - t_loop
        if ((cfg.max_steps is not None and step >= cfg.max_steps) or elapsed >= cfg.seconds
                or (cfg.call_steps is not None and step - step_start >= cfg.call_steps)):
            break
        lr = _lr_at(cfg, step, elapsed, first_step)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, high, (cfg.batch,), device=device, generator=gen)
        batch = stream[starts[:, None] + offsets].long()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_cuda):
            loss, ce = step_fn(model, batch, cfg.aux_weight, cfg.dropout)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        if step == step_start + 1:
            first_step = time.perf_counter() - t_loop
        tokens_seen += batch.numel() - batch.shape[0]
        loss_acc += loss.detach()
        ce_acc += ce
        n_acc += 1
        if step % cfg.log_every == 0 or step == 1:
            now = time.perf_counter()
            rate = (tokens_seen - tok_log) / max(now - t_log, 1e-9)
            t_log, tok_log = now, tokens_seen
            avg_loss, avg_ce = float(loss_acc) / n_acc, float(ce_acc) / n_acc
            loss_acc.zero_(); ce_acc.zero_(); n_acc = 0
            msg = (f"step {step:6d} | {now - t_loop:7.1f} s | lr {lr:.2e} | loss {avg_loss:.4f} | "
                   f"last-loop ce {avg_ce:.4f} nats ({avg_ce / LN2:.3f} bits/token) | grad {float(grad_norm):.2f} | "
                   f"{rate / 1e3:,.0f}k tok/s | {tokens_seen / 1e6:.1f}M tokens")
            if step % cfg.eval_every == 0:
                last_eval = _heldout_bpb(model, select_rows, cfg.batch, use_cuda)
                msg += f" | {select_name} {last_eval:.3f} bits/byte"
                if cfg.select_best and (best is None or last_eval < best[0]):
                    best = (last_eval, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
                    msg += " (best)"
            emit(msg)
            # batch_digest: the sum of the batch's window starts, a fingerprint of the data order
            history.append({"step": step, "seconds": round(now - t_loop, 2), "loss": avg_loss, "ce": avg_ce, "lr": lr,
                            "tokens_per_s": rate, "heldout_bpb": last_eval if step % cfg.eval_every == 0 else None,
                            "batch_digest": int(starts.sum())})
    train_seconds = time.perf_counter() - t_loop
    if cfg.resumable:  # the last step's state, before selection and rounding touch the weights
        rng = _rng_states(gen, device)
        last_state = _state_tensors(model, opt)
    final_select = _heldout_bpb(model, select_rows, cfg.batch, use_cuda)
    saved_step = step
    if cfg.select_best and best is not None and best[0] < final_select:
        model.load_state_dict(best[2])
        saved_step, final_select = best[1], best[0]
    save_dtype = getattr(torch, cfg.save_dtype)
    if save_dtype != torch.float32:
        # The checkpoint is what gets evaluated: round the weights as they will be stored, and
        # report every final number on the rounded weights.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(save_dtype).float())
        final_select = _heldout_bpb(model, select_rows, cfg.batch, use_cuda)
    final_bpb = _heldout_bpb(model, held_rows, cfg.batch, use_cuda)
    model.eval()
    run_tokens = tokens_seen - tokens_start
    summary = {
        "steps": step,
        "saved_step": saved_step,
        f"{select_name.replace('-', '')}_bits_per_byte": final_select,
        "tokens": tokens_seen,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "tokens_per_second": run_tokens / max(train_seconds, 1e-9),
        "heldout_bits_per_byte": final_bpb,
        "heldout_rows": int(held_rows.shape[0]),
        "unigram_bits_per_byte": unigram,
        "parameters": n_params,
        "train_files": len(train_paths),
        "heldout_files": len(held_paths),
        "valid_files": len(valid_paths),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if use_cuda else "cpu",
        "config": dataclasses.asdict(cfg),
    }
    if cfg.resumable:
        summary.update({"resumed_from": str(resume) if resume is not None else None, "resumed_at_step": step_start,
                        "max_steps": cfg.max_steps, "finished": step >= cfg.max_steps, "runs": calls,
                        "train_seconds_total": round(seconds_before + train_seconds, 1)})
    emit(f"done: {step} steps, {tokens_seen / 1e6:.1f}M tokens"
         + (f" ({step - step_start} steps, {run_tokens / 1e6:.1f}M tokens in this run)" if step_start else "")
         + f" in {train_seconds:.1f} s ({summary['tokens_per_second'] / 1e3:,.0f}k tok/s)")
    emit(f"saved weights: step {saved_step} ({'the best evaluation' if saved_step != step else 'the last step'}), "
         f"rounded to {cfg.save_dtype}: {select_name} {final_select:.3f} bits/byte")
    emit(f"held-out (last loop, {held_rows.shape[0]} x {cfg.seq_len} tokens{', bf16 autocast' if use_cuda else ''}): "
         f"{final_bpb:.3f} bits/byte (perplexity {2 ** final_bpb:.3f} per byte); unigram baseline {unigram:.3f} bits/byte")
    summary["history"] = history
    if out_dir is not None:
        out = Path(out_dir)
        # shards of at most SHARD_BYTES: every file fits what a device call returns (16 MiB a file)
        weight_files = model.to(save_dtype).save_pretrained(out, max_shard_bytes=SHARD_BYTES)
        model.float()
        weight_bytes = sum(f.stat().st_size for f in weight_files)
        emit(f"saved: {out} ({weight_bytes / 2**20:.1f} MiB, {cfg.save_dtype} weights"
             + (f", {len(weight_files) - 1} shards)" if len(weight_files) > 1 else ")"))
        if cfg.resumable:
            state = {
                "step": step, "tokens": tokens_seen, "max_steps": cfg.max_steps,
                "schedule": {"progress": min(step / cfg.max_steps, 1.0), "next_lr": _lr_at(cfg, step, 0.0),
                             "warmup_steps": cfg.warmup_steps},
                # the checkpoint's weights: the best as stored (rounded), with their bits/byte
                "best": {"bits_per_byte": final_select, "step": saved_step, "split": select_name} if cfg.select_best else None,
                "train_seconds": seconds_before + train_seconds, "calls": calls,
                "config": dataclasses.asdict(cfg), "data": data, "rng": rng, "weights_dtype": "bfloat16",
            }
            files = save_train_state(out, state, last_state)
            size = sum(f.stat().st_size for f in files) + weight_bytes
            emit(f"resumable state: step {step} of {cfg.max_steps}"
                 + (" (finished)" if step >= cfg.max_steps else f"; continue with --resume {out}")
                 + f": {STATE_FILE} + {len(files) - 1} shard(s), {size / 2**20:.1f} MiB with the best weights "
                 f"(cap {cfg.state_cap_mib:g} MiB)")
        emit("summary: " + json.dumps({k: v for k, v in summary.items() if k != "history"}, sort_keys=True))
        log_file.close()
    return model, summary
