"""The Ouro model: HF config and checkpoint compatibility, readouts, GQA, caches and ragged batches.

Tolerances: FP32 comparisons of two differently shaped computations (batched vs alone, cached vs
recomputed, chunked vs one-shot) use ATOL = RTOL = 1e-5 (logits are O(1)); comparisons of the same
computation on the same weights are exact.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from flashloop_compile.models.ouro import (
    PRESETS,
    ModelConfigError,
    OuroConfig,
    OuroForCausalLM,
    Readout,
    combine_readout,
    exit_probabilities,
)

ATOL = RTOL = 1e-5
TINY = PRESETS["tiny"]


def make_model(config: OuroConfig = TINY, seed: int = 0, dtype: torch.dtype = torch.float32) -> OuroForCausalLM:
    """A fresh random model the test may mutate (the session ``tiny_model`` must stay untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = OuroForCausalLM(config).init_random_()
    return model.to(dtype).eval()


def tokens(n: int, seed: int, vocab: int = TINY.vocab_size) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def hf_names(num_layers: int, tied: bool = False) -> set[str]:
    names = {"model.embed_tokens.weight", "model.norm.weight", "model.early_exit_gate.weight", "model.early_exit_gate.bias"}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        names |= {p + f"self_attn.{x}_proj.weight" for x in "qkvo"}
        names |= {p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")}
        names |= {
            p + f"{x}.weight"
            for x in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2")
        }
    if not tied:
        names.add("lm_head.weight")
    return names


HF_CONFIG = {
    # Fields an HF Ouro config.json carries that this implementation does not model: ignored.
    "architectures": ["OuroForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_ouro.OuroConfig", "AutoModelForCausalLM": "modeling_ouro.OuroForCausalLM"},
    "model_type": "ouro",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.55.0",
    "initializer_range": 0.02,
    "use_cache": True,
    "attention_dropout": 0.0,
    "sliding_window": 4096,
    "use_sliding_window": False,
    "max_window_layers": 2,
    "layer_types": ["full_attention", "full_attention"],
    "hidden_act": "silu",
    "rope_scaling": None,
    # Fields it does model.
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,  # deliberately != hidden_size / heads: head_dim must be read, not derived
    "max_position_embeddings": 128,
    "rope_theta": 5000.0,
    "rms_norm_eps": 1e-5,
    "total_ut_steps": 3,
    "early_exit_threshold": 1.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": [2],
}


# -- config ---------------------------------------------------------------------------------------


def test_from_dict_reads_hf_fields_and_ignores_unrelated_keys():
    cfg = OuroConfig.from_dict(HF_CONFIG)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (96, 32, 48)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 4, 2, 16)
    assert (cfg.max_position_embeddings, cfg.rope_theta, cfg.rms_norm_eps) == (128, 5000.0, 1e-5)
    assert (cfg.total_ut_steps, cfg.num_loops, cfg.early_exit_threshold, cfg.tie_word_embeddings) == (3, 3, 1.0, False)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)  # a one-element eos list is unwrapped
    assert OuroConfig.from_dict(cfg.to_dict()) == cfg
    assert OuroConfig.from_dict({**HF_CONFIG, "eos_token_id": [2, 7]}).eos_token_id == [2, 7]


def test_head_dim_defaults_to_hidden_over_heads():
    d = {k: v for k, v in HF_CONFIG.items() if k != "head_dim"}
    assert OuroConfig.from_dict(d).head_dim == 8
    assert OuroConfig.from_dict({**HF_CONFIG, "head_dim": None}).head_dim == 8


