"""Training: the causal training forward equals the model's, a few steps reduce the loss, and the
saved checkpoint is a loadable HF-layout directory with its log and command."""

from __future__ import annotations

import json

import pytest
import torch

from flashloop_compile.models.ouro import OuroForCausalLM
from flashloop_compile.quality.train import TrainConfig, build_model, loop_logits, loss_fn, train

TINY = dict(layers=1, hidden=64, head_dim=32, seq_len=32, batch=8, warmup_steps=5, device="cpu", corpus_max_docs=20)


def test_training_forward_matches_model_forward():
    model = build_model(TrainConfig(**TINY)).eval()
    ids = torch.randint(0, 264, (2, 24), generator=torch.Generator().manual_seed(0))
    states, _ = model.forward_loops(ids)
    ours = loop_logits(model, ids)
    assert len(ours) == model.config.num_loops
    for got, st in zip(ours, states):
        torch.testing.assert_close(got, model.lm_head(st), rtol=1e-5, atol=1e-5)
    last_only = loop_logits(model, ids, all_loops=False)
    assert len(last_only) == 1
    torch.testing.assert_close(last_only[0], ours[-1])


def test_loss_is_last_loop_ce_plus_aux():
    model = build_model(TrainConfig(**TINY))
    batch = torch.randint(0, 264, (2, 17), generator=torch.Generator().manual_seed(1))
    plain, ce = loss_fn(model, batch, 0.0)
    torch.testing.assert_close(plain.detach(), ce)
    with_aux, ce2 = loss_fn(model, batch, 0.5)
    torch.testing.assert_close(ce, ce2)
    assert float(with_aux.detach()) > float(plain.detach())


def test_a_few_steps_reduce_the_loss_and_save_a_checkpoint(tmp_path):
    cfg = TrainConfig(**TINY, max_steps=40, seconds=120, log_every=5, eval_every=20, eval_batches=1, dropout=0.0)
    out = tmp_path / "ckpt"
    lines = []
    model, summary = train(cfg, out, command="flashloop-compile train (test)", log=lines.append)
    hist = summary["history"]
    assert summary["steps"] == 40 and hist[0]["step"] == 1 and hist[-1]["step"] == 40
    assert hist[-1]["ce"] < hist[0]["ce"] - 1.0, hist
    assert summary["heldout_bits_per_byte"] < 8.0 and summary["unigram_bits_per_byte"] < 6.0
    for name in ("config.json", "model.safetensors", "train_log.txt", "command.txt"):
        assert (out / name).is_file(), name
    assert (out / "command.txt").read_text().strip() == "flashloop-compile train (test)"
    log = (out / "train_log.txt").read_text()
    assert "unigram baseline" in log and "held-out" in log
    last = log.strip().splitlines()[-1]
    assert last.startswith("summary: ") and json.loads(last[len("summary: "):])["steps"] == 40
    stored = OuroForCausalLM.from_pretrained(out)
    assert stored.lm_head.weight.dtype == torch.bfloat16  # rounded for the checkpoint (10 MiB at full size)
    loaded = OuroForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert loaded.config.vocab_size == 264 and loaded.config.num_loops == 4
    for (k, a), (_, b) in zip(sorted(model.state_dict().items()), sorted(loaded.state_dict().items())):
        assert a.dtype == torch.float32 and torch.equal(a, b), k  # the returned model is the stored one


def test_model_config_checks_head_dim():
    with pytest.raises(ValueError, match="multiple of head_dim"):
        TrainConfig(hidden=100, head_dim=64).model_config()
    c = TrainConfig().model_config()
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim, c.intermediate_size) == (256, 6, 4, 64, 768)


def test_synthetic_retrieval_documents_make_up_the_asked_share_of_the_training_bytes():
    from flashloop_compile.quality.train import mix_retrieval_documents

    docs = [f"# doc {i}\n".encode() + b"x = 1\n" * (50 + i) for i in range(40)]
    assert mix_retrieval_documents(docs, 0.0, length=256) == docs
    mixed = mix_retrieval_documents(docs, 0.2, length=256, seed=1)
    synthetic = [d for d in mixed if b"needle_" in d]
    assert [d for d in mixed if b"needle_" not in d] == docs  # every document kept, in order
    share = sum(map(len, synthetic)) / sum(map(len, mixed))
    assert 0.2 <= share < 0.2 + 300 / sum(map(len, mixed))  # reached, by at most one more document
    assert all(len(d) <= 256 + 4 * 80 for d in synthetic)  # a training window's filler plus its needles
    assert mixed == mix_retrieval_documents(docs, 0.2, length=256, seed=1)
    with pytest.raises(ValueError, match=r"retrieval_fraction must lie in \[0, 1\)"):
        mix_retrieval_documents(docs, 1.0, length=256)
