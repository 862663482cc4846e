"""TokenSparsePrefillPass: op counts, the rewritten graph, numerics and KV against the reference."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

from flashloop_compile.backend import last_report, make_backend, pass_manager
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.passes import RecognitionError
from flashloop_compile.passes.graph import GraphSnapshot, op_name
from flashloop_compile.reference import ReferenceFlashLoop
from flashloop_compile.runtime.state import state_for_model

from .conftest import capture_dynamic, ragged_batch, tiny


def _config(**overrides):
    return FlashLoopConfig.from_switches(True, False, False, **overrides)


def _prefill(model, config, prompts, max_seq=64):
    """Right-padded compiled prefill (dynamic token dim) with the lengths planned; logits [B, T, V]."""
    b, t = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, t, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    pos = torch.arange(t)[None].expand(b, -1).contiguous()
    torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.mark_dynamic(pos, 1)
    model.setup_caches(b, max_seq)
    state_for_model(model).plan.set([len(p) for p in prompts])
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=make_backend(config, inner="eager"))
    with torch.no_grad():
        out = compiled(ids, pos)
    state_for_model(model).plan.clear()
    return compiled, out


def test_op_counts_and_untouched_loops():
    model = tiny(total_ut_steps=4, num_hidden_layers=2)
    model.setup_caches(2, 64)
    ids, pos = ragged_batch([9, 9])
    gm = capture_dynamic(model, ids, pos)
    counts_before = {}
    for n in gm.graph.nodes:
        counts_before[op_name(n)] = counts_before.get(op_name(n), 0) + 1
    report = pass_manager(_config(**{"compilation.position_attention": False})).run(gm)  # this pass alone
    assert report.matched == {"TokenSparsePrefillPass": 2}
    names = [op_name(n) for n in gm.graph.nodes]
    assert names.count("flashloop.select_active") == 2
    assert counts_before["scaled_dot_product_attention"] == 8
    # loops 1-2 keep SDPA; the active queries of loops 3-4 use the position-causal kernel
    assert names.count("scaled_dot_product_attention") == 4
    assert names.count("flashloop.position_attention") == 4
    # per sparse loop: the state, the positions, and the rows' ... gathered; H[r] scattered back
    assert names.count("gather_rows") == 2 * 2
    assert names.count("scatter_rows") == 2
    # per sparse loop and layer: K and V inherited (one read + one write each) plus the active write
    assert names.count("setitem") == counts_before["setitem"] + 2 * 2 * 2


def test_retention_one_skips_selection_entirely():
    model = tiny()
    model.setup_caches(2, 64)
    ids, pos = ragged_batch([9, 9])
    gm = capture_dynamic(model, ids, pos)
    report = pass_manager(_config(**{"token_sparse_prefill.retention": [1, 1, 1, 1],
                                     "compilation.position_attention": False})).run(gm)
    assert report.matched == {"TokenSparsePrefillPass": 0}
    assert "flashloop.select_active" not in [op_name(n) for n in gm.graph.nodes]


def test_static_token_dimension_is_a_clear_error():
    model = tiny()
    model.setup_caches(1, 64)
    ids, pos = ragged_batch([9])
    torch._dynamo.reset()
    with pytest.raises(Exception) as info, torch.no_grad():
        torch.compile(model, backend=make_backend(_config(), inner="eager"), dynamic=False)(ids, pos)
    torch._dynamo.reset()
    err = getattr(info.value, "inner_exception", info.value)
    assert isinstance(err, RecognitionError) and "mark_dynamic" in str(err)


def test_graph_diff():
    model = tiny(total_ut_steps=3, num_hidden_layers=1)
    model.setup_caches(1, 32)
    ids, pos = ragged_batch([6])
    gm = capture_dynamic(model, ids, pos)
    snap = GraphSnapshot(gm)
    # the token-sparse rewrite alone (the prefill attention rewrite off)
    pass_manager(_config(**{"token_sparse_prefill.retention": [1, 1, 0.5], "token_sparse_prefill.window": 4,
                            "compilation.position_attention": False})).run(gm)
    assert_expected_inline(snap.diff(gm), """\