def test_null_num_key_value_heads_means_multi_head_attention():
    # HF's OuroConfig: "if num_key_value_heads is None: num_key_value_heads = num_attention_heads".
    cfg = OuroConfig.from_dict({**HF_CONFIG, "num_key_value_heads": None})
    assert cfg.num_key_value_heads == cfg.num_attention_heads == 4


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": 0}, r"hidden_size must be a positive integer"),
        ({"vocab_size": -1}, r"vocab_size must be a positive integer"),
        ({"intermediate_size": 0}, r"intermediate_size must be a positive integer"),
        ({"num_hidden_layers": 0}, r"num_hidden_layers must be a positive integer"),
        ({"num_hidden_layers": True}, r"num_hidden_layers must be a positive integer"),
        ({"num_attention_heads": 0}, r"num_attention_heads must be a positive integer"),
        ({"num_key_value_heads": -2}, r"num_key_value_heads must be a positive integer"),
        ({"head_dim": 0}, r"head_dim must be a positive integer"),
        ({"max_position_embeddings": 0}, r"max_position_embeddings must be a positive integer"),
        ({"total_ut_steps": 0}, r"total_ut_steps must be a positive integer"),
        ({"hidden_size": 32.0}, r"hidden_size must be a positive integer"),
        ({"num_key_value_heads": 3}, r"num_attention_heads=4 must be a multiple of num_key_value_heads=3"),
        ({"head_dim": 15}, r"head_dim must be even"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, r"rope_scaling=.* is not supported"),
        ({"use_sliding_window": True}, r"sliding-window attention is not supported"),
        ({"rope_theta": 0.0}, r"rope_theta must be positive"),
        ({"rms_norm_eps": 0.0}, r"rms_norm_eps must be positive"),
        ({"early_exit_threshold": 1.5}, r"early_exit_threshold must lie in \[0, 1\]"),
    ],
)
def test_invalid_config_values_are_clear_errors(change, message):
    with pytest.raises(ModelConfigError, match=message):
        OuroConfig.from_dict({**HF_CONFIG, **change})


# -- state dict and checkpoints --------------------------------------------------------------------


def test_state_dict_names_and_shapes_are_hf():
    cfg = OuroConfig.from_dict(HF_CONFIG)
    model = make_model(cfg)
    sd = model.state_dict()
    assert set(sd) == hf_names(2)
    h, hd, inter = 32, 16, 48
    assert sd["model.embed_tokens.weight"].shape == (96, h)
    assert sd["lm_head.weight"].shape == (96, h)
    assert sd["model.layers.1.self_attn.q_proj.weight"].shape == (4 * hd, h)
    assert sd["model.layers.1.self_attn.k_proj.weight"].shape == (2 * hd, h)
    assert sd["model.layers.1.self_attn.v_proj.weight"].shape == (2 * hd, h)
    assert sd["model.layers.1.self_attn.o_proj.weight"].shape == (h, 4 * hd)
    assert sd["model.layers.0.mlp.gate_proj.weight"].shape == (inter, h)
    assert sd["model.layers.0.mlp.down_proj.weight"].shape == (h, inter)
    assert sd["model.early_exit_gate.weight"].shape == (1, h)
    assert sd["model.early_exit_gate.bias"].shape == (1,)
    model.setup_caches(2, 64)
    assert model.cache_capacity == (2, 64)
    assert set(model.state_dict()) == hf_names(2)  # KV caches are not persistent state


def test_save_pretrained_round_trip_gives_identical_logits(tmp_path, tiny_model):
    tiny_model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == hf_names(TINY.num_hidden_layers)
    loaded = OuroForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config == tiny_model.config
    x = tokens(20, seed=1)[None]
    with torch.no_grad():
        for readout in (Readout(), Readout("weighted"), Readout.exit_at_step(2)):
            torch.testing.assert_close(loaded(x, readout=readout), tiny_model(x, readout=readout), rtol=0, atol=0)


