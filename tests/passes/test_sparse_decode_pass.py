"""SparseDecodeAttentionPass: exact op counts, the graph diff, numerics against the reference."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

from flashloop_compile.backend import last_report, make_backend, pass_manager
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.models.ouro import Readout
from flashloop_compile.passes import SparseDecodeAttentionPass, recognize
from flashloop_compile.passes.graph import GraphSnapshot, op_name
from flashloop_compile.reference import ReferenceFlashLoop
from models.hf_style_ouro import LoopedDynamicCache
from models.hf_style_ouro import OuroForCausalLM as HFStyleOuro

from .conftest import capture, ragged_batch, tiny

SPARSE = FlashLoopConfig.from_switches(False, True, False)
REUSE = FlashLoopConfig.from_switches(False, True, False, **{"sparse_decode_attention.reuse_selected_probabilities": True})
SITE_OPS = ("scaled_dot_product_attention", "flashloop.reference_attention", "flashloop.correction_attention",
            "flashloop.reference_attention_probs", "flashloop.reuse_correction_attention")


def op_counts(gm) -> dict[str, int]:
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        name = op_name(n)
        if name in SITE_OPS:
            counts[name] = counts.get(name, 0) + 1
    return counts


def decode_graph(model, batch=2, max_seq=48, **kwargs):
    model.setup_caches(batch, max_seq)
    ids, _ = ragged_batch([1] * batch)
    pos = torch.arange(batch)[:, None] + 5
    return capture(model, ids, pos, **kwargs)


@pytest.mark.parametrize("loops, layers", [(4, 2), (3, 3), (5, 1)])
def test_op_counts_before_and_after(loops, layers):
    gm = decode_graph(tiny(total_ut_steps=loops, num_hidden_layers=layers))
    assert op_counts(gm) == {"scaled_dot_product_attention": loops * layers}
    report = pass_manager(SPARSE).run(gm)
    assert report.matched == {"SparseDecodeAttentionPass": layers * (loops - 1)}
    assert op_counts(gm) == {
        "scaled_dot_product_attention": layers,  # loop 1 stays dense
        "flashloop.reference_attention": layers,  # loop 2
        "flashloop.correction_attention": layers * (loops - 2),
    }


def test_prefill_graphs_and_two_loop_models_are_untouched():
    model = tiny()
    model.setup_caches(2, 48)
    ids, pos = ragged_batch([6, 6])
    gm = capture(model, ids, pos)
    # sparse decode alone (the prefill attention rewrite off)
    report = pass_manager(FlashLoopConfig.from_dict({**SPARSE.to_dict(), "compilation.position_attention": False})).run(gm)
    assert report.phase == "prefill" and report.matched == {}
    assert op_counts(gm) == {"scaled_dot_product_attention": 8}
    gm = decode_graph(tiny(total_ut_steps=2))
    assert pass_manager(SPARSE).run(gm).matched == {"SparseDecodeAttentionPass": 0}
    # a forward that stops at loop 2 (exit_at_step=2) has no sparse loop either
    gm = decode_graph(tiny(), readout=Readout.exit_at_step(2))
    assert pass_manager(SPARSE).run(gm).matched == {"SparseDecodeAttentionPass": 0}


def test_graph_diff():
    gm = decode_graph(tiny(total_ut_steps=3, num_hidden_layers=1), batch=1, max_seq=32)
    snap = GraphSnapshot(gm)
    pass_manager(SPARSE).run(gm)
    assert_expected_inline(snap.diff(gm), """\