-%0 = eq(%in2, %in2) : sym(True)
-%1 = not_(%0) : bool
+%new0 = get_attr : i32[1]
+%new1 = get_attr : i32[1]
-%197 = .float(%196) : f32[1, s2, 128]
-%198 = .pow(%197, 2) : f32[1, s2, 128]
-%199 = .mean(%198, -1, keepdim=True) : f32[1, s2, 1]
-%200 = add(%199, 1e-06) : f32[1, s2, 1]
-%201 = rsqrt(%200) : f32[1, s2, 1]
-%202 = mul(%197, %201) : f32[1, s2, 128]
-%203 = .to(%202, f32) : f32[1, s2, 128]
-%204 = mul(%in6, %203) : f32[1, s2, 128]
-%205 = linear(%204, %in7, None) : f32[1, s2, 128]
-%206 = .view(%205, 1, %in2, 2, 64) : f32[1, s2, 2, 64]
-%207 = .transpose(%206, 1, 2) : f32[1, 2, s2, 64]
-%208 = linear(%204, %in8, None) : f32[1, s2, 128]
-%209 = .view(%208, 1, %in2, 2, 64) : f32[1, s2, 2, 64]
-%210 = .transpose(%209, 1, 2) : f32[1, 2, s2, 64]
-%211 = linear(%204, %in9, None) : f32[1, s2, 128]
-%212 = .view(%211, 1, %in2, 2, 64) : f32[1, s2, 2, 64]
-%213 = .transpose(%212, 1, 2) : f32[1, 2, s2, 64]
-%214 = getitem(%12, (:, None)) : f32[1, 1, s2, 64]
-%215 = mul(%207, %214) : f32[1, 2, s2, 64]
-%216 = .chunk(%207, 2, dim=-1) : (f32[1, 2, s2, 32], f32[1, 2, s2, 32])
-%217 = getitem(%216, 0) : f32[1, 2, s2, 32]
-%218 = getitem(%216, 1) : f32[1, 2, s2, 32]
-%219 = neg(%218) : f32[1, 2, s2, 32]
-%220 = cat([%219, %217], dim=-1) : f32[1, 2, s2, 64]
-%221 = getitem(%14, (:, None)) : f32[1, 1, s2, 64]
-%222 = mul(%220, %221) : f32[1, 2, s2, 64]
-%223 = add(%215, %222) : f32[1, 2, s2, 64]
-%224 = getitem(%12, (:, None)) : f32[1, 1, s2, 64]
-%225 = mul(%210, %224) : f32[1, 2, s2, 64]
-%226 = .chunk(%210, 2, dim=-1) : (f32[1, 2, s2, 32], f32[1, 2, s2, 32])
-%227 = getitem(%226, 0) : f32[1, 2, s2, 32]
-%228 = getitem(%226, 1) : f32[1, 2, s2, 32]
-%229 = neg(%228) : f32[1, 2, s2, 32]
-%230 = cat([%229, %227], dim=-1) : f32[1, 2, s2, 64]
-%231 = getitem(%14, (:, None)) : f32[1, 1, s2, 64]
-%232 = mul(%230, %231) : f32[1, 2, s2, 64]
-%233 = add(%225, %232) : f32[1, 2, s2, 64]
-%236 = .transpose(%233, 1, 2) : f32[1, s2, 2, 64]
-%237 = setitem(%in21, (%235, :, %in3), %236) : none
-%238 = .transpose(%213, 1, 2) : f32[1, s2, 2, 64]
-%239 = setitem(%in22, (%235, :, %in3), %238) : none
-%240 = getitem(%in21, :1) : f32[1, 2, 32, 64]
-%241 = getitem(%in22, :1) : f32[1, 2, 32, 64]
-%242 = scaled_dot_product_attention(%223, %240, %241, attn_mask=%20, enable_gqa=False) : f32[1, 2, s2, 64]
-%243 = .transpose(%242, 1, 2) : f32[1, s2, 2, 64]
-%244 = .reshape(%243, 1, %in2, 128) : f32[1, s2, 128]
-%245 = linear(%244, %in11, None) : f32[1, s2, 128]
-%246 = .float(%245) : f32[1, s2, 128]
-%247 = .pow(%246, 2) : f32[1, s2, 128]
-%248 = .mean(%247, -1, keepdim=True) : f32[1, s2, 1]
-%249 = add(%248, 1e-06) : f32[1, s2, 1]
-%250 = rsqrt(%249) : f32[1, s2, 1]
-%251 = mul(%246, %250) : f32[1, s2, 128]
-%252 = .to(%251, f32) : f32[1, s2, 128]
-%253 = mul(%in12, %252) : f32[1, s2, 128]
-%254 = add(%196, %253) : f32[1, s2, 128]
-%255 = .float(%254) : f32[1, s2, 128]
-%256 = .pow(%255, 2) : f32[1, s2, 128]
-%257 = .mean(%256, -1, keepdim=True) : f32[1, s2, 1]
-%258 = add(%257, 1e-06) : f32[1, s2, 1]
-%259 = rsqrt(%258) : f32[1, s2, 1]
-%260 = mul(%255, %259) : f32[1, s2, 128]
-%261 = .to(%260, f32) : f32[1, s2, 128]
-%262 = mul(%in13, %261) : f32[1, s2, 128]
-%263 = linear(%262, %in14, None) : f32[1, s2, 256]
-%264 = silu(%263) : f32[1, s2, 256]
-%265 = linear(%262, %in15, None) : f32[1, s2, 256]
-%266 = mul(%264, %265) : f32[1, s2, 256]
-%267 = linear(%266, %in16, None) : f32[1, s2, 128]
-%268 = .float(%267) : f32[1, s2, 128]
-%269 = .pow(%268, 2) : f32[1, s2, 128]
-%270 = .mean(%269, -1, keepdim=True) : f32[1, s2, 1]
-%271 = add(%270, 1e-06) : f32[1, s2, 1]
-%272 = rsqrt(%271) : f32[1, s2, 1]
-%273 = mul(%268, %272) : f32[1, s2, 128]
-%274 = .to(%273, f32) : f32[1, s2, 128]
-%275 = mul(%in17, %274) : f32[1, s2, 128]
-%276 = add(%254, %275) : f32[1, s2, 128]
-%277 = .float(%276) : f32[1, s2, 128]
-%278 = .pow(%277, 2) : f32[1, s2, 128]
-%279 = .mean(%278, -1, keepdim=True) : f32[1, s2, 1]
-%280 = add(%279, 1e-06) : f32[1, s2, 1]
-%281 = rsqrt(%280) : f32[1, s2, 1]
-%282 = mul(%277, %281) : f32[1, s2, 128]
-%283 = .to(%282, f32) : f32[1, s2, 128]
-%284 = mul(%in18, %283) : f32[1, s2, 128]
-%285 = linear(%284, %in23, None) : f32[1, s2, 256]
+%new2 = floordiv(%in0, 4) : sym((s2//4))
+%new3 = mul(%new2, 2) : sym(2*((s2//4)))
+%new4 = mod(%in0, 4) : sym(Mod(s2, 4))
+%new5 = mul(%new4, 1) : sym(Mod(s2, 4))
+%new6 = add(%new5, 1) : sym((Mod(s2, 4)) + 1)
+%new7 = floordiv(%new6, 2) : sym((((Mod(s2, 4)) + 1)//2))
+%new8 = add(%new3, %new7) : sym(2*((s2//4)) + ((((Mod(s2, 4)) + 1)//2)))
+%new9 = flashloop.select_active(%196, %108, None, %in3, %new1, %new0, 4, 1, 2, False, %new8) : (i64[1, 2*((s2//4)) + ((((Mod(s2, 4)) + 1)//2))], b8[1, s2])
+%new10 = getitem(%new9, 0) : i64[1, 2*((s2//4)) + ((((Mod(s2, 4)) + 1)//2))]
+%new11 = gather_rows(%196, %new10) : f32[1, 2*((s2//4)) + ((((Mod(s2, 4)) + 1)//2)), 128]
+%new12 = gather_rows(%in3, %new10) : i64[1, 2*((s2//4)) + ((((Mod(s2, 4)) + 1)//2))]
+%new13 = getitem(%in19, (%235, :, %in3)) : f32[1, s2, 2, 64]
+%new14 = setitem(%in21, (%235, :, %in3), %new13) : none
+%new15 = getitem(%in20, (%235, :, %in3)) : f32[1, s2, 2, 64]
+%new16 = setitem(%in22, (%235, :, %in3), %new15) : none
+%new17 = .float(%new11) : f32[1, s2, 128]
+%new18 = .pow(%new17, 2) : f32[1, s2, 128]
+%new19 = .mean(%new18, -1, keepdim=True) : f32[1, s2, 1]
+%new20 = add(%new19, 1e-06) : f32[1, s2, 1]
+%new21 = rsqrt(%new20) : f32[1, s2, 1]
+%new22 = mul(%new17, %new21) : f32[1, s2, 128]
+%new23 = .to(%new22, f32) : f32[1, s2, 128]
+%new24 = mul(%in6, %new23) : f32[1, s2, 128]
+%new25 = linear(%new24, %in7, None) : f32[1, s2, 128]
+%new26 = .view(%new25, 1, %new8, 2, 64) : f32[1, s2, 2, 64]
+%new27 = .transpose(%new26, 1, 2) : f32[1, 2, s2, 64]
+%new28 = linear(%new24, %in8, None) : f32[1, s2, 128]
+%new29 = .view(%new28, 1, %new8, 2, 64) : f32[1, s2, 2, 64]
+%new30 = .transpose(%new29, 1, 2) : f32[1, 2, s2, 64]
+%new31 = linear(%new24, %in9, None) : f32[1, s2, 128]
+%new32 = .view(%new31, 1, %new8, 2, 64) : f32[1, s2, 2, 64]
+%new33 = .transpose(%new32, 1, 2) : f32[1, 2, s2, 64]
+%new34 = .float(%new12) : f32[1, s2]
+%new35 = getitem(%new34, (..., None)) : f32[1, s2, 1]
+%new36 = mul(%new35, %6) : f32[1, s2, 32]
+%new37 = cat([%new36, %new36], dim=-1) : f32[1, s2, 64]
+%new38 = .cos(%new37) : f32[1, s2, 64]
+%new39 = .to(%new38, f32) : f32[1, s2, 64]
+%new40 = getitem(%new39, (:, None)) : f32[1, 1, s2, 64]
+%new41 = mul(%new27, %new40) : f32[1, 2, s2, 64]
+%new42 = .chunk(%new27, 2, dim=-1) : (f32[1, 2, s2, 32], f32[1, 2, s2, 32])
+%new43 = getitem(%new42, 0) : f32[1, 2, s2, 32]
+%new44 = getitem(%new42, 1) : f32[1, 2, s2, 32]
+%new45 = neg(%new44) : f32[1, 2, s2, 32]
+%new46 = cat([%new45, %new43], dim=-1) : f32[1, 2, s2, 64]
+%new47 = .sin(%new37) : f32[1, s2, 64]
+%new48 = .to(%new47, f32) : f32[1, s2, 64]
+%new49 = getitem(%new48, (:, None)) : f32[1, 1, s2, 64]
+%new50 = mul(%new46, %new49) : f32[1, 2, s2, 64]
+%new51 = add(%new41, %new50) : f32[1, 2, s2, 64]
+%new52 = getitem(%new39, (:, None)) : f32[1, 1, s2, 64]
+%new53 = mul(%new30, %new52) : f32[1, 2, s2, 64]
+%new54 = .chunk(%new30, 2, dim=-1) : (f32[1, 2, s2, 32], f32[1, 2, s2, 32])
+%new55 = getitem(%new54, 0) : f32[1, 2, s2, 32]
+%new56 = getitem(%new54, 1) : f32[1, 2, s2, 32]
+%new57 = neg(%new56) : f32[1, 2, s2, 32]
+%new58 = cat([%new57, %new55], dim=-1) : f32[1, 2, s2, 64]
+%new59 = getitem(%new48, (:, None)) : f32[1, 1, s2, 64]
+%new60 = mul(%new58, %new59) : f32[1, 2, s2, 64]
+%new61 = add(%new53, %new60) : f32[1, 2, s2, 64]
+%new62 = .transpose(%new61, 1, 2) : f32[1, s2, 2, 64]
+%new63 = setitem(%in21, (%235, :, %new12), %new62) : none
+%new64 = .transpose(%new33, 1, 2) : f32[1, s2, 2, 64]
+%new65 = setitem(%in22, (%235, :, %new12), %new64) : none
+%new66 = getitem(%in21, :1) : f32[1, 2, 32, 64]
+%new67 = getitem(%in22, :1) : f32[1, 2, 32, 64]
+%new68 = flashloop.position_attention(%new51, %new66, %new67, %new12, 0.125) : f32[1, 2, 2*((s2//4)) + ((((Mod(s2, 4)) + 1)//2)), 64]
+%new69 = .transpose(%new68, 1, 2) : f32[1, s2, 2, 64]
+%new70 = .reshape(%new69, 1, %new8, 128) : f32[1, s2, 128]
+%new71 = linear(%new70, %in11, None) : f32[1, s2, 128]
+%new72 = .float(%new71) : f32[1, s2, 128]
+%new73 = .pow(%new72, 2) : f32[1, s2, 128]
+%new74 = .mean(%new73, -1, keepdim=True) : f32[1, s2, 1]
+%new75 = add(%new74, 1e-06) : f32[1, s2, 1]
+%new76 = rsqrt(%new75) : f32[1, s2, 1]
+%new77 = mul(%new72, %new76) : f32[1, s2, 128]
+%new78 = .to(%new77, f32) : f32[1, s2, 128]
+%new79 = mul(%in12, %new78) : f32[1, s2, 128]
+%new80 = add(%new11, %new79) : f32[1, s2, 128]
+%new81 = .float(%new80) : f32[1, s2, 128]
+%new82 = .pow(%new81, 2) : f32[1, s2, 128]
+%new83 = .mean(%new82, -1, keepdim=True) : f32[1, s2, 1]
+%new84 = add(%new83, 1e-06) : f32[1, s2, 1]
+%new85 = rsqrt(%new84) : f32[1, s2, 1]
+%new86 = mul(%new81, %new85) : f32[1, s2, 128]
+%new87 = .to(%new86, f32) : f32[1, s2, 128]
+%new88 = mul(%in13, %new87) : f32[1, s2, 128]
+%new89 = linear(%new88, %in14, None) : f32[1, s2, 256]
+%new90 = silu(%new89) : f32[1, s2, 256]
+%new91 = linear(%new88, %in15, None) : f32[1, s2, 256]
+%new92 = mul(%new90, %new91) : f32[1, s2, 256]
+%new93 = linear(%new92, %in16, None) : f32[1, s2, 128]
+%new94 = .float(%new93) : f32[1, s2, 128]
+%new95 = .pow(%new94, 2) : f32[1, s2, 128]
+%new96 = .mean(%new95, -1, keepdim=True) : f32[1, s2, 1]
+%new97 = add(%new96, 1e-06) : f32[1, s2, 1]
+%new98 = rsqrt(%new97) : f32[1, s2, 1]
+%new99 = mul(%new94, %new98) : f32[1, s2, 128]
+%new100 = .to(%new99, f32) : f32[1, s2, 128]
+%new101 = mul(%in17, %new100) : f32[1, s2, 128]
+%new102 = add(%new80, %new101) : f32[1, s2, 128]
+%new103 = .float(%new102) : f32[1, s2, 128]
+%new104 = .pow(%new103, 2) : f32[1, s2, 128]
+%new105 = .mean(%new104, -1, keepdim=True) : f32[1, s2, 1]
+%new106 = add(%new105, 1e-06) : f32[1, s2, 1]
+%new107 = rsqrt(%new106) : f32[1, s2, 1]
+%new108 = mul(%new103, %new107) : f32[1, s2, 128]
+%new109 = .to(%new108, f32) : f32[1, s2, 128]
+%new110 = mul(%in18, %new109) : f32[1, s2, 128]
+%new111 = scatter_rows(%196, %new10, %new110) : f32[1, s2, 128]
+%285 = linear(%new111, %in23, None) : f32[1, s2, 256]
""")


@pytest.mark.parametrize("window, keep_last", [(None, False), (8, False), (8, True), (5, True)])
def test_ragged_batch_matches_reference_per_request(window, keep_last):
    model = tiny()
    config = _config(**{"token_sparse_prefill.window": window, "token_sparse_prefill.keep_last_token": keep_last})
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (13, 21, 17)]
    _, logits = _prefill(model, config, prompts)
    for i, p in enumerate(prompts):
        ref = ReferenceFlashLoop(model, config).request().prefill(p)
        torch.testing.assert_close(logits[i, : len(p)], ref.logits, rtol=1e-5, atol=1e-5)
        # KV slots: every (loop, layer) slot holds the reference's logical K/V (inherited where inactive)
        for layer in range(model.config.num_hidden_layers):
            for depth in range(model.config.num_loops):
                cache = model.model.cache_at(depth, layer)
                k = cache.k_cache[i, :, : len(p)].transpose(0, 1)
                v = cache.v_cache[i, :, : len(p)].transpose(0, 1)
                torch.testing.assert_close(k, ref.k[layer][depth], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(v, ref.v[layer][depth], rtol=1e-5, atol=1e-5)


def test_decode_after_sparse_prefill_reads_inherited_kv():
    model = tiny()
    config = _config(**{"token_sparse_prefill.window": 8})
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 19)]
    compiled, logits = _prefill(model, config, prompts)
    refs = [ReferenceFlashLoop(model, config).request() for _ in prompts]
    first = [r.prefill(p).logits[-1].argmax() for r, p in zip(refs, prompts)]
    tok = torch.stack(first)[:, None]
    with torch.no_grad():
        step = compiled(tok, torch.tensor([[len(p)] for p in prompts]))
    assert last_report().phase == "decode"
    for i, r in enumerate(refs):
        torch.testing.assert_close(step[i], r.decode(tok[i]).logits, rtol=1e-5, atol=1e-5)