def test_save_pretrained_shards_under_a_byte_limit_and_loads_back(tmp_path, tiny_model):
    """A checkpoint over one file's limit (the device tool returns files of at most 16 MiB) is
    written in HF's sharded layout; a later unsharded save into the same directory replaces it."""
    total = sum(v.numel() * v.element_size() for v in tiny_model.state_dict().values())
    limit = total // 3
    written = tiny_model.save_pretrained(tmp_path, max_shard_bytes=limit)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and not (tmp_path / "model.safetensors").exists()
    assert written == shards + [tmp_path / "model.safetensors.index.json"]
    biggest = max(v.numel() * v.element_size() for v in tiny_model.state_dict().values())
    for f in shards:
        with safe_open(str(f), "pt") as h:
            assert sum(h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in h.keys()) <= max(limit, biggest)
    loaded = OuroForCausalLM.from_pretrained(tmp_path).eval()
    x = tokens(20, seed=1)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), tiny_model(x), rtol=0, atol=0)
    assert tiny_model.save_pretrained(tmp_path, max_shard_bytes=total) == [tmp_path / "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_sharded_checkpoint_loads(tmp_path, tiny_model):
    sd = {k: v.contiguous() for k, v in tiny_model.state_dict().items()}
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2], "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(tmp_path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    total = sum(v.numel() * v.element_size() for v in sd.values())
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(tiny_model.config.to_dict()))
    loaded = OuroForCausalLM.from_pretrained(tmp_path).eval()
    x = tokens(17, seed=2)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), tiny_model(x), rtol=0, atol=0)


