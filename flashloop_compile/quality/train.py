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
"""

from __future__ import annotations

import dataclasses
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

__all__ = ["TrainConfig", "build_model", "loop_logits", "loss_fn", "mix_retrieval_documents", "train"]

LN2 = math.log(2.0)


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
    """Warm-up, then cosine over the time left after the first step (``first_step`` seconds)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
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


def train(
    cfg: TrainConfig,
    out_dir: str | os.PathLike | None,
    *,
    corpus: Corpus | None = None,
    command: str | None = None,
    log: Callable[[str], None] = print,
) -> tuple[OuroForCausalLM, dict[str, Any]]:
    """Train, save to ``out_dir`` (unless None) and return (model, summary)."""
    t_start = time.perf_counter()
    device = torch.device(cfg.device)
    torch.manual_seed(cfg.seed)
    log_file = None
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        (Path(out_dir) / "command.txt").write_text((command or "(library call)") + "\n")
        log_file = open(Path(out_dir) / "train_log.txt", "w")

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
    stream = token_stream(train_docs, tok).to(device)

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
    t_loop = time.perf_counter()
    t_log, tok_log = t_loop, 0
    first_step = 0.0  # seconds step 1 took (torch.compile's warm-up happens there)
    loss_acc, ce_acc, n_acc = torch.zeros((), device=device), torch.zeros((), device=device), 0
    last_eval: float | None = None
    select_rows = valid_rows if valid_rows is not None else held_rows
    select_name = "valid" if valid_rows is not None else "held-out"
    best: tuple[float, int, dict[str, Tensor]] | None = None
    while True:
        elapsed = time.perf_counter() - t_loop
        if (cfg.max_steps is not None and step >= cfg.max_steps) or elapsed >= cfg.seconds:
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
        if step == 1:
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
            history.append({"step": step, "seconds": round(now - t_loop, 2), "loss": avg_loss, "ce": avg_ce, "lr": lr,
                            "tokens_per_s": rate, "heldout_bpb": last_eval if step % cfg.eval_every == 0 else None})
    train_seconds = time.perf_counter() - t_loop
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
    summary = {
        "steps": step,
        "saved_step": saved_step,
        f"{select_name.replace('-', '')}_bits_per_byte": final_select,
        "tokens": tokens_seen,
        "train_seconds": round(train_seconds, 1),
        "total_seconds": round(time.perf_counter() - t_start, 1),
        "tokens_per_second": tokens_seen / max(train_seconds, 1e-9),
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
    emit(f"done: {step} steps, {tokens_seen / 1e6:.1f}M tokens in {train_seconds:.1f} s "
         f"({summary['tokens_per_second'] / 1e3:,.0f}k tok/s)")
    emit(f"saved weights: step {saved_step} ({'the best evaluation' if saved_step != step else 'the last step'}), "
         f"rounded to {cfg.save_dtype}: {select_name} {final_select:.3f} bits/byte")
    emit(f"held-out (last loop, {held_rows.shape[0]} x {cfg.seq_len} tokens{', bf16 autocast' if use_cuda else ''}): "
         f"{final_bpb:.3f} bits/byte (perplexity {2 ** final_bpb:.3f} per byte); unigram baseline {unigram:.3f} bits/byte")
    summary["history"] = history
    if out_dir is not None:
        out = Path(out_dir)
        model.to(save_dtype).save_pretrained(out)
        model.float()
        emit(f"saved: {out} ({(out / 'model.safetensors').stat().st_size / 2**20:.1f} MiB, {cfg.save_dtype} weights)")
        emit("summary: " + json.dumps({k: v for k, v in summary.items() if k != "history"}, sort_keys=True))
        log_file.close()
    return model, summary

