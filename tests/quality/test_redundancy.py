"""The redundancy report: trajectory capture matches the reference, fields and ranges."""

from __future__ import annotations

import math

import torch

from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.quality.redundancy import collect_trajectory, redundancy_report, report_markdown, topk_mask_per_query
from flashloop_compile.reference import ReferenceFlashLoop
from flashloop_compile.reference.attention import attention_probs, reference_attention


def _seqs(n, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (t,), generator=g) for _ in range(n)]


def test_trajectory_matches_the_dense_reference(tiny_model):
    tokens = _seqs(1, 70)[0]
    tr = collect_trajectory(tiny_model, tokens)
    rec = ReferenceFlashLoop(tiny_model, FlashLoopConfig()).request().prefill(tokens)
    for r in range(4):
        torch.testing.assert_close(tr.states[r], rec.states[r].float(), rtol=1e-4, atol=1e-4)
        for i in range(2):
            torch.testing.assert_close(tr.k[r][i], rec.k[i][r].float(), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(tr.v[r][i], rec.v[i][r].float(), rtol=1e-4, atol=1e-4)
    assert tr.q[0][0].shape == (70, 2, 64)


def test_topk_mask_matches_the_reference_selection(tiny_model):
    tokens = _seqs(1, 40, seed=1)[0]
    tr = collect_trajectory(tiny_model, tokens)
    pos = torch.arange(40)
    q, k, v = tr.q[1][0], tr.k[1][0], tr.v[1][0]
    _, states = reference_attention(q, pos, k, v, pos, [0.2])
    mask = topk_mask_per_query(attention_probs(q, pos, k, pos), pos, pos, 0.2)
    st = states[0]
    for qi in range(40):
        for h in range(2):
            want = set(st.keys[qi, h, : st.count[qi]].tolist())
            assert set(torch.nonzero(mask[qi, h]).flatten().tolist()) == want


def test_report_fields_and_ranges(tiny_model):
    rep = redundancy_report(tiny_model, _seqs(2, 128))
    assert rep["sequences"] == 2 and rep["tokens"] == 256
    assert set(rep["state_change"]) == {"2", "3", "4"}
    for q in rep["state_change"].values():
        assert q["p10"] <= q["p50"] <= q["p90"] <= q["p99"] and q["mean"] > 0
    for r in ("3", "4"):
        for v in rep["change_energy_covered"][r].values():
            assert 0 <= v <= 1
    assert set(rep["nestedness"]) == {"3->4", "4->after-4"}
    for d in rep["nestedness"].values():
        assert 0 <= d["containment"] <= 1 and -1 <= d["spearman"] <= 1 and d["random_containment"] == 0.25
    am = rep["attention_mass"]
    assert set(am["previous"]) == {"2", "3", "4"} and set(am["reference"]) == {"3", "4"}
    for r in ("2", "3", "4"):
        assert 0 < am["previous"][r]["mean"] <= am["oracle"][r]["mean"] + 1e-6 <= 1 + 1e-6
        assert len(am["previous"][r]["per_layer_mean"]) == 2
    assert am["reference"]["3"]["mean"] == am["previous"]["3"]["mean"]  # loop 2 is loop 3's previous
    q = rep["int4_error"]
    for name in ("k", "v"):
        assert q[name]["full"]["1"] == q[name]["residual"]["1"]  # loop 1 is the base either way
        assert all(0 < e < 0.5 for e in q[name]["full"].values())
        assert len(q[name]["per_layer_residual"]["4"]) == 2
    md = report_markdown(rep)
    for heading in ("Hidden-state change", "Nestedness", "Attention mass", "INT4 relative error"):
        assert heading in md
    assert all(math.isfinite(x) for x in (rep["int4_error"]["k"]["residual"]["4"], am["oracle"]["4"]["p10"]))