def _hand_written_state(cfg: OuroConfig, seed: int) -> dict[str, torch.Tensor]:
    """A checkpoint built from the HF names alone (no model involved)."""
    g = torch.Generator().manual_seed(seed)

    def mat(out_f, in_f):
        return torch.randn(out_f, in_f, generator=g) * in_f**-0.5

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    h, hd, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    sd = {
        "model.embed_tokens.weight": torch.randn(cfg.vocab_size, h, generator=g),
        "model.norm.weight": norm(h),
        "model.early_exit_gate.weight": mat(1, h),
        "model.early_exit_gate.bias": torch.randn(1, generator=g),
        "lm_head.weight": mat(cfg.vocab_size, h),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = mat(cfg.num_attention_heads * hd, h)
        sd[p + "self_attn.k_proj.weight"] = mat(cfg.num_key_value_heads * hd, h)
        sd[p + "self_attn.v_proj.weight"] = mat(cfg.num_key_value_heads * hd, h)
        sd[p + "self_attn.o_proj.weight"] = mat(h, cfg.num_attention_heads * hd)
        sd[p + "mlp.gate_proj.weight"] = mat(inter, h)
        sd[p + "mlp.up_proj.weight"] = mat(inter, h)
        sd[p + "mlp.down_proj.weight"] = mat(h, inter)
        for n in ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2"):
            sd[p + n + ".weight"] = norm(h)
    return sd


@torch.no_grad()
def _assign_by_attribute(model: OuroForCausalLM, sd: dict[str, torch.Tensor]) -> None:
    """Put the weights in place through module attributes, not through load_state_dict's names."""
    m = model.model
    m.embed_tokens.weight.copy_(sd["model.embed_tokens.weight"])
    m.norm.weight.copy_(sd["model.norm.weight"])
    m.early_exit_gate.weight.copy_(sd["model.early_exit_gate.weight"])
    m.early_exit_gate.bias.copy_(sd["model.early_exit_gate.bias"])
    model.lm_head.weight.copy_(sd["lm_head.weight"])
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        layer.self_attn.q_proj.weight.copy_(sd[p + "self_attn.q_proj.weight"])
        layer.self_attn.k_proj.weight.copy_(sd[p + "self_attn.k_proj.weight"])
        layer.self_attn.v_proj.weight.copy_(sd[p + "self_attn.v_proj.weight"])
        layer.self_attn.o_proj.weight.copy_(sd[p + "self_attn.o_proj.weight"])
        layer.mlp.gate_proj.weight.copy_(sd[p + "mlp.gate_proj.weight"])
        layer.mlp.up_proj.weight.copy_(sd[p + "mlp.up_proj.weight"])
        layer.mlp.down_proj.weight.copy_(sd[p + "mlp.down_proj.weight"])
        layer.input_layernorm.weight.copy_(sd[p + "input_layernorm.weight"])
        layer.input_layernorm_2.weight.copy_(sd[p + "input_layernorm_2.weight"])
        layer.post_attention_layernorm.weight.copy_(sd[p + "post_attention_layernorm.weight"])
        layer.post_attention_layernorm_2.weight.copy_(sd[p + "post_attention_layernorm_2.weight"])


def test_hand_written_hf_checkpoint_loads_with_identical_logits(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    cfg = OuroConfig.from_dict(HF_CONFIG)
    sd = _hand_written_state(cfg, seed=3)
    save_file(sd, str(tmp_path / "model.safetensors"))
    loaded = OuroForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config == cfg

    expected = OuroForCausalLM(cfg).eval()
    _assign_by_attribute(expected, sd)
    x = tokens(21, seed=4, vocab=96)[None]
    with torch.no_grad():
        for readout in (Readout(), Readout.exit_at_step(1), Readout("weighted"), Readout.at_threshold(0.5)):
            torch.testing.assert_close(loaded(x, readout=readout), expected(x, readout=readout), rtol=0, atol=0)
        # The loaded weights matter: a different checkpoint gives different logits.
        other = OuroForCausalLM(cfg).eval()
        _assign_by_attribute(other, _hand_written_state(cfg, seed=5))
        assert not torch.allclose(loaded(x), other(x), atol=1e-2)


def test_missing_and_unexpected_keys_are_clear_errors(tmp_path, tiny_model):
    sd = {k: v.contiguous() for k, v in tiny_model.state_dict().items()}
    (tmp_path / "config.json").write_text(json.dumps(tiny_model.config.to_dict()))

    missing = dict(sd)
    del missing["model.layers.1.mlp.up_proj.weight"]
    save_file(missing, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelConfigError, match=r"missing \['model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        OuroForCausalLM.from_pretrained(tmp_path)

    extra = {**sd, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelConfigError, match=r"unexpected \['model\.layers\.0\.self_attn\.rotary_emb\.inv_freq'\]"):
        OuroForCausalLM.from_pretrained(tmp_path)

    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        OuroForCausalLM.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        OuroForCausalLM.from_pretrained(tmp_path / "nowhere")


def test_from_pretrained_bfloat16(tmp_path, tiny_model):
    tiny_model.save_pretrained(tmp_path)
    model = OuroForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    for name, p in model.state_dict().items():
        assert torch.equal(p, tiny_model.state_dict()[name].to(torch.bfloat16)), name
    with torch.no_grad():
        logits = model(tokens(12, seed=6)[None])
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


def test_tied_word_embeddings(tmp_path):
    cfg = dataclasses.replace(TINY, tie_word_embeddings=True)
    model = make_model(cfg, seed=7)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    x = tokens(10, seed=8)[None]
    with torch.no_grad():
        states, _ = model.forward_loops(x)
        logits = model(x)
    torch.testing.assert_close(logits, states[-1] @ model.model.embed_tokens.weight.T, atol=ATOL, rtol=RTOL)

    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == hf_names(cfg.num_hidden_layers, tied=True)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is True
    loaded = OuroForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert set(loaded.state_dict()) >= hf_names(cfg.num_hidden_layers, tied=True)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), logits, rtol=0, atol=0)
    loaded_bf16 = OuroForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert loaded_bf16.lm_head.weight is loaded_bf16.model.embed_tokens.weight
    assert loaded_bf16.lm_head.weight.dtype == torch.bfloat16


# -- readouts --------------------------------------------------------------------------------------


def test_last_readout_is_lm_head_of_the_last_loop(tiny_model):
    x = torch.stack([tokens(15, seed=9), tokens(15, seed=10)])
    with torch.no_grad():
        states, gates = tiny_model.forward_loops(x)
        logits = tiny_model(x)
    assert len(states) == TINY.total_ut_steps and gates == []
    assert logits.shape == (2, 15, TINY.vocab_size)
    torch.testing.assert_close(logits, tiny_model.lm_head(states[-1]), rtol=0, atol=0)
    # The loops are real: every loop changes the state.
    for a, b in zip(states, states[1:]):
        assert not torch.allclose(a, b, atol=1e-3)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_exit_at_step_equals_a_model_with_k_loops(tiny_model, k):
    shorter = OuroForCausalLM(dataclasses.replace(TINY, total_ut_steps=k)).eval()
    shorter.load_state_dict(tiny_model.state_dict())
    x = tokens(19, seed=11)[None]
    with torch.no_grad():
        got = tiny_model(x, readout=Readout.exit_at_step(k))
        torch.testing.assert_close(got, shorter(x), rtol=0, atol=0)
        states, _ = tiny_model.forward_loops(x)
        torch.testing.assert_close(got, tiny_model.lm_head(states[k - 1]), rtol=0, atol=0)
        if k < 4:
            assert not torch.allclose(got, tiny_model.lm_head(states[k]), atol=1e-3)


@pytest.mark.parametrize("k", [0, 5, None])
def test_exit_at_step_out_of_range(tiny_model, k):
    with pytest.raises(ValueError, match="exit_at_step must be in 1..4"):
        tiny_model(tokens(4, seed=0)[None], readout=Readout("step", step=k))


def _gate_model(bias: float, seed: int = 12) -> OuroForCausalLM:
    """Constant gate: weight 0, so lambda = sigmoid(bias) at every loop and token."""
    model = make_model(seed=seed)
    with torch.no_grad():
        model.model.early_exit_gate.weight.zero_()
        model.model.early_exit_gate.bias.fill_(bias)
    return model


def test_threshold_with_certain_exits():
    x = tokens(11, seed=13)[None]
    early, late = _gate_model(20.0), _gate_model(-20.0)  # lambda ~ 1: exit at loop 1; lambda ~ 0: at loop 4
    with torch.no_grad():
        for model, loop in ((early, 0), (late, 3)):
            states, _ = model.forward_loops(x)
            got = model(x, readout=Readout.at_threshold(0.5))
            torch.testing.assert_close(got, model.lm_head(states[loop]), rtol=0, atol=0)
        # lambda = 1/2 exactly: the cumulative sums 0.5, 0.75, 0.875, 1 are exact, and a loop whose
        # sum equals tau "reaches" it.
        half = _gate_model(0.0)
        states, _ = half.forward_loops(x)
        for tau, loop in ((0.5, 0), (0.75, 1), (0.8, 2), (0.875, 2), (0.9, 3)):
            got = half(x, readout=Readout.at_threshold(tau))
            torch.testing.assert_close(got, half.lm_head(states[loop]), rtol=0, atol=0)
        # tau = 0 is reached at the first loop whatever the gate.
        states, _ = late.forward_loops(x)
        torch.testing.assert_close(late(x, readout=Readout.at_threshold(0.0)), late.lm_head(states[0]), rtol=0, atol=0)


def test_threshold_cumulative_sum_is_fp32_not_bf16():
    # lambda = 0.999 at every loop gives p = [0.999, 0.000999, 1e-6, 1e-9] and the FP32 cumulative
    # sum [0.999, 0.999999, ...]; tau = 0.9999 is first reached at loop 2. In BF16 (8 significant
    # bits: the spacing just below 1 is 2**-8 = 0.0039) 0.999 already rounds to 1.0, so a BF16
    # summation would exit at loop 1.
    tau = 0.9999
    bias = math.log(0.999 / 0.001)
    p = exit_probabilities([torch.full((1,), bias)] * 4)
    assert p.dtype == torch.float32
    assert torch.cumsum(p.to(torch.bfloat16), -1)[0, 0] >= tau  # the BF16 sum would exit at loop 1
    assert torch.cumsum(p, -1)[0, 0] < tau <= torch.cumsum(p, -1)[0, 1]

    model = _gate_model(bias)
    x = tokens(9, seed=14)[None]
    with torch.no_grad():
        states, _ = model.forward_loops(x)
        got = model(x, readout=Readout.at_threshold(tau))
    torch.testing.assert_close(got, model.lm_head(states[1]), rtol=0, atol=0)

    # BF16 gate logits and loop logits: the sum is still FP32 (the gate logit rounds to 6.90625
    # in BF16, lambda ~ 0.998999, the conclusion is unchanged).
    loop_logits = [torch.full((3, 5), float(t), dtype=torch.bfloat16) for t in range(4)]
    gates = [torch.full((3, 1), bias, dtype=torch.bfloat16)] * 4
    out = combine_readout(loop_logits, gates, Readout.at_threshold(tau))
    assert out.dtype == torch.bfloat16 and torch.equal(out, loop_logits[1])


def _exit_probs_f64(gates: list[torch.Tensor]) -> torch.Tensor:
    """p_t = lambda_t prod_{j<t} (1 - lambda_j), last loop the remainder, in float64, loop by loop."""
    lam = [torch.sigmoid(g.double()) for g in gates]
    survive = torch.ones_like(lam[0])
    ps = []
    for t, l in enumerate(lam):
        ps.append(survive.clone() if t == len(lam) - 1 else l * survive)
        survive = survive * (1 - l)
    return torch.stack(ps, dim=-1)


@pytest.mark.parametrize("tau", [0.3, 0.6, 0.9])
def test_threshold_matches_independent_rule(tiny_model, tau):
    x = torch.stack([tokens(24, seed=15), tokens(24, seed=16)])
    with torch.no_grad():
        states, gates = tiny_model.forward_loops(x, readout=Readout("weighted"))
        got = tiny_model(x, readout=Readout.at_threshold(tau))
    p = _exit_probs_f64([g[..., 0] for g in gates])  # [B, T, R]
    cdf = torch.cumsum(p, -1)
    # Precondition: no cumulative sum lies within FP32 round-off of tau, so the rule decides alone.
    assert (cdf - tau).abs().min() > 1e-5
    exit_idx = torch.where(cdf >= tau, torch.arange(4), 4).amin(-1).clamp(max=3)  # [B, T]
    assert len(exit_idx.unique()) >= 2, "the case should exercise several exit loops"
    loop_logits = torch.stack([tiny_model.lm_head(s) for s in states], dim=2)  # [B, T, R, V]
    expected = torch.take_along_dim(loop_logits, exit_idx[..., None, None], dim=2)[:, :, 0]
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_weighted_readout_is_expected_logits(tiny_model):
    x = tokens(23, seed=17)[None]
    with torch.no_grad():
        states, gates = tiny_model.forward_loops(x, readout=Readout("weighted"))
        got = tiny_model(x, readout=Readout("weighted"))
    assert len(gates) == 4 and gates[0].shape == (1, 23, 1)
    p = _exit_probs_f64([g[..., 0] for g in gates])
    assert (p.std(-1) > 0.01).all(), "the gates should spread the probability over loops"
    expected = sum(p[..., t, None] * tiny_model.lm_head(states[t]).double() for t in range(4))
    torch.testing.assert_close(got.double(), expected, atol=ATOL, rtol=RTOL)


def test_exit_probabilities():
    p = exit_probabilities([torch.zeros(1)] * 4)  # lambda = 0.5
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.25, 0.125, 0.125]]), rtol=0, atol=0)
    g = torch.Generator().manual_seed(18)
    gates = [torch.randn(7, 5, generator=g) * 4 for _ in range(4)] + [torch.tensor([[30.0] * 5] * 7)]
    gates[0][0, 0], gates[1][0, 1] = -40.0, 40.0
    p = exit_probabilities(gates)
    assert p.shape == (7, 5, 5) and p.dtype == torch.float32 and (p >= 0).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(7, 5), atol=1e-6, rtol=0)
    torch.testing.assert_close(p.double(), _exit_probs_f64(gates), atol=1e-7, rtol=1e-6)
    pb = exit_probabilities([x.to(torch.bfloat16) for x in gates])
    assert pb.dtype == torch.float32
    torch.testing.assert_close(pb.sum(-1), torch.ones(7, 5), atol=1e-6, rtol=0)


