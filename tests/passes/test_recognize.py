"""Recognition of the recurrent block: our model, an HF-style Ouro, other R and N, prefill and
decode, batch > 1; the errors a user sees when a feature cannot apply."""

from __future__ import annotations

import pytest
import torch
from expecttest import assert_expected_inline

from flashloop_compile.backend import last_report, make_backend
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.models.ouro import Readout
from flashloop_compile.passes import NoRecurrentBlockError, UnsupportedAttentionError, recognize
from flashloop_compile.passes.graph import op_name
from models.hf_style_ouro import LlamaStyleForCausalLM, LoopedDynamicCache
from models.hf_style_ouro import OuroForCausalLM as HFStyleOuro

from .conftest import capture, ragged_batch, tiny


def test_our_model_prefill_ragged_batch_of_three():
    model = tiny()
    model.setup_caches(3, 64)
    ids, pos = ragged_batch([5, 7, 3])
    s = recognize(capture(model, ids, pos))
    assert (s.num_loops, s.num_layers) == (4, 2)
    assert [(site.loop, site.layer) for site in s.sites] == [(r, i) for r in range(4) for i in range(2)]
    # H[r] are the end-of-loop norms; loop r+1 reads exactly H[r].
    assert len(s.states) == 5 and len(set(s.states)) == 5
    assert all(site.cache.kind == "inplace" and site.cache.positions is not None for site in s.sites)
    # one K and one V buffer per (loop, layer), all distinct
    buffers = {site.cache.k_buffer for site in s.sites} | {site.cache.v_buffer for site in s.sites}
    assert len(buffers) == 16
    assert_expected_inline(s.summary(), """\
recurrent block: R=4 loops x N=2 layers, 156 nodes per loop, 23 shared weights
state: H[0] = embedding f32[3, 7, 128]; H[r] = mul f32[3, 7, 128]
loop inputs: placeholder i64[3, 7], .to f32[3, 7, 64], .to f32[3, 7, 64], le b8[3, 1, 7, 64], arange i64[3]
per-loop inputs: 4 per loop
positions: i64[3, 7]
exit gate: none
coda: linear
attention sites:
  8 sites (loop 1, layer 0)..(loop 4, layer 1): sdpa: q f32[3, 2, 7, 64] k f32[3, 2, 64, 64]; kv inplace buffer f32[3, 2, 64, 64]; mask causal-position; query_len 7
""")


def test_our_model_decode():
    model = tiny()
    model.setup_caches(3, 64)
    ids, _ = ragged_batch([1, 1, 1])
    pos = torch.tensor([[5], [7], [3]])
    s = recognize(capture(model, ids, pos))
    assert s.query_len == 1
    assert_expected_inline(s.summary(), """\
recurrent block: R=4 loops x N=2 layers, 156 nodes per loop, 23 shared weights
state: H[0] = embedding f32[3, 1, 128]; H[r] = mul f32[3, 1, 128]
loop inputs: placeholder i64[3, 1], .to f32[3, 1, 64], .to f32[3, 1, 64], le b8[3, 1, 1, 64], arange i64[3]
per-loop inputs: 4 per loop
positions: i64[3, 1]
exit gate: none
coda: linear
attention sites:
  8 sites (loop 1, layer 0)..(loop 4, layer 1): sdpa: q f32[3, 2, 1, 64] k f32[3, 2, 64, 64]; kv inplace buffer f32[3, 2, 64, 64]; mask causal-position; query_len 1
""")


def test_mask_of_a_batch_size_read_from_the_input_is_a_position_comparison():
    # the recompile for a second batch size (here max_batch) expands the key positions to
    # input_ids.size(0): a shape query, a constant of the mask
    model = tiny()
    model.setup_caches(2, 32)
    graphs = []
    compiled = torch.compile(model, backend=lambda gm, _: graphs.append(gm) or gm.forward, fullgraph=True)
    torch._dynamo.reset()
    with torch.no_grad():
        for b in (1, 2):
            ids, pos = ragged_batch([6] * b)
            torch._dynamo.mark_dynamic(ids, 1)
            torch._dynamo.mark_dynamic(pos, 1)
            compiled(ids, pos.contiguous())
    torch._dynamo.reset()
    assert any(n.op == "call_method" and n.target == "size" for n in graphs[-1].graph.nodes)
    s = recognize(graphs[-1])
    assert {site.mask_kind for site in s.sites} == {"causal-position"}


