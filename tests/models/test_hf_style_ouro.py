"""The HF-style Ouro test model (tests/models/hf_style_ouro.py) against flashloop_compile's Ouro.

The HF-style model is an independent implementation whose Dynamo graphs the backend must also
recognize; these tests pin that it computes the same function as our model (same weights), that
its cache / mask / variant switches behave, and that every variant traces with fullgraph=True.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from flashloop_compile.models.ouro import PRESETS, OuroConfig, Readout
from flashloop_compile.models.ouro import OuroForCausalLM as FlashLoopOuro

from .hf_style_ouro import (
    HFStyleOuroConfig,
    LlamaStyleForCausalLM,
    LoopedDynamicCache,
    OuroForCausalLM,
    apply_rotary_pos_emb,
    prepare_4d_causal_attention_mask_with_cache_position,
    repeat_kv,
)

ATOL = RTOL = 1e-5
IMPLS = ["eager", "sdpa"]
VOCAB = PRESETS["tiny"].vocab_size


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL)


def flashloop_model(config: OuroConfig, seed: int = 0) -> FlashLoopOuro:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FlashLoopOuro(config).init_random_()
    return model.eval()


@pytest.fixture(scope="module")
def ours() -> FlashLoopOuro:
    return FlashLoopOuro.from_preset("tiny", dtype=torch.float32, seed=0).eval()


@pytest.fixture(scope="module")
def ours_gqa() -> FlashLoopOuro:
    return flashloop_model(dataclasses.replace(PRESETS["tiny"], num_attention_heads=4, num_key_value_heads=2), seed=1)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, VOCAB, (2, 12), generator=g)


def run_cached(model, ids: torch.Tensor, prefill: int, chunks=(1, 1, 1)):
    """Prefill ``prefill`` tokens, then feed ``chunks`` (token counts); the logits of every step, concatenated."""
    cache = LoopedDynamicCache()
    out = model(ids[:, :prefill], past_key_values=cache, use_cache=True)
    assert out.past_key_values is cache
    logits, pos = [out.logits], prefill
    for n in chunks:
        out = model(ids[:, pos : pos + n], past_key_values=cache, use_cache=True)
        logits.append(out.logits)
        pos += n
    return torch.cat(logits, dim=1), cache


# -------------------------------------------------------------------------------------------------
# Structure
# -------------------------------------------------------------------------------------------------
def test_state_dict_keys_identical(ours):
    hf = OuroForCausalLM(ours.config)
    assert list(hf.state_dict().keys()) == list(ours.state_dict().keys())
    assert {k: v.shape for k, v in hf.state_dict().items()} == {k: v.shape for k, v in ours.state_dict().items()}


def test_config_from_ouro_config(ours):
    cfg = HFStyleOuroConfig.from_ouro_config(ours.config, attn_implementation="sdpa")
    assert cfg._attn_implementation == "sdpa"
    assert (cfg.num_hidden_layers, cfg.total_ut_steps, cfg.head_dim) == (2, 4, 64)
    assert cfg.sliding_window is None and cfg.position_embedding_type == "rope"
    with pytest.raises(ValueError):
        HFStyleOuroConfig(attn_implementation="flash_attention_2")


def test_helpers():
    x = torch.randn(2, 2, 5, 8)
    torch.testing.assert_close(repeat_kv(x, 3), torch.repeat_interleave(x, 3, dim=1))
    assert repeat_kv(x, 1) is x
    cos, sin = torch.ones(2, 5, 8), torch.zeros(2, 5, 8)
    q, k = apply_rotary_pos_emb(x, x, cos, sin)
    torch.testing.assert_close(q, x)
    # cache_position 3..4 against 5 keys: query 3 sees keys 0..3, query 4 sees 0..4.
    m = prepare_4d_causal_attention_mask_with_cache_position(
        None, 2, 5, torch.float32, torch.device("cpu"), torch.arange(3, 5), batch_size=1
    )
    assert m.shape == (1, 1, 2, 5)
    assert (m == 0).tolist() == [[[[True, True, True, True, False], [True, True, True, True, True]]]]
    assert m.min().item() == torch.finfo(torch.float32).min
    w = prepare_4d_causal_attention_mask_with_cache_position(
        None, 2, 5, torch.float32, torch.device("cpu"), torch.arange(3, 5), batch_size=1, sliding_window=2
    )
    assert (w == 0).tolist() == [[[[False, False, True, True, False], [False, False, False, True, True]]]]


def test_cache_indexing():
    cache = LoopedDynamicCache()
    assert cache.get_seq_length() == 0
    k = torch.randn(1, 2, 3, 4)
    kk, vv = cache.update(k, k + 1, 5)
    assert len(cache) == 6 and cache.key_cache[0] is None and kk is k
    assert cache.get_seq_length(5) == 3 and cache.get_seq_length() == 0
    kk, vv = cache.update(k[:, :, :1], k[:, :, :1], 5)
    assert kk.shape == (1, 2, 4, 4)
    torch.testing.assert_close(kk[:, :, 3:], k[:, :, :1])


# -------------------------------------------------------------------------------------------------
# Equivalence with flashloop_compile's Ouro
# -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("impl", IMPLS)
def test_prompt_without_cache_matches(ours, ids, impl):
    hf = OuroForCausalLM.from_flashloop(ours, attn_implementation=impl)
    with torch.no_grad():
        out = hf(ids)
        ref = ours(ids)
        ref_states, ref_gates = ours.forward_loops(ids, readout=Readout("weighted"))
    assert out.logits.shape == (2, 12, VOCAB) and out.past_key_values is None
    close(out.logits, ref)
    assert len(out.hidden_states_list) == len(out.gate_list) == 4
    for a, b in zip(out.hidden_states_list, ref_states):
        close(a, b)
    for a, b in zip(out.gate_list, ref_gates):
        close(a, b)
    close(hf(ids[:1]).logits, ref[:1])  # batch of one too


@pytest.mark.parametrize("impl", IMPLS)
def test_prefill_and_decode_match(ours, ids, impl):
    hf = OuroForCausalLM.from_flashloop(ours, attn_implementation=impl)
    with torch.no_grad():
        ref = ours(ids)
        logits, cache = run_cached(hf, ids, prefill=9, chunks=(1, 1, 1))
    close(logits, ref)
    cfg = hf.config
    assert len(cache) == cfg.total_ut_steps * cfg.num_hidden_layers
    assert all(k.shape == (2, cfg.num_key_value_heads, 12, cfg.head_dim) for k in cache.key_cache)
    assert cache.get_seq_length() == 12


@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_prefill_matches(ours, ids, impl):
    """A multi-token step on top of a cache (SDPA takes the explicit-mask path here)."""
    hf = OuroForCausalLM.from_flashloop(ours, attn_implementation=impl)
    with torch.no_grad():
        logits, _ = run_cached(hf, ids, prefill=5, chunks=(4, 1, 2))
        close(logits, ours(ids))


@pytest.mark.parametrize("impl", IMPLS)
def test_gqa_matches(ours_gqa, ids, impl):
    hf = OuroForCausalLM.from_flashloop(ours_gqa, attn_implementation=impl)
    assert hf.model.layers[0].self_attn.num_key_value_groups == 2
    with torch.no_grad():
        ref = ours_gqa(ids)
        close(hf(ids).logits, ref)
        logits, cache = run_cached(hf, ids, prefill=9)
    close(logits, ref)
    assert cache.key_cache[0].shape[1] == 2


@pytest.mark.parametrize("impl", IMPLS)
def test_left_padding_mask(ours, ids, impl):
    """Row 0 is left-padded by 3; its valid tokens match an unpadded run (also one decode step)."""
    hf = OuroForCausalLM.from_flashloop(ours, attn_implementation=impl)
    pad = 3
    inp = ids[:, :11].clone()
    inp[0, :pad] = 0
    attention_mask = torch.ones_like(inp)
    attention_mask[0, :pad] = 0
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        cache = LoopedDynamicCache()
        out = hf(inp, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache)
        close(out.logits[0, pad:], ours(inp[:1, pad:])[0])
        close(out.logits[1], ours(inp[1:])[0])
        step = hf(
            ids[:, 11:12],
            attention_mask=torch.cat([attention_mask, torch.ones(2, 1, dtype=attention_mask.dtype)], dim=1),
            position_ids=position_ids[:, -1:] + 1,
            past_key_values=cache,
        )
        full0 = torch.cat([inp[:1, pad:], ids[:1, 11:12]], dim=1)
        close(step.logits[0, 0], ours(full0)[0, -1])
        close(step.logits[1, 0], ours(ids[1:, :12])[0, -1])


def test_logits_to_keep(ours, ids):
    hf = OuroForCausalLM.from_flashloop(ours)
    with torch.no_grad():
        close(hf(ids, logits_to_keep=1).logits, hf(ids).logits[:, -1:])
        out = hf(ids, use_early_exit_gate=False)
    assert out.hidden_states_list == [] and out.gate_list == []


# -------------------------------------------------------------------------------------------------
# Variants for "unsupported structure" tests
# -------------------------------------------------------------------------------------------------
def _finite(logits: torch.Tensor, shape) -> None:
    assert logits.shape == shape
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_sliding_window_variant(ours, ids, impl):
    window = 4
    full = OuroForCausalLM.from_flashloop(ours, attn_implementation=impl)
    sw = OuroForCausalLM.from_flashloop(ours, attn_implementation=impl, use_sliding_window=True, sliding_window=window)
    assert sw.config.sliding_window == window
    assert sw.model.layers[0].self_attn.sliding_window == window
    with torch.no_grad():
        a, b = sw(ids).logits, full(ids).logits
        _finite(a, (2, 12, VOCAB))
        # Positions < window see the same keys (in the first loop; later loops mix in the
        # windowed states of earlier tokens, which are also identical there).
        close(a[:, :window], b[:, :window])
        assert (a[:, window:] - b[:, window:]).abs().amax() > 1e-2
        logits, _ = run_cached(sw, ids, prefill=7, chunks=(1, 3, 1))
    close(logits, a)  # the cached path applies the same window


@pytest.mark.parametrize("impl", IMPLS)
def test_alibi_variant(ours, ids, impl):
    alibi = OuroForCausalLM.from_flashloop(ours, attn_implementation=impl, position_embedding_type="alibi")
    assert alibi.model.rotary_emb is None
    with torch.no_grad():
        a = alibi(ids).logits
        _finite(a, (2, 12, VOCAB))
        assert (a - ours(ids)).abs().amax() > 1e-2
        logits, _ = run_cached(alibi, ids, prefill=8, chunks=(1, 2, 1))
    close(logits, a)
    if impl == "eager":  # both implementations agree
        with torch.no_grad():
            sdpa = OuroForCausalLM.from_flashloop(ours, attn_implementation="sdpa", position_embedding_type="alibi")
            close(sdpa(ids).logits, a)


def test_single_loop_variant(ours, ids):
    """total_ut_steps=1: no recurrence; equals our model's first-loop exit."""
    hf = OuroForCausalLM.from_flashloop(ours, total_ut_steps=1)
    with torch.no_grad():
        out = hf(ids)
        _finite(out.logits, (2, 12, VOCAB))
        close(out.logits, ours(ids, readout=Readout.exit_at_step(1)))
        logits, cache = run_cached(hf, ids, prefill=9)
    close(logits, out.logits)
    assert len(cache) == hf.config.num_hidden_layers