def test_bad_threshold(tiny_model):
    with pytest.raises(ValueError, match="tau in"):
        tiny_model(tokens(4, seed=0)[None], readout=Readout.at_threshold(1.5))


# -- grouped-query attention -----------------------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_gqa_equals_mha_with_repeated_kv_heads(kv_heads):
    gqa_cfg = dataclasses.replace(TINY, num_key_value_heads=kv_heads)
    gqa = make_model(gqa_cfg, seed=19)
    mha = OuroForCausalLM(TINY).eval()
    group, hd = TINY.num_attention_heads // kv_heads, TINY.head_dim
    sd = {}
    for k, v in gqa.state_dict().items():
        if k.endswith(("k_proj.weight", "v_proj.weight")):
            # query head h uses kv head h // group (HF repeat_kv)
            v = v.view(kv_heads, hd, -1).repeat_interleave(group, dim=0).reshape(-1, v.shape[-1])
        sd[k] = v
    mha.load_state_dict(sd)
    x = tokens(16, seed=20)[None]
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), atol=ATOL, rtol=RTOL)


def test_gqa_prefill_and_decode_with_cache_equals_full():
    model = make_model(dataclasses.replace(TINY, num_key_value_heads=2), seed=21)
    seq = tokens(18, seed=22)[None]
    with torch.no_grad():
        full = model(seq)
        model.setup_caches(1, 32)
        pre = model(seq[:, :14], torch.arange(14))
        steps = [model(seq[:, t : t + 1], torch.tensor([[t]])) for t in range(14, 18)]
    torch.testing.assert_close(pre, full[:, :14], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 14:], atol=ATOL, rtol=RTOL)


