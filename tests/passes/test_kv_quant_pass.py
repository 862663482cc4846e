"""KVResidualQuantizationPass: exact op counts (alone and composed), the graph diff, errors."""

from __future__ import annotations

import operator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from expecttest import assert_expected_inline

from flashloop_compile.backend import pass_manager
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.passes import PassManager, RecognitionError
from flashloop_compile.passes.graph import GraphSnapshot, op_name
from flashloop_compile.lowering.packed_ops import overlay_inflight
from flashloop_compile.passes.kv_quant import local_keys, selected_positions
from models.hf_style_ouro import LoopedDynamicCache
from models.hf_style_ouro import OuroForCausalLM as HFStyleOuro

from .conftest import capture, capture_dynamic, ragged_batch, tiny

QUANT = FlashLoopConfig.from_switches(False, False, True)


def _counts(gm) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        name = op_name(n)
        if name.startswith("flashloop.") or name == "scaled_dot_product_attention":
            out[name] = out.get(name, 0) + 1
    return out


def _cache_writes(gm) -> int:
    def is_cache(n):
        v = n.meta.get("example_value")
        return n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() == 4

    buffers = {n for n in gm.graph.nodes if is_cache(n)}
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is operator.setitem and n.args[0] in buffers)


def _decode_graph(model, batch=2):
    model.setup_caches(batch, 128)
    ids, _ = ragged_batch([1] * batch)
    return capture(model, ids, torch.arange(batch)[:, None] + 70)


def test_decode_quant_only_counts():
    gm = _decode_graph(tiny())
    assert _cache_writes(gm) == 16
    report = pass_manager(QUANT).run(gm)
    assert report.matched == {"KVResidualQuantizationPass": 8}
    assert _counts(gm) == {"flashloop.packed_attention": 8, "flashloop.packed_kv_write": 8}
    assert _cache_writes(gm) == 0, "no dense cache write survives"


def test_a_manager_without_the_runtime_names_what_to_pass():
    # the pass layer does not reach into the runtime: the packed cache comes through the provider
    with pytest.raises(RuntimeError, match=r"packed KV cache: build the PassManager with runtime=.*ModelStateProvider"):
        PassManager(QUANT).run(_decode_graph(tiny()))


def test_decode_quant_with_sparse_decode_counts():
    gm = _decode_graph(tiny())
    pass_manager(FlashLoopConfig.from_switches(False, True, True)).run(gm)
    assert _counts(gm) == {
        "flashloop.packed_attention": 2,  # loop 1 reads the packed cache directly
        "flashloop.packed_reference_attention": 2,  # loop 2: the reference over the packed whole history
        "flashloop.packed_correction_attention": 4,  # loops 3, 4: the selected keys read and attended in one op
        "flashloop.packed_kv_write": 8,
    }


def test_decode_quant_with_sparse_decode_reuse_counts():
    gm = _decode_graph(tiny())
    config = FlashLoopConfig.from_switches(False, True, True, **{"sparse_decode_attention.reuse_selected_probabilities": True})
    pass_manager(config).run(gm)
    assert _counts(gm) == {
        "flashloop.packed_attention": 2,
        "flashloop.packed_reference_attention_probs": 2,  # loop 2 keeps the selected keys' probabilities
        "flashloop.packed_reuse_correction_attention": 4,  # loops 3, 4: the selected keys' V only
        "flashloop.packed_kv_write": 8,
    }


