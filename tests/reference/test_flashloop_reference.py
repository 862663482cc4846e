"""The explicit FlashLoop reference engine against the dense model, and its selection contracts.

Tolerances: the reference computes FP32 attention with materialized probabilities and the model
uses SDPA, so dense-vs-model comparisons allow FP32 round-off, ATOL = RTOL = 1e-5 (logits are
O(1)). Results that must not depend on request order are compared exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashloop_compile.config import ConfigError, FlashLoopConfig
from flashloop_compile.models.ouro import Readout
from flashloop_compile.reference import DenseKVStore, QuantizedKVStore, ReferenceFlashLoop

ATOL = RTOL = 1e-5
R = 4  # loops of the tiny preset


def tokens(n: int, seed: int, vocab: int = 256) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def run(engine: ReferenceFlashLoop, prompt: torch.Tensor, decode: list[torch.Tensor]):
    """Prefill then teacher-forced decode forwards; every StepRecord."""
    req = engine.request()
    recs = [req.prefill(prompt)]
    recs += [req.decode(t) for t in decode]
    return req, recs


def tsp(**kw) -> FlashLoopConfig:
    """Token-sparse prefill only (quantization and sparse decode off), with overrides."""
    flat = {"token_sparse_prefill.enabled": True}
    flat.update({f"token_sparse_prefill.{k}": v for k, v in kw.items()})
    return FlashLoopConfig.from_dict(flat)


READOUTS = {
    "last": Readout(),
    "step1": Readout.exit_at_step(1),
    "step2": Readout.exit_at_step(2),
    "step3": Readout.exit_at_step(3),
    "weighted": Readout("weighted"),
    "threshold": Readout.at_threshold(0.5),
}


# -- all off is the model --------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(READOUTS))
def test_all_off_equals_model(tiny_model, name):
    readout = READOUTS[name]
    prompt = tokens(37, seed=1)
    decode = [tokens(1, seed=2), tokens(1, seed=3), tokens(3, seed=4), tokens(1, seed=5)]
    _, recs = run(ReferenceFlashLoop(tiny_model, readout=readout), prompt, decode)
    seq = torch.cat([prompt, *decode])
    with torch.no_grad():
        full = tiny_model(seq[None], readout=readout)[0]
    torch.testing.assert_close(recs[0].logits, full[:37], atol=ATOL, rtol=RTOL)
    start = 37
    for t, rec in zip(decode, recs[1:]):
        assert rec.logits.shape == (len(t), 256)
        torch.testing.assert_close(rec.logits, full[start : start + len(t)], atol=ATOL, rtol=RTOL)
        start += len(t)
    n_loops = readout.loops_to_run(R)
    for rec in recs:
        assert len(rec.states) == len(rec.active) == n_loops
        assert all(a.all() for a in rec.active) and rec.reference == []


def test_all_off_states_equal_model_loop_states(tiny_model):
    prompt = tokens(50, seed=6)
    rec = ReferenceFlashLoop(tiny_model).request().prefill(prompt)
    with torch.no_grad():
        states, gates = tiny_model.forward_loops(prompt[None], readout=Readout("weighted"))
    for d in range(R):
        torch.testing.assert_close(rec.states[d], states[d][0], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(rec.gate_logits[d], gates[d][0], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("window", [None, 16])
def test_full_retention_and_full_key_fraction_equal_dense(tiny_model, window):
    cfg = FlashLoopConfig.from_dict(
        {
            "token_sparse_prefill.enabled": True,
            "token_sparse_prefill.retention": [1, 1, 1, 1],
            "token_sparse_prefill.window": window,
            "sparse_decode_attention.enabled": True,
            "sparse_decode_attention.key_fraction": [1.0],
        }
    )
    prompt = tokens(100, seed=7)
    decode = [tokens(1, seed=8 + i) for i in range(4)] + [tokens(3, seed=12)]
    _, sparse = run(ReferenceFlashLoop(tiny_model, cfg), prompt, decode)
    _, dense = run(ReferenceFlashLoop(tiny_model), prompt, decode)
    for s, d in zip(sparse, dense):
        torch.testing.assert_close(s.logits, d.logits, atol=ATOL, rtol=RTOL)
        assert all(a.all() for a in s.active)
    # The sparse-decode correction path really ran, and with every key kept m = 1.
    start = 100
    for t, rec in zip(decode, sparse[1:]):
        assert len(rec.reference) == 2 and len(rec.reference[0]) == R - 2
        for layer in rec.reference:
            for st in layer:
                assert torch.equal(st.count, torch.arange(start + 1, start + 1 + len(t)))  # every causal key
                torch.testing.assert_close(st.mass, torch.ones_like(st.mass), atol=1e-5, rtol=0)
        start += len(t)
    seq = torch.cat([prompt, *decode])
    with torch.no_grad():
        full = tiny_model(seq[None])[0]
    torch.testing.assert_close(sparse[-1].logits, full[-3:], atol=ATOL, rtol=RTOL)


# -- all 8 feature combinations --------------------------------------------------------------------


SWITCHES = [(a, b, c) for a in (False, True) for b in (False, True) for c in (False, True)]


@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: "".join("TSQ"[i] if on else "-" for i, on in enumerate(s)))
def test_feature_combinations_run(tiny_model, switches):
    token_sparse, sparse_decode, quantize = switches
    engine = ReferenceFlashLoop(tiny_model, FlashLoopConfig.from_switches(*switches))
    req = engine.request()
    rec = req.prefill(tokens(200, seed=13))
    assert rec.logits.shape == (200, 256) and torch.isfinite(rec.logits).all()
    counts = [int(a.sum()) for a in rec.active]
    # Global selection: ceil(0.25 * 200) = 50, ceil(0.10 * 200) = 20.
    assert counts == ([200, 200, 50, 20] if token_sparse else [200] * 4)
    tok = rec.logits[-1].argmax()
    for _ in range(3):
        rec = req.decode(tok[None])
        assert rec.logits.shape == (1, 256) and torch.isfinite(rec.logits).all()
        assert (len(rec.reference) == 2) == sparse_decode
        tok = rec.logits[-1].argmax()
    assert req.length == 203
    nbytes = req.store.nbytes()
    if quantize:
        assert isinstance(req.store, QuantizedKVStore)
        assert nbytes.ratio > 1 and nbytes.payload > 0 and nbytes.params > 0
    else:
        assert isinstance(req.store, DenseKVStore) and nbytes.ratio == 1


def test_token_sparsity_shrinks_the_quantized_store(tiny_model):
    prompt = tokens(256, seed=14)
    sizes = {}
    for token_sparse in (False, True):
        req = ReferenceFlashLoop(tiny_model, FlashLoopConfig.from_switches(token_sparse, False, True)).request()
        req.prefill(prompt)
        sizes[token_sparse] = req.store.nbytes()
    assert sizes[True].payload < sizes[False].payload
    assert sizes[True].dense_equivalent == sizes[False].dense_equivalent


# -- token-sparse prefill --------------------------------------------------------------------------


def _scores(h_prev: torch.Tensor, h_prev2: torch.Tensor) -> torch.Tensor:
    a, b = h_prev.double(), h_prev2.double()
    return (a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(1e-6)


@pytest.mark.parametrize(
    "window, budgets",
    [
        (None, [[200], [200], [50], [20]]),
        # windows [0,64) [64,128) [128,192) [192,200): ceil(.25*64)=16, ceil(.1*64)=7, ceil(.25*8)=2, ceil(.1*8)=1
        (64, [[64, 64, 64, 8], [64, 64, 64, 8], [16, 16, 16, 2], [7, 7, 7, 1]]),
    ],
)
def test_active_sets_nested_exact_budgets_and_top_scores(tiny_model, window, budgets):
    rec = ReferenceFlashLoop(tiny_model, tsp(window=window)).request().prefill(tokens(200, seed=15))
    bounds = [(0, 200)] if window is None else [(lo, min(lo + window, 200)) for lo in range(0, 200, window)]
    for d in range(R):
        assert [int(rec.active[d][lo:hi].sum()) for lo, hi in bounds] == budgets[d]
        if d:
            assert not (rec.active[d] & ~rec.active[d - 1]).any(), "active sets must be nested"
    # Each window keeps its highest change scores among the previous loop's active tokens.
    for d in (2, 3):
        score = _scores(rec.states[d - 1], rec.states[d - 2])
        for lo, hi in bounds:
            s, kept, cand = score[lo:hi], rec.active[d][lo:hi], rec.active[d - 1][lo:hi]
            assert s[kept].min() > s[cand & ~kept].max()


def test_inactive_rows_keep_state_and_kv(tiny_model):
    rec = ReferenceFlashLoop(tiny_model, tsp(window=64)).request().prefill(tokens(200, seed=16))
    for d in (2, 3):
        act = rec.active[d]
        assert torch.equal(rec.states[d][~act], rec.states[d - 1][~act])
        assert (rec.states[d][act] != rec.states[d - 1][act]).any(-1).all()
        for layer in range(len(rec.k)):
            assert torch.equal(rec.k[layer][d][~act], rec.k[layer][d - 1][~act])
            assert torch.equal(rec.v[layer][d][~act], rec.v[layer][d - 1][~act])
            assert (rec.k[layer][d][act] != rec.k[layer][d - 1][act]).flatten(1).any(-1).all()
    # Loops 1 and 2 are dense and equal the model's.
    with torch.no_grad():
        states, _ = tiny_model.forward_loops(tokens(200, seed=16)[None])
    for d in (0, 1):
        torch.testing.assert_close(rec.states[d], states[d][0], atol=ATOL, rtol=RTOL)


def test_store_holds_the_logical_kv(tiny_model):
    req = ReferenceFlashLoop(tiny_model, tsp()).request()
    rec = req.prefill(tokens(120, seed=17))
    for layer in range(2):
        for d in range(R):
            k, v = req.store.read(layer, d, 120)
            assert torch.equal(k, rec.k[layer][d]) and torch.equal(v, rec.v[layer][d])


def _prompt_with_unselected_last_token(tiny_model, cfg):
    for seed in range(100, 140):
        prompt = tokens(200, seed=seed)
        rec = ReferenceFlashLoop(tiny_model, cfg).request().prefill(prompt)
        if not rec.active[3][-1]:
            return prompt, rec
    raise AssertionError("no prompt found whose last token is inactive at loop 4")


def test_unselected_last_token_reads_out_its_inherited_state(tiny_model):
    prompt, rec = _prompt_with_unselected_last_token(tiny_model, tsp())
    last_depth = max(d for d in range(R) if rec.active[d][-1])
    assert last_depth < 3
    for d in range(last_depth + 1, R):
        assert torch.equal(rec.states[d][-1], rec.states[last_depth][-1])
    with torch.no_grad():
        expected = tiny_model.lm_head(rec.states[last_depth])[-1]
    assert torch.isfinite(rec.logits[-1]).all()
    torch.testing.assert_close(rec.logits[-1], expected, rtol=0, atol=0)
    # Decode continues from the prompt with its inherited KV and stays finite.
    _, recs = run(ReferenceFlashLoop(tiny_model, tsp()), prompt, [rec.logits[-1].argmax()[None]])
    assert torch.isfinite(recs[1].logits).all()

    # keep_last_token (the paper's engine) keeps it at every loop, within the same budgets.
    kept = ReferenceFlashLoop(tiny_model, tsp(keep_last_token=True)).request().prefill(prompt)
    assert all(bool(a[-1]) for a in kept.active)
    assert [int(a.sum()) for a in kept.active] == [200, 200, 50, 20]


def test_keep_last_token_with_windows(tiny_model):
    # The prompt's last token sits in the final window [192, 200), whose loop-4 budget is 1.
    rec = ReferenceFlashLoop(tiny_model, tsp(window=64, keep_last_token=True)).request().prefill(tokens(200, seed=18))
    assert all(bool(a[-1]) for a in rec.active)
    assert rec.active[3][192:].tolist() == [False] * 7 + [True]
    assert [int(rec.active[3][lo : lo + 64].sum()) for lo in (0, 64, 128)] == [7, 7, 7]


# -- batch order and window regrouping -------------------------------------------------------------


def test_request_order_does_not_change_results(tiny_model):
    cfg = FlashLoopConfig.all_on(**{"token_sparse_prefill.window": 32})
    prompts = {"a": tokens(150, seed=19), "b": tokens(90, seed=20), "c": tokens(200, seed=21)}
    steps = {k: [tokens(1, seed=22 + i + 10 * j) for i in range(3)] for j, k in enumerate(prompts)}

    def schedule(order: list[str], engine: ReferenceFlashLoop):
        reqs = {k: engine.request() for k in order}
        out = {k: [reqs[k].prefill(prompts[k])] for k in order}
        for i in range(3):  # interleaved decode, in this order
            for k in order:
                out[k].append(reqs[k].decode(steps[k][i]))
        return out

    first = schedule(["a", "b", "c"], ReferenceFlashLoop(tiny_model, cfg))
    engine = ReferenceFlashLoop(tiny_model, cfg)
    second = schedule(["c", "a", "b"], engine)
    third = schedule(["b", "c", "a"], engine)  # same engine, more requests before
    for k in prompts:
        for x, y, z in zip(first[k], second[k], third[k]):
            assert torch.equal(x.logits, y.logits) and torch.equal(x.logits, z.logits)
            for ax, ay in zip(x.active, y.active):
                assert torch.equal(ax, ay)


@pytest.mark.parametrize(
    "chunks, length",
    [
        ([(0, 64), (64, 96), (96, 150)], 150),  # final window [128, 150) is short
        ([(0, 32), (32, 150)], 150),
        ([(0, 96), (96, 160)], 160),
    ],
)
def test_window_regrouping_keeps_selection(tiny_model, chunks, length):
    # Quantization off: with it on, a later chunk reads the earlier chunk's K/V from the packed
    # store (INT4 base + residuals, beyond the BF16 tail) while a one-shot prefill attends to the
    # exact in-flight values, so states may differ by quantization error and a near-tie in the
    # change scores may then select differently. Selection rules are the same; inputs are not.
    cfg = FlashLoopConfig.from_dict(
        {"token_sparse_prefill.enabled": True, "token_sparse_prefill.window": 32, "sparse_decode_attention.enabled": True}
    )
    prompt = tokens(length, seed=23)
    decode = [tokens(1, seed=24), tokens(2, seed=25)]
    one_req, one = run(ReferenceFlashLoop(tiny_model, cfg), prompt, decode)

    req = ReferenceFlashLoop(tiny_model, cfg).request()
    parts = [req.prefill(prompt[a:b], final=b == length) for a, b in chunks]
    for d in range(R):
        assert torch.equal(torch.cat([p.active[d] for p in parts]), one[0].active[d])
    assert [int(a.sum()) for a in one[0].active][2:] != [length, length]  # selection really ran
    torch.testing.assert_close(torch.cat([p.logits for p in parts]), one[0].logits, atol=ATOL, rtol=RTOL)
    for t, rec in zip(decode, one[1:]):
        torch.testing.assert_close(req.decode(t).logits, rec.logits, atol=ATOL, rtol=RTOL)


def test_misaligned_chunks_raise(tiny_model):
    req = ReferenceFlashLoop(tiny_model, tsp(window=32)).request()
    prompt = tokens(100, seed=26)
    with pytest.raises(ConfigError, match=r"prefill chunk \[0, 40\) does not align to token_sparse_prefill.window=32"):
        req.prefill(prompt[:40], final=False)
    # The failed call left the request untouched: aligned chunks still work.
    req.prefill(prompt[:32], final=False)
    with pytest.raises(ConfigError, match="does not align"):
        req.prefill(prompt[32:70], final=False)
    rec = req.prefill(prompt[32:], final=True)  # a final chunk may end mid-window
    assert rec.logits.shape == (68, 256)
    with pytest.raises(RuntimeError, match="prompt is complete"):
        req.prefill(prompt[:1])

    glob = ReferenceFlashLoop(tiny_model, tsp()).request()
    with pytest.raises(ConfigError, match="window=None"):
        glob.prefill(prompt[:32], final=False)


# -- sparse decode ---------------------------------------------------------------------------------


def test_sparse_decode_reference_statistics(tiny_model):
    cfg = FlashLoopConfig.from_switches(False, True, False)
    req = ReferenceFlashLoop(tiny_model, cfg).request()
    req.prefill(tokens(205, seed=27))
    rec = req.decode(tokens(6, seed=28))  # query positions 205..210: causal lengths 206..211
    expected = torch.tensor([math.ceil(0.1 * n - 1e-9) for n in range(206, 212)])
    assert expected.tolist() == [21, 21, 21, 21, 21, 22]
    assert len(rec.reference) == 2
    for layer in rec.reference:
        assert len(layer) == R - 2  # one state per sparse loop (3 and 4)
        for st in layer:
            assert torch.equal(st.count, expected)
            assert ((st.mass > 0) & (st.mass <= 1 + 1e-6)).all()
            for qi in range(6):
                keys = st.keys[qi, :, : st.count[qi]]
                assert ((keys >= 0) & (keys <= 205 + qi)).all(), "only causal keys are selected"
                assert all(len(set(row.tolist())) == len(row) for row in keys)
                assert (st.keys[qi, :, st.count[qi] :] == -1).all()


def test_multi_row_decode_equals_row_by_row(tiny_model):
    cfg = FlashLoopConfig.from_switches(False, True, False)
    prompt, new = tokens(150, seed=29), tokens(5, seed=30)
    req = ReferenceFlashLoop(tiny_model, cfg).request()
    req.prefill(prompt)
    together = req.decode(new)
    req2 = ReferenceFlashLoop(tiny_model, cfg).request()
    req2.prefill(prompt)
    one_by_one = torch.cat([req2.decode(new[i : i + 1]).logits for i in range(5)])
    assert together.logits.shape == (5, 256) and torch.isfinite(together.logits).all()
    torch.testing.assert_close(together.logits, one_by_one, atol=ATOL, rtol=RTOL)
    # Sparse decode is an approximation: it does change the result relative to dense.
    _, dense = run(ReferenceFlashLoop(tiny_model), prompt, [new])
    assert not torch.allclose(together.logits, dense[1].logits, atol=1e-4)


def test_exit_at_step_2_with_sparse_decode_stays_dense(tiny_model):
    prompt = tokens(120, seed=31)
    decode = [tokens(1, seed=32), tokens(2, seed=33)]
    sparse_cfg = FlashLoopConfig.from_switches(False, True, False)
    _, sparse = run(ReferenceFlashLoop(tiny_model, sparse_cfg, readout=Readout.exit_at_step(2)), prompt, decode)
    _, dense = run(ReferenceFlashLoop(tiny_model, readout=Readout.exit_at_step(2)), prompt, decode)
    for s, d in zip(sparse, dense):
        assert s.reference == []
        torch.testing.assert_close(s.logits, d.logits, rtol=0, atol=0)
    # exit_at_step=3 does reach a sparse loop.
    _, step3 = run(ReferenceFlashLoop(tiny_model, sparse_cfg, readout=Readout.exit_at_step(3)), prompt, decode)
    assert all(len(layer) == 1 for layer in step3[1].reference)


def test_reuse_selected_probabilities_reuses_loop_2_probabilities(tiny_model):
    """The reuse option: loops 3..R correct with loop 2's probabilities over S (renormalized over S)
    and their own V. Checked against its definition on the recorded K/V, and against the option off."""
    on = FlashLoopConfig.from_switches(False, True, False, **{"sparse_decode_attention.reuse_selected_probabilities": True})
    off = FlashLoopConfig.from_switches(False, True, False)
    prompt, new = tokens(130, seed=41), tokens(3, seed=42)
    _, (_, rec) = run(ReferenceFlashLoop(tiny_model, on), prompt, [new])
    _, (_, rec_off) = run(ReferenceFlashLoop(tiny_model, off), prompt, [new])
    assert torch.isfinite(rec.logits).all()
    # loops 1-2 are the same computation with the option on or off; loops 3..R differ
    torch.testing.assert_close(rec.states[1], rec_off.states[1], rtol=0, atol=0)
    assert not torch.allclose(rec.states[2], rec_off.states[2], atol=1e-4)
    for layer in rec.reference:
        for st in layer:
            torch.testing.assert_close(st.probs.sum(-1), st.mass, rtol=1e-5, atol=1e-6)
            assert (st.probs[st.keys < 0] == 0).all()
    # full key fraction: S holds every visible key (m = 1), so loop r attends with loop 2's probabilities
    full = FlashLoopConfig.from_switches(
        False, True, False,
        **{"sparse_decode_attention.reuse_selected_probabilities": True, "sparse_decode_attention.key_fraction": [1.0]},
    )
    _, (_, rec_full) = run(ReferenceFlashLoop(tiny_model, full), prompt, [new])
    st = rec_full.reference[0][0]
    torch.testing.assert_close(st.mass, torch.ones_like(st.mass), rtol=0, atol=1e-5)