@pytest.mark.parametrize("loops, layers", [(3, 3), (2, 1), (6, 1)])
def test_other_loop_and_layer_counts(loops, layers):
    model = tiny(total_ut_steps=loops, num_hidden_layers=layers)
    model.setup_caches(2, 32)
    ids, pos = ragged_batch([4, 4])
    for args in ((ids, pos), (ids[:, :1], pos[:, :1] + 4)):
        s = recognize(capture(model, *args))
        assert (s.num_loops, s.num_layers) == (loops, layers)
        assert len(s.sites) == loops * layers


def test_exit_gate_and_weighted_readout_coda():
    model = tiny()
    ids, pos = ragged_batch([6, 6])
    s = recognize(capture(model, ids, pos, readout=Readout("weighted")))
    assert len(s.exit_gates) == 4
    assert s.coda, "the readout combination follows the last loop"


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_style_prefill_and_decode(impl):
    hf = HFStyleOuro.from_flashloop(tiny(), attn_implementation=impl).eval()
    ids, _ = ragged_batch([9, 9])
    cache = LoopedDynamicCache()
    with torch.no_grad():
        hf(ids, past_key_values=cache)
    prefill = recognize(capture(hf, ids))
    decode = recognize(capture(hf, ids[:, :1], past_key_values=cache))
    for s, q_len in ((prefill, 9), (decode, 1)):
        assert (s.num_loops, s.num_layers, s.query_len) == (4, 2, q_len)
        assert len(s.exit_gates) == 4
        assert all(site.mask_supported for site in s.sites)
    assert {site.cache.kind for site in decode.sites} == {"concat"}
    assert len(decode.per_loop_inputs[0]) == 4  # past K and V of 2 layers, per loop
    assert {site.kind for site in prefill.sites} == {impl}
    if impl == "eager":
        assert_expected_inline(decode.summary(), """\
recurrent block: R=4 loops x N=2 layers, 163 nodes per loop, 25 shared weights
state: H[0] = embedding f32[2, 1, 128]; H[r] = mul f32[2, 1, 128]
loop inputs: mul f32[1, 10], .to f32[1, 1, 64], .to f32[1, 1, 64]
per-loop inputs: 4 per loop
positions: none
exit gate: linear -> f32[2, 1, 1] per loop
coda: getitem, linear
attention sites:
  8 sites (loop 1, layer 0)..(loop 4, layer 1): eager: q f32[2, 2, 1, 64] k f32[2, 2, 10, 64]; kv concat past f32[2, 2, 9, 64]; mask causal-position; query_len 1
""")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_mask_from_the_masking_utilities_under_vmap_is_a_position_comparison(impl):
    # the published Ouro code builds its mask with transformers' masking utilities: kv_idx <= q_idx
    # vmapped over batch, head, query and key (Dynamo: _add_batch_dim / _remove_batch_dim)
    hf = HFStyleOuro.from_flashloop(tiny(), attn_implementation=impl, mask_implementation="masking_utils").eval()
    ids, _ = ragged_batch([9, 9])
    padding = torch.ones(2, 9, dtype=torch.long)
    padding[0, :3] = 0
    cache = LoopedDynamicCache()
    with torch.no_grad():
        hf(ids, past_key_values=cache)
    graphs = {
        "prefill": capture(hf, ids),
        "padded prefill": capture(hf, ids, attention_mask=padding),
        "decode": capture(hf, ids[:, :1], past_key_values=cache),
    }
    for name, gm in graphs.items():
        assert any(op_name(n) == "_add_batch_dim" for n in gm.graph.nodes), name
        s = recognize(gm)
        assert (s.num_loops, s.num_layers) == (4, 2), name
        assert all(site.mask is not None for site in s.sites), name
        assert {site.mask_kind for site in s.sites} == {"causal-position"}, name
    assert {site.cache.kind for site in recognize(graphs["decode"]).sites} == {"concat"}