def test_the_correction_is_one_op_per_site_in_the_plan():
    # each correction becomes one flashloop.packed_correction_attention over the packed history
    from flashloop_compile.passes import recognize

    gm = _decode_graph(tiny())
    plan = pass_manager(FlashLoopConfig.from_switches(False, True, True)).plan(recognize(gm))
    assert any("the selected keys read and attended in one pass" in line for line in plan), plan


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 2), group=st.sampled_from([1, 2, 4]), kv=st.integers(1, 2), t=st.integers(1, 3),
       k=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_compact_selection_reads_each_query_heads_keys(b, group, kv, t, k, seed):
    """What a correction sees through the compact per-kv-head read (selected_positions ->
    packed_read with this step's tokens in flight, indexed by local_keys) equals the full history indexed by the
    reference's keys, with this step's tokens taken from flight."""
    g = torch.Generator().manual_seed(seed)
    s, d, hq = 12, 3, group * kv
    hist = torch.randn(b, kv, s, d, generator=g)
    keys = torch.randint(0, s, (b, hq, t, k), generator=g).int()
    count = torch.randint(0, k + 1, (b, hq, t), generator=g).int()
    step = torch.stack([torch.randperm(s, generator=g)[:t] for _ in range(b)])  # this step's (distinct) positions
    step[torch.rand(b, t, generator=g) < 0.3] = -1  # padding
    flight = torch.randn(b, kv, t, d, generator=g)
    full = hist.clone()
    for bi in range(b):
        for ti in range(t):
            if step[bi, ti] >= 0:
                full[bi, :, step[bi, ti]] = flight[bi, :, ti]
    sel = selected_positions(keys, count, kv)
    assert sel.shape == (b, kv, group * t * k)
    read = torch.where((sel >= 0)[..., None], torch.gather(hist, 2, sel.clamp_min(0)[..., None].expand(-1, -1, -1, d)), 0.0)
    compact = overlay_inflight(read, sel, step, flight)
    local = local_keys(keys, kv)
    for bi, h, ti in np.ndindex(b, hq, t):
        n = int(count[bi, h, ti])
        got = compact[bi, h // group, local[bi, h, ti, :n].long()]
        want = full[bi, h // group, keys[bi, h, ti, :n].long()]
        assert torch.equal(got, want), (bi, h, ti)


def test_prefill_all_on_counts():
    model = tiny()
    model.setup_caches(2, 128)
    ids, pos = ragged_batch([40, 40])
    gm = capture_dynamic(model, ids, pos)
    report = pass_manager(FlashLoopConfig.all_on()).run(gm)
    assert report.matched == {"TokenSparsePrefillPass": 2, "PositionAttentionPass": 8, "KVResidualQuantizationPass": 8}
    assert _counts(gm) == {
        "flashloop.select_active": 2,
        "flashloop.packed_attention": 8,
        "flashloop.packed_kv_write": 8,
    }
    assert _cache_writes(gm) == 0
    names = [op_name(n) for n in gm.graph.nodes]
    # sparse loops' in-flight K and V: loop r-1's with the active rows replaced, per layer
    assert names.count("scatter_tokens") == 2 * 2 * 2


def test_graph_diff():
    model = tiny(total_ut_steps=2, num_hidden_layers=1)
    model.setup_caches(1, 64)
    ids, _ = ragged_batch([1])
    gm = capture(model, ids, torch.tensor([[3]]))
    snap = GraphSnapshot(gm)
    pass_manager(QUANT).run(gm)
    assert_expected_inline(snap.diff(gm), """\
+%new0 = get_attr : i32[1, 2]
+%new1 = get_attr : i32[1, 2]
+%new2 = get_attr : f32[1, 2, 2, 128, 64]
+%new3 = get_attr : f32[1, 2, 2, 128, 64]
+%new4 = get_attr : f16[1, 2, 64, 1]
+%new5 = get_attr : f16[1, 2, 64, 1]
+%new6 = get_attr : u8[1, 2, 64, 32]
+%new7 = get_attr : f16[1, 1, 2, 1, 64]
+%new8 = get_attr : f16[1, 1, 2, 1, 64]
+%new9 = get_attr : u8[1, 2, 64, 32]
+%new10 = get_attr : f16[1, 2, 64, 1]
+%new11 = get_attr : f16[1, 2, 64, 1]
+%new12 = get_attr : u8[1, 2, 64, 32]
+%new13 = get_attr : f16[1, 2, 1, 64]
+%new14 = get_attr : f16[1, 2, 1, 64]
+%new15 = get_attr : u8[1, 2, 64, 32]
+%new16 = get_attr : i32[1]
+%new17 = get_attr : i32[2, 2]
+%new18 = get_attr : u8[1, 64]
+%new19 = get_attr : i32[1, 1, 64]
+%new20 = get_attr : i32[1]
-%13 = arange(64) : i64[64]
-%14 = getitem(%13, None) : i64[1, 64]
-%15 = .expand(%14, 1, -1) : i64[1, 64]
-%16 = getitem(%15, (:, None, None, :)) : i64[1, 1, 1, 64]
-%17 = getitem(%in1, (:, None, :, None)) : i64[1, 1, 1, 1]
-%18 = le(%16, %17) : b8[1, 1, 1, 64]
-%56 = arange(1) : i64[1]
-%57 = getitem(%56, (:, None)) : i64[1, 1]
-%58 = .transpose(%55, 1, 2) : f32[1, 1, 2, 64]
-%59 = setitem(%in2, (%57, :, %in1), %58) : none
-%60 = .transpose(%35, 1, 2) : f32[1, 1, 2, 64]
-%61 = setitem(%in8, (%57, :, %in1), %60) : none
-%62 = getitem(%in2, :1) : f32[1, 2, 64, 64]
-%63 = getitem(%in8, :1) : f32[1, 2, 64, 64]
-%64 = scaled_dot_product_attention(%45, %62, %63, attn_mask=%18, enable_gqa=False) : f32[1, 2, 1, 64]
-%65 = .transpose(%64, 1, 2) : f32[1, 1, 2, 64]
+%new21 = mask_positions(%in1, %new20) : i64[1, 1]
+%new22 = flashloop.packed_attention(%45, %55, %35, %new21, %new21, 0, %new15, %new14, %new13, %new12, %new11, %new10, %new9, %new8, %new7, %new6, %new5, %new4, %new3, %new2, %new1, %new0, %new19, %new18, %new17, %new16, 0.125) : f32[1, 2, 1, 64]
+%new23 = flashloop.packed_kv_write(%new15, %new14, %new13, %new12, %new11, %new10, %new9, %new8, %new7, %new6, %new5, %new4, %new3, %new2, %new1, %new0, %new19, %new18, %new17, %new16, %55, %35, %new21, 0) : none
+%65 = .transpose(%new22, 1, 2) : f32[1, 1, 2, 64]
-%144 = arange(1) : i64[1]
-%145 = getitem(%144, (:, None)) : i64[1, 1]
-%146 = .transpose(%143, 1, 2) : f32[1, 1, 2, 64]
-%147 = setitem(%in17, (%145, :, %in1), %146) : none
-%148 = .transpose(%123, 1, 2) : f32[1, 1, 2, 64]
-%149 = setitem(%in18, (%145, :, %in1), %148) : none
-%150 = getitem(%in17, :1) : f32[1, 2, 64, 64]
-%151 = getitem(%in18, :1) : f32[1, 2, 64, 64]
-%152 = scaled_dot_product_attention(%133, %150, %151, attn_mask=%18, enable_gqa=False) : f32[1, 2, 1, 64]
-%153 = .transpose(%152, 1, 2) : f32[1, 1, 2, 64]
+%new24 = flashloop.packed_attention(%133, %143, %123, %new21, %new21, 1, %new15, %new14, %new13, %new12, %new11, %new10, %new9, %new8, %new7, %new6, %new5, %new4, %new3, %new2, %new1, %new0, %new19, %new18, %new17, %new16, 0.125) : f32[1, 2, 1, 64]
+%new25 = flashloop.packed_kv_write(%new15, %new14, %new13, %new12, %new11, %new10, %new9, %new8, %new7, %new6, %new5, %new4, %new3, %new2, %new1, %new0, %new19, %new18, %new17, %new16, %143, %123, %new21, 1) : none
+%153 = .transpose(%new24, 1, 2) : f32[1, 1, 2, 64]
""")


def test_concat_cache_is_a_clear_error():
    hf = HFStyleOuro.from_flashloop(tiny(), attn_implementation="sdpa").eval()
    ids, _ = ragged_batch([6])
    cache = LoopedDynamicCache()
    with torch.no_grad():
        hf(ids, past_key_values=cache)
    gm = capture(hf, ids[:, :1], past_key_values=cache)
    with pytest.raises(RecognitionError, match="reads a 'concat' cache"):
        pass_manager(QUANT).run(gm)