-%152 = scaled_dot_product_attention(%133, %150, %151, attn_mask=%18, enable_gqa=False) : f32[1, 2, 1, 64]
-%153 = .transpose(%152, 1, 2) : f32[1, 1, 2, 64]
+%new0 = flashloop.reference_attention(%133, %150, %151, %18, 0.125, [0.1], [4]) : (f32[1, 2, 1, 64], i32[1, 1, 2, 1, 4], i32[1, 1, 2, 1], f32[1, 1, 2, 1], f32[1, 2, 1, 64], f32[1, 1, 2, 1, 64])
+%new1 = getitem(%new0, 0) : f32[1, 2, 1, 64]
+%new2 = getitem(%new0, 1) : i32[1, 1, 2, 1, 4]
+%new3 = getitem(%new0, 2) : i32[1, 1, 2, 1]
+%new4 = getitem(%new0, 3) : f32[1, 1, 2, 1]
+%new5 = getitem(%new0, 4) : f32[1, 2, 1, 64]
+%new6 = getitem(%new0, 5) : f32[1, 1, 2, 1, 64]
+%153 = .transpose(%new1, 1, 2) : f32[1, 1, 2, 64]
-%240 = scaled_dot_product_attention(%221, %238, %239, attn_mask=%18, enable_gqa=False) : f32[1, 2, 1, 64]
-%241 = .transpose(%240, 1, 2) : f32[1, 1, 2, 64]
+%new7 = getitem(%new2, 0) : i32[1, 2, 1, 4]
+%new8 = getitem(%new3, 0) : i32[1, 2, 1]
+%new9 = getitem(%new4, 0) : f32[1, 2, 1]
+%new10 = getitem(%new6, 0) : f32[1, 2, 1, 64]
+%new11 = flashloop.correction_attention(%221, %238, %239, %new7, %new8, %new9, %new5, %new10, 0.125) : f32[1, 2, 1, 64]
+%241 = .transpose(%new11, 1, 2) : f32[1, 1, 2, 64]
""")


def test_reference_state_flows_per_layer():
    gm = decode_graph(tiny(total_ut_steps=4, num_hidden_layers=2))
    pass_manager(SPARSE).run(gm)
    refs = [n for n in gm.graph.nodes if op_name(n) == "flashloop.reference_attention"]
    corrs = [n for n in gm.graph.nodes if op_name(n) == "flashloop.correction_attention"]

    def source_ref(n):
        seen, stack = set(), [n]
        while stack:
            x = stack.pop()
            if x in refs:
                return x
            if x not in seen:
                seen.add(x)
                stack.extend(i for i in x.all_input_nodes if i.op != "placeholder")
        return None

    # correction sites in program order: loop 3 layer 0, loop 3 layer 1, loop 4 layer 0, loop 4 layer 1
    assert [refs.index(source_ref(c)) for c in corrs] == [0, 1, 0, 1]


def _generate_compiled(model, prompts, steps, backend):
    """Right-padded prefill then greedy decode with per-row positions.

    Returns the tokens fed to each decode step [B, steps] and the logits of each step [B, steps, V].
    """
    b = len(prompts)
    t = max(len(p) for p in prompts)
    ids = torch.zeros(b, t, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p
    model.setup_caches(b, 64)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, dynamic=False)
    with torch.no_grad():
        logits = compiled(ids, torch.arange(t)[None].expand(b, -1))
        tok = torch.stack([logits[i, len(p) - 1].argmax() for i, p in enumerate(prompts)])
        lengths = torch.tensor([len(p) for p in prompts])
        fed, out = [], []
        for s in range(steps):
            fed.append(tok)
            step = compiled(tok[:, None], (lengths + s)[:, None])
            out.append(step[:, 0])
            tok = step[:, 0].argmax(-1)
    torch._dynamo.reset()
    model.clear_caches()
    return torch.stack(fed, 1), torch.stack(out, 1)


def _reference_logits(model, config, prompt, tokens):
    req = ReferenceFlashLoop(model, config).request()
    req.prefill(prompt)
    return torch.cat([req.decode(t[None]).logits for t in tokens])


@pytest.mark.parametrize("fractions", [[0.1], [0.3, 0.15]])
def test_compiled_decode_matches_reference_ragged_batch(fractions):
    model = tiny()
    config = FlashLoopConfig.from_switches(False, True, False, **{"sparse_decode_attention.key_fraction": fractions})
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (23, 40, 31)]
    fed, got = _generate_compiled(model, prompts, 3, make_backend(config, inner="eager"))
    for i, p in enumerate(prompts):
        torch.testing.assert_close(got[i], _reference_logits(model, config, p, fed[i]), rtol=1e-5, atol=1e-5)


def test_fraction_one_equals_dense():
    model = tiny()
    config = FlashLoopConfig.from_switches(False, True, False, **{"sparse_decode_attention.key_fraction": [1.0]})
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (12, 20)]
    fed, sparse = _generate_compiled(model, prompts, 2, make_backend(config, inner="eager"))
    fed_dense, dense = _generate_compiled(model, prompts, 2, make_backend(None, inner="eager"))
    assert torch.equal(fed, fed_dense)
    torch.testing.assert_close(sparse, dense, rtol=1e-5, atol=1e-5)


def test_hf_style_decode_graph_is_rewritten_and_matches_reference():
    ours = tiny()
    hf = HFStyleOuro.from_flashloop(ours, attn_implementation="eager").eval()
    prompt = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(3))
    cache = LoopedDynamicCache()
    with torch.no_grad():
        first = hf(prompt, past_key_values=cache)[0][:, -1].argmax(-1, keepdim=True)
        torch._dynamo.reset()
        compiled = torch.compile(hf, backend=make_backend(SPARSE, inner="eager"), fullgraph=True)
        got = compiled(first, past_key_values=cache)[0][0]
    torch._dynamo.reset()
    assert last_report().matched == {"SparseDecodeAttentionPass": 6}
    expected = _reference_logits(ours, SPARSE, prompt[0], first[0])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)



# -- reuse_selected_probabilities ------------------------------------------------------------------


@pytest.mark.parametrize("loops, layers", [(4, 2), (3, 3)])
def test_reuse_op_counts(loops, layers):
    gm = decode_graph(tiny(total_ut_steps=loops, num_hidden_layers=layers))
    report = pass_manager(REUSE).run(gm)
    assert report.matched == {"SparseDecodeAttentionPass": layers * (loops - 1)}
    assert op_counts(gm) == {
        "scaled_dot_product_attention": layers,  # loop 1 stays dense
        "flashloop.reference_attention_probs": layers,  # loop 2 keeps the selected keys' probabilities
        "flashloop.reuse_correction_attention": layers * (loops - 2),
    }
    # the corrections read V only: no query or key enters them
    for n in gm.graph.nodes:
        if op_name(n) == "flashloop.reuse_correction_attention":
            v, keys, count, probs, o_ref, c_ref = n.args
            assert op_name(probs) == "getitem" and op_name(probs.args[0]) == "getitem"
            assert op_name(probs.args[0].args[0]) == "flashloop.reference_attention_probs"
            assert probs.args[0].args[1] == 6


@pytest.mark.parametrize("fractions", [[0.1], [0.3, 0.15]])
def test_reuse_compiled_decode_matches_reference_ragged_batch(fractions):
    model = tiny()
    config = FlashLoopConfig.from_switches(
        False, True, False,
        **{"sparse_decode_attention.key_fraction": fractions, "sparse_decode_attention.reuse_selected_probabilities": True},
    )
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (23, 40, 31)]
    fed, got = _generate_compiled(model, prompts, 3, make_backend(config, inner="eager"))
    for i, p in enumerate(prompts):
        torch.testing.assert_close(got[i], _reference_logits(model, config, p, fed[i]), rtol=1e-5, atol=1e-5)
    # the option changes the result (loops 3..R correct with loop 2's probabilities)
    plain = FlashLoopConfig.from_switches(False, True, False, **{"sparse_decode_attention.key_fraction": fractions})
    assert not torch.allclose(got[0], _reference_logits(model, plain, prompts[0], fed[0]), atol=1e-4)