def _compile_error(model, config, *args, **kwargs) -> BaseException:
    torch._dynamo.reset()
    with pytest.raises(Exception) as info, torch.no_grad():
        torch.compile(model, backend=make_backend(config, inner="eager"), fullgraph=True)(*args, **kwargs)
    torch._dynamo.reset()
    err = info.value
    return getattr(err, "inner_exception", err)


def test_model_without_loops_with_a_feature_requested_is_an_error():
    model = LlamaStyleForCausalLM(tiny().config).eval()
    ids, _ = ragged_batch([1])
    err = _compile_error(model, FlashLoopConfig.from_switches(False, True, False), ids)
    assert isinstance(err, NoRecurrentBlockError)
    assert "no recurrent block found" in str(err) and "all features off" in str(err)


class LoopedLlama(torch.nn.Module):
    """A looped model that is not Ouro: a Llama-style stack applied three times, each loop ending
    with the residual add (no end-of-loop norm), one final norm."""

    def __init__(self, config, loops: int = 3) -> None:
        super().__init__()
        self.inner = LlamaStyleForCausalLM(config)
        self.loops = loops

    def forward(self, ids):
        m = self.inner.model
        h = m.embed_tokens(ids)
        pos = torch.arange(ids.shape[1])
        mask = m._update_causal_mask(None, h, pos, None)
        rope = m.rotary_emb(h, pos[None])
        for _ in range(self.loops):
            for layer in m.layers:
                h = layer(h, attention_mask=mask, cache_position=pos, position_embeddings=rope)
        return self.inner.lm_head(m.norm(h))


def test_looped_model_that_is_not_ouro_with_a_feature_requested_is_an_error():
    model = LoopedLlama(tiny().config).eval()
    ids, _ = ragged_batch([6, 6])
    err = _compile_error(model, FlashLoopConfig.from_switches(False, True, False), ids)
    assert isinstance(err, NoRecurrentBlockError)
    msg = str(err)
    assert "no supported recurrent block" in msg and "unsupported" in msg and "all features off" in msg
    assert "node '" in msg


def test_single_loop_ouro_with_a_feature_requested_is_an_error():
    hf = HFStyleOuro.from_flashloop(tiny(), total_ut_steps=1).eval()
    ids, _ = ragged_batch([3])
    err = _compile_error(hf, FlashLoopConfig.from_switches(False, True, False), ids)
    assert isinstance(err, NoRecurrentBlockError)


@pytest.mark.parametrize(
    "variant, reason",
    [
        (dict(use_sliding_window=True, sliding_window=4), "sliding-window"),
        (dict(position_embedding_type="alibi"), "ALiBi"),
    ],
)
def test_unsupported_attention_variant_names_node_and_reason(variant, reason):
    hf = HFStyleOuro.from_flashloop(tiny(), attn_implementation="eager", **variant).eval()
    ids, _ = ragged_batch([6, 6])
    cache = LoopedDynamicCache()
    with torch.no_grad():
        hf(ids, past_key_values=cache)
    err = _compile_error(hf, FlashLoopConfig.from_switches(False, True, False), ids[:, :1], past_key_values=cache)
    assert isinstance(err, UnsupportedAttentionError)
    msg = str(err)
    assert reason in msg and "node '" in msg and "(loop 2, layer 0)" in msg


@pytest.mark.parametrize(
    "model_fn",
    [
        lambda: LlamaStyleForCausalLM(tiny().config).eval(),
        lambda: HFStyleOuro.from_flashloop(tiny(), attn_implementation="eager", position_embedding_type="alibi").eval(),
        lambda: HFStyleOuro.from_flashloop(tiny(), use_sliding_window=True, sliding_window=4).eval(),
    ],
)
def test_features_off_compiles_any_model_exactly(model_fn):
    # no recognition with features off: the only rewrite, the projection fusion, applies to any model
    model = model_fn()
    ids, _ = ragged_batch([6, 6])
    with torch.no_grad():
        expected = model(ids)[0]
        torch._dynamo.reset()
        got = torch.compile(model, backend=make_backend(None, inner="eager"), fullgraph=True)(ids)[0]
    torch._dynamo.reset()
    assert last_report().fused_gemms > 0
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)  # the fused GEMMs' reduction order
