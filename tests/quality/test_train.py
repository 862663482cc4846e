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


# -- resumable training: N steps in one run vs N/2, stop, resume -----------------------------------------

RESUMABLE = dict(TINY, max_steps=12, seconds=120, log_every=1, eval_every=3, eval_batches=1, resumable=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One uninterrupted 12-step run, and the same run stopped after 6 steps and resumed (with
    another wall budget: a resume may change it). Warm-up is 5 steps, so the resume is past it."""
    root = tmp_path_factory.mktemp("resume")
    _, full = train(TrainConfig(**RESUMABLE), root / "full", log=lambda m: None)
    _, first = train(TrainConfig(**RESUMABLE, call_steps=6), root / "first", log=lambda m: None)
    _, rest = train(TrainConfig(**dict(RESUMABLE, seconds=100)), root / "rest", log=lambda m: None, resume=root / "first")
    return root, full, first, rest


def test_resumed_run_continues_the_uninterrupted_one(runs):
    from flashloop_compile.quality.train import load_train_state

    root, full, first, rest = runs
    assert (first["steps"], rest["steps"], full["steps"]) == (6, 12, 12)
    assert rest["tokens"] == full["tokens"] and rest["resumed_at_step"] == 6 and rest["finished"] and not first["finished"]
    split = first["history"] + rest["history"]
    assert [h["step"] for h in split] == [h["step"] for h in full["history"]] == list(range(1, 13))
    # the same batches at every step (the sampler's generator state was carried) ...
    assert [h["batch_digest"] for h in split] == [h["batch_digest"] for h in full["history"]]
    # ... the same losses up to the stop, and close after it: the resume read weights and moments back from BF16
    assert [h["loss"] for h in first["history"]] == [h["loss"] for h in full["history"][:6]]
    for a, b in zip(rest["history"], full["history"][6:]):
        assert abs(a["loss"] - b["loss"]) < 0.02, (a, b)
    s_full, t_full = load_train_state(root / "full")
    s_rest, t_rest = load_train_state(root / "rest")
    assert s_rest["rng"]["batch_generator"] == s_full["rng"]["batch_generator"]  # the same number of draws
    assert s_rest["rng"]["torch"] == s_full["rng"]["torch"]  # dropout's generator too
    assert s_rest["calls"] == 2 and s_rest["step"] == 12 and s_rest["schedule"]["progress"] == 1.0
    weights = [k for k in t_full if k.startswith("weights/")]
    diff = sum(float((t_full[k].float() - t_rest[k].float()).norm()) ** 2 for k in weights) ** 0.5
    norm = sum(float(t_full[k].float().norm()) ** 2 for k in weights) ** 0.5
    assert diff / norm < 5e-3  # measured 1.4e-3: a few BF16 ulps (2**-8 relative) after 6 more steps
    # the log continues the first call's
    log = (root / "rest" / "train_log.txt").read_text()
    assert log.startswith((root / "first" / "train_log.txt").read_text()) and "=== resumed from" in log
    assert (root / "rest" / "train_log.txt").read_text().strip().splitlines()[-1].startswith("summary: ")


def test_resume_continues_the_schedule_without_a_second_warmup(runs):
    _, full, first, rest = runs
    lrs_full = [h["lr"] for h in full["history"]]
    assert [h["lr"] for h in first["history"] + rest["history"]] == lrs_full  # the schedule is a function of the step
    assert rest["history"][0]["lr"] == lrs_full[6]  # the first resumed step: what the uninterrupted run had
    # step 6 of 12 is half way down the cosine; a second warm-up would start again at lr / warmup_steps
    lr, min_ratio = TrainConfig().lr, TrainConfig().min_lr_ratio
    assert rest["history"][0]["lr"] == pytest.approx(lr * (min_ratio + (1 - min_ratio) * 0.5)) and lrs_full[0] == lr / 5
    assert lrs_full[-1] < lrs_full[6]  # cosine over max_steps


def test_resume_carries_the_best_weights(runs):
    from flashloop_compile.quality.train import load_train_state

    root, _, first, rest = runs
    s_first, _ = load_train_state(root / "first")
    s_rest, _ = load_train_state(root / "rest")
    # the resumed run's selection starts from the carried best, so it can only improve (up to BF16 rounding)
    assert s_rest["best"]["bits_per_byte"] <= s_first["best"]["bits_per_byte"] + 0.01
    assert s_rest["best"]["bits_per_byte"] == pytest.approx(rest["valid_bits_per_byte"])


def test_resume_refuses_changed_options(runs, tmp_path):
    root = runs[0]
    with pytest.raises(ValueError, match=r"options differ from the saved run's \(hidden: saved 64, given 96\)"):
        train(TrainConfig(**dict(RESUMABLE, hidden=96)), tmp_path / "x", log=lambda m: None, resume=root / "first")
    with pytest.raises(ValueError, match=r"max_steps: saved 12, given 20.*may change only seconds"):
        train(TrainConfig(**dict(RESUMABLE, max_steps=20)), tmp_path / "x", log=lambda m: None, resume=root / "first")
    with pytest.raises(FileNotFoundError, match="needs the output directory of a --resumable run"):
        train(TrainConfig(**RESUMABLE), tmp_path / "x", log=lambda m: None, resume=tmp_path)
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_resumable_runs_need_max_steps():
    with pytest.raises(ValueError, match="resumable training needs max_steps"):
        train(TrainConfig(**TINY, resumable=True), None, log=lambda m: None)


def test_state_shards_stay_under_the_limit_and_the_cap_is_checked(runs, tmp_path):
    from flashloop_compile.quality.train import SHARD_BYTES, count_parameters, load_train_state, save_train_state, state_bytes

    root = runs[0]
    state, tensors = load_train_state(root / "rest")
    assert state["shards"] == ["train_state-00001.safetensors"]
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    assert all((root / "rest" / f).stat().st_size <= SHARD_BYTES for f in state["shards"])
    # the estimate the cap is checked against covers what is written
    written = sum((root / "rest" / f).stat().st_size for f in state["shards"]) + (root / "rest" / "model.safetensors").stat().st_size
    assert written <= state_bytes(TrainConfig(**RESUMABLE)) < written + 64 * 1024
    assert count_parameters(TrainConfig(**RESUMABLE)) * 8 < written
    # shards of at most 100 KiB: several files, each under the limit, read back unchanged
    limit = 100 * 1024
    files = save_train_state(tmp_path / "small", {"step": 1}, tensors, shard_bytes=limit)
    shards = [f for f in files if f.suffix == ".safetensors"]
    assert len(shards) >= 5 and all(f.stat().st_size <= limit for f in shards)
    _, back = load_train_state(tmp_path / "small")
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    # fewer shards on a rewrite: the stale ones are removed
    save_train_state(tmp_path / "small", {"step": 2}, tensors, shard_bytes=4 * limit)
    assert sorted(p.name for p in (tmp_path / "small").glob("train_state-*")) == [f"train_state-0000{i}.safetensors" for i in (1, 2)]
    # a state over the cap is refused before training, with the sizes that fit
    with pytest.raises(ValueError, match=r"over state_cap_mib=0.1 \(--state-cap-mib.*About 0.01 M parameters fit"):
        train(TrainConfig(**dict(RESUMABLE, state_cap_mib=0.1)), tmp_path / "capped", log=lambda m: None)
    assert not (tmp_path / "capped").exists()


def test_the_default_shape_fits_the_default_cap_in_three_shards():
    from flashloop_compile.quality.train import SHARD_BYTES, STATE_CAP_MIB, count_parameters, state_bytes

    cfg = TrainConfig(resumable=True, max_steps=1000)
    assert count_parameters(cfg) == 5_253_633
    assert state_bytes(cfg) <= STATE_CAP_MIB * 2**20  # 40.1 MiB
    # weights, exp_avg and exp_avg_sq: 3 x 10.0 MiB in 15 MiB shards -> 3 files (+ 5 = the 8 a device call returns)
    assert 2 * SHARD_BYTES < 3 * 2 * count_parameters(cfg) <= 3 * SHARD_BYTES
    assert state_bytes(TrainConfig(layers=7)) <= STATE_CAP_MIB * 2**20 < state_bytes(TrainConfig(layers=8))