# -- caches and ragged batches ---------------------------------------------------------------------


LENGTHS = (5, 9, 13)
PAD = 0


def _ragged(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and per-row positions (padding continues the row's positions)."""
    t = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), t), PAD)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = p
    return ids, torch.arange(t)[None].expand(len(prompts), -1).clone()


@pytest.mark.parametrize("readout", [Readout(), Readout("weighted"), Readout.exit_at_step(2)], ids=["last", "weighted", "step2"])
def test_ragged_batch_rows_equal_each_prompt_alone(readout):
    model = make_model(seed=23)
    reference = copy.deepcopy(model)  # no caches: full recompute
    prompts = [tokens(n, seed=30 + n) for n in LENGTHS]
    lengths = torch.tensor(LENGTHS)
    ids, pos = _ragged(prompts)
    n_steps = 4
    with torch.no_grad():
        model.setup_caches(max_batch=4, max_seq=32)
        logits = model(ids, pos, readout=readout)
        last = model(ids, pos, readout=readout, logits_index=(lengths - 1)[:, None])
        seqs = [p.clone() for p in prompts]
        for b, p in enumerate(prompts):
            alone = reference(p[None], readout=readout)[0]
            torch.testing.assert_close(logits[b, : len(p)], alone, atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(last[b, 0], alone[-1], atol=ATOL, rtol=RTOL)
        nxt = last[:, 0].argmax(-1)
        for step in range(n_steps):
            step_pos = (lengths + step)[:, None]  # a different position in every row
            out = model(nxt[:, None], step_pos, readout=readout)
            assert out.shape == (3, 1, TINY.vocab_size)
            for b in range(3):
                seqs[b] = torch.cat([seqs[b], nxt[b : b + 1]])
                alone = reference(seqs[b][None], readout=readout)[0, -1]
                torch.testing.assert_close(out[b, 0], alone, atol=ATOL, rtol=RTOL)
            nxt = out[:, 0].argmax(-1)


def test_prefill_then_decode_equals_full_recompute(tiny_model):
    model = copy.deepcopy(tiny_model)
    seq = torch.stack([tokens(24, seed=40), tokens(24, seed=41)])
    with torch.no_grad():
        full = model(seq)
        model.setup_caches(2, 64)
        pre = model(seq[:, :16], torch.arange(16))
        one = model(seq[:, 16:17], torch.tensor([[16], [16]]))
        two = model(seq[:, 17:19], torch.tensor([17, 18]))  # two query rows, shared [T] positions
        rest = model(seq[:, 19:], torch.arange(19, 24)[None].expand(2, -1))
    got = torch.cat([pre, one, two, rest], dim=1)
    torch.testing.assert_close(got, full, atol=ATOL, rtol=RTOL)


def test_chunked_prefill_equals_one_shot(tiny_model):
    model = copy.deepcopy(tiny_model)
    seq = tokens(29, seed=42)[None]
    with torch.no_grad():
        model.setup_caches(1, 32)
        one_shot = model(seq, torch.arange(29))
        model.setup_caches(1, 32)  # fresh caches
        chunks = [model(seq[:, a:b], torch.arange(a, b)) for a, b in ((0, 7), (7, 8), (8, 20), (20, 29))]
    torch.testing.assert_close(torch.cat(chunks, 1), one_shot, atol=ATOL, rtol=RTOL)


def test_input_errors(tiny_model):
    model = copy.deepcopy(tiny_model)
    ids = tokens(6, seed=43)[None]
    with pytest.raises(ValueError, match=r"input_pos must be \[batch, tokens\] = \(1, 6\)"):
        model(ids, torch.arange(7)[None])
    with pytest.raises(ValueError, match=r"input_pos must be \[batch, tokens\] = \(1, 6\)"):
        model(ids, torch.arange(6)[None].expand(2, -1))
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, tokens\]"):
        model(ids[0])
    model.setup_caches(max_batch=2, max_seq=16)
    with pytest.raises(ValueError, match=r"batch 3 exceeds the cache's max_batch=2"):
        model(ids.expand(3, -1), torch.arange(6))
    with pytest.raises(ValueError, match=r"max_seq=1025 exceeds max_position_embeddings=1024"):
        model.setup_caches(max_batch=1, max_seq=TINY.max_position_embeddings + 1)
    model.setup_caches(max_batch=1, max_seq=TINY.max_position_embeddings)  # the limit itself is fine
    assert model.cache_capacity == (1, TINY.max_position_embeddings)