@pytest.mark.parametrize("impl", IMPLS)
def test_llama_style_variant(ours, ids, impl):
    cfg = HFStyleOuroConfig.from_ouro_config(ours.config, attn_implementation=impl)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaStyleForCausalLM(cfg).eval()
    assert not any("layernorm_2" in k or "early_exit_gate" in k for k in model.state_dict())
    with torch.no_grad():
        out = model(ids)
        _finite(out.logits, (2, 12, VOCAB))
        logits, cache = run_cached(model, ids, prefill=9)
    close(logits, out.logits)
    assert len(cache) == cfg.num_hidden_layers


# -------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True): the graphs the backend receives
# -------------------------------------------------------------------------------------------------
# Compiling is the slow part (Dynamo traces every layer application): the variants use a smaller
# stack (1 layer x 2 loops) and are checked against their own eager run; "eager" keeps the tiny
# preset (2 layers x 4 loops) and is checked against flashloop_compile's model.
SMALL = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=1, total_ut_steps=2)


def _small(cls=OuroForCausalLM, **overrides):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return cls(SMALL, **overrides).eval()


VARIANTS = {
    "sdpa": lambda: _small(attn_implementation="sdpa"),
    "gqa": lambda: _small(attn_implementation="sdpa", num_key_value_heads=2),
    "sliding": lambda: _small(attn_implementation="eager", use_sliding_window=True, sliding_window=4),
    "alibi": lambda: _small(attn_implementation="eager", position_embedding_type="alibi"),
    "single_loop": lambda: _small(attn_implementation="eager", total_ut_steps=1, num_hidden_layers=2),
    "llama": lambda: _small(LlamaStyleForCausalLM, attn_implementation="sdpa", num_hidden_layers=2),
}


def _compile_prefill_decode(model, ids, expected):
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    with torch.no_grad():
        # Prefill with the cache created inside the compiled region and returned, then a decode
        # step on that cache object.
        pre = compiled(ids[:, :8], use_cache=True)
        cache = pre.past_key_values
        assert isinstance(cache, LoopedDynamicCache) and cache.get_seq_length() == 8
        dec = compiled(ids[:, 8:9], past_key_values=cache, use_cache=True)
        assert dec.past_key_values is cache and cache.get_seq_length() == 9
        close(torch.cat([pre.logits, dec.logits], dim=1), expected)
    assert counter.frame_count == 2  # one graph per call: no graph breaks, no extra recompiles
    return compiled, counter


def test_compile_fullgraph_prefill_and_decode_matches_flashloop(ours, ids):
    model = OuroForCausalLM.from_flashloop(ours, attn_implementation="eager")
    with torch.no_grad():
        expected = ours(ids[:, :9])
    _compile_prefill_decode(model, ids, expected)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_compile_fullgraph_prefill_and_decode_variants(ids, name):
    model = VARIANTS[name]()
    with torch.no_grad():
        expected, _ = run_cached(model, ids, prefill=8, chunks=(1,))
    compiled, counter = _compile_prefill_decode(model, ids, expected)
    if name == "sdpa":  # a forward without cache (is_causal SDPA, no mask) traces as well
        with torch.no_grad():
            close(compiled(ids[:, :8]).logits, expected[:, :8])
        assert counter.frame_count == 3


def test_compile_decode_steps_become_dynamic(ids):
    """Decode steps grow the cache by torch.cat: step 1 is static, step 2 recompiles with a
    symbolic cache length, later steps reuse that graph."""
    model = _small(attn_implementation="eager")
    with torch.no_grad():
        expected = model(ids).logits
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    cache = LoopedDynamicCache()
    with torch.no_grad():
        logits = [compiled(ids[:, :8], past_key_values=cache).logits]
        for t in range(8, 12):
            logits.append(compiled(ids[:, t : t + 1], past_key_values=cache).logits)
    close(torch.cat(logits, dim=1), expected)
    assert counter.frame_count == 3
    placeholders = [n for n in counter.graphs[-1].graph.nodes if n.op == "placeholder"]
    cache_inputs = [n for n in placeholders if "past_key_values" in n.name]
    assert len(cache_inputs) == 2 * model.config.total_ut_steps * model.config.num_hidden_layers
    assert all(isinstance(n.meta["example_value"].shape[2], torch.SymInt) for n in cache_inputs)