def test_a_checkpoint_of_another_model_type_is_refused_naming_the_file(tmp_path, tiny_model):
    tiny_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ModelConfigError, match=r"config\.json: model_type='gpt2' is not supported: expected model_type 'ouro'"):
        OuroForCausalLM.from_pretrained(tmp_path)


def test_corrupted_checkpoint_files_are_errors_naming_the_file(tmp_path, tiny_model):
    tiny_model.save_pretrained(tmp_path)
    weights = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(ModelConfigError, match=r"model\.safetensors is not a readable safetensors file"):
        OuroForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(weights)
    (tmp_path / "config.json").write_text('{"hidden_size": 128,')
    with pytest.raises(ModelConfigError, match=r"config\.json is not valid JSON"):
        OuroForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match=r"config\.json holds list"):
        OuroForCausalLM.from_pretrained(tmp_path)


def test_from_preset_takes_config_overrides_and_names_unknown_fields():
    model = OuroForCausalLM.from_preset("tiny", num_hidden_layers=1, total_ut_steps=3)
    assert (model.config.num_hidden_layers, model.config.num_loops) == (1, 3)
    assert model.config.hidden_size == TINY.hidden_size  # the rest of the preset kept
    with pytest.raises(ModelConfigError, match=r"unknown OuroConfig fields \['layers'\]"):
        OuroForCausalLM.from_preset("tiny", layers=1)
