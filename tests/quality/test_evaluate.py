"""Evaluation: config names, retrieval prompts, the teacher-forced scoring's equivalence with
step-by-step decoding, the memoized quantized store, and the quality table on the tiny preset."""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch
import torch.nn.functional as F

from flashloop_compile.config import ConfigError, FlashLoopConfig
from flashloop_compile.quality.corpus import ByteTokenizer, Corpus
from flashloop_compile.quality.evaluate import (
    CONFIG_SETS,
    EvalSettings,
    build_retrieval_case,
    named_config,
    named_configs,
    new_request,
    parse_configs,
    ppl_stats,
    bootstrap_indices,
    quality_table,
    run_retrieval_case,
    score_document,
)
from flashloop_compile.reference import ReferenceFlashLoop

FILLER = b"".join(f"def f{i}(x):\n    return x + {i}\n".encode() for i in range(200))


def test_named_configs_resolve_and_cover_the_8_combinations():
    combos = named_configs("combos")
    assert len(combos) == 8 and len({c.switches for c in combos.values()}) == 8
    assert combos["dense"] == FlashLoopConfig() and combos["all-on"] == FlashLoopConfig.all_on()
    for name in CONFIG_SETS["full"]:
        named_config(name).resolve(4)
    c = named_config("all-on@retention=0.5/0.25@key_fraction=0.25@window=256@keep_last")
    assert c.token_sparse_prefill.retention == (1.0, 1.0, 0.5, 0.25)
    assert c.sparse_decode_attention.key_fraction == (0.25,)
    assert c.token_sparse_prefill.window == 256 and c.token_sparse_prefill.keep_last_token
    assert named_config("tsp@window=global").token_sparse_prefill.window is None
    assert named_config("all-on@reuse").sparse_decode_attention.reuse_selected_probabilities
    assert "all-on@reuse" in CONFIG_SETS["sweep"]
    for bad in ("nope", "all-on@bogus=1", "all-on@retention=0.5/0.9", "tsp@reuse"):
        with pytest.raises(ConfigError):
            named_config(bad)


def test_parse_configs_puts_dense_first_and_reads_json(tmp_path):
    path = tmp_path / "mine.json"
    cfg = FlashLoopConfig.from_switches(True, False, True)
    path.write_text(json.dumps(cfg.to_dict()))
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"config": cfg.to_dict(), "calibration": {}}))
    out = parse_configs(["all-on,tsp", str(path), str(wrapped)])
    assert list(out) == ["dense", "all-on", "tsp", "mine", "wrapped"]
    assert out["mine"] == cfg == out["wrapped"]


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_retrieval_case_places_needle_and_query(depth):
    tok = ByteTokenizer()
    case = build_retrieval_case(FILLER, 512, depth, random.Random(3), tok)
    ids = case.tokens.tolist()
    assert len(ids) == 512 and ids[0] == tok.bos_id
    assert bytes(ids[case.needle_pos : case.needle_pos + len(case.needle)]) == case.needle
    assert case.needle == f'{case.key} = "{case.value}"\n'.encode()
    assert bytes(ids[-len(case.query):]) == case.query == f'\n{case.key} = "'.encode()
    assert case.key.encode() not in FILLER and len(case.value) == 6
    assert ids[case.needle_pos - 1] == ord("\n") or case.needle_pos == 1  # at a line boundary
    body = bytes(ids[1 : -len(case.query)]).replace(case.needle, b"", 1)
    assert FILLER.startswith(body)  # the rest is the filler, in order
    assert abs(case.depth - depth) < 0.1


def test_retrieval_depth_orders_needle_positions():
    tok = ByteTokenizer(256)
    pos = [build_retrieval_case(FILLER, 400, d, random.Random(0), tok).needle_pos for d in (0.1, 0.5, 0.9)]
    assert pos == sorted(pos) and pos[0] < 80 and pos[-1] > 300


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_multi_needle_case_holds_distinct_needles_and_asks_the_first(depth):
    tok = ByteTokenizer()
    single = build_retrieval_case(FILLER, 512, depth, random.Random(3), tok)
    case = build_retrieval_case(FILLER, 512, depth, random.Random(3), tok, needles=4)
    ids = case.tokens.tolist()
    assert len(ids) == 512 and ids[0] == tok.bos_id
    # the asked needle is drawn first, so it is the single-needle case's, and it sits where needle_pos says
    assert (case.key, case.value) == (single.key, single.value)
    assert bytes(ids[case.needle_pos : case.needle_pos + len(case.needle)]) == case.needle
    assert bytes(ids[-len(case.query):]) == case.query == f'\n{case.key} = "'.encode()
    text = bytes(ids[1 : -len(case.query)])
    lines = [ln for ln in text.split(b"\n") if ln.startswith(b"needle_")]
    assert len(lines) == 4 and len({ln.split(b" = ")[0] for ln in lines}) == 4  # four distinct keys
    assert text.count(case.key.encode()) == 1  # the asked key appears once before the question
    body = text
    for ln in lines:
        body = body.replace(ln + b"\n", b"", 1)
    assert FILLER.startswith(body)  # the rest is the filler, in order
    assert abs(case.depth - depth) < 0.15


def test_multi_needle_settings_are_checked():
    with pytest.raises(ValueError, match="multi_needles must be 0"):
        EvalSettings(multi_needles=1)
    with pytest.raises(ValueError, match="too short for 8 needle"):
        build_retrieval_case(FILLER, 100, 0.5, random.Random(0), ByteTokenizer(), needles=8)


@pytest.mark.parametrize("name", ["dense", "all-on"])
def test_teacher_forced_retrieval_equals_greedy_decoding(tiny_model, name):
    engine = ReferenceFlashLoop(tiny_model, named_config(name))
    case = build_retrieval_case(FILLER, 192, 0.3, random.Random(1), ByteTokenizer(256))
    greedy = engine.greedy(case.tokens, 5).tolist()
    hit = dataclasses.replace(case, value=bytes(greedy).decode("latin-1"))
    assert run_retrieval_case(engine, hit) == (1, 1.0)
    assert run_retrieval_case(engine, hit, greedy=True) == (1, 1.0)
    miss = dataclasses.replace(case, value=bytes(greedy[:-1] + [(greedy[-1] + 1) % 256]).decode("latin-1"))
    assert run_retrieval_case(engine, miss) == (0, 0.8)
    assert run_retrieval_case(engine, miss, greedy=True)[0] == 0


def test_memoized_quantized_store_reads_the_same_values(tiny_model):
    engine = ReferenceFlashLoop(tiny_model, FlashLoopConfig.all_on())
    tokens = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0))
    plain, memo = engine.request(), new_request(engine)
    assert type(memo.store).__name__ == "MemoizedQuantizedKVStore"
    a, b = plain.prefill(tokens[:150]), memo.prefill(tokens[:150])
    assert torch.equal(a.logits, b.logits)
    for _ in range(2):
        a, b = plain.decode(tokens[150:170]), memo.decode(tokens[150:170])
        assert torch.equal(a.logits, b.logits)
    for layer in range(2):
        for depth in range(4):
            ka, va = plain.store.read(layer, depth, 150)
            kb, vb = memo.store.read(layer, depth, 150)
            assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_dense_document_score_matches_the_model_forward(tiny_model):
    tokens = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(2))
    s = score_document(ReferenceFlashLoop(tiny_model), tokens, 80, 20)
    assert (s.prefill_n, s.cont_n) == (79, 20)
    with torch.no_grad():
        logp = F.log_softmax(tiny_model(tokens[None])[0].float(), -1)
    nll = -logp[:-1].gather(-1, tokens[1:, None]).squeeze(-1)
    assert s.prefill_nll == pytest.approx(float(nll[:79].sum()), rel=1e-4)
    assert s.cont_nll == pytest.approx(float(nll[79:99].sum()), rel=1e-4)


def test_bootstrap_stats():
    idx = bootstrap_indices(5, 200, 0)
    assert idx.shape == (200, 5) and int(idx.max()) < 5
    nll, n = [10.0, 12.0, 9.0, 11.0, 10.5], [10] * 5
    same = ppl_stats(nll, n, nll, n, idx)
    assert same["delta_pct"] == 0 and same["delta_lo"] == 0 and same["delta_hi"] == 0
    assert same["ppl_lo"] <= same["ppl"] <= same["ppl_hi"]
    worse = ppl_stats([x + 1 for x in nll], n, nll, n, idx)
    assert worse["delta_pct"] == pytest.approx((math.exp(0.1) - 1) * 100)
    assert worse["delta_lo"] == pytest.approx(worse["delta_hi"])  # a constant shift has no spread


SMALL = EvalSettings(docs=2, contexts=(96,), continuation=8, retrieval_context=128, depths=(0.2, 0.8),
                     retrieval_trials=2, n_boot=100)


def test_quality_table_on_the_tiny_preset(tiny_model):
    configs = parse_configs(["all-on"])
    report = quality_table(tiny_model, configs, SMALL, corpus=Corpus(), model_name="tiny")
    assert [r["config"] for r in report.rows] == ["dense", "all-on"]
    for row in report.rows:
        for key in ("cont@96", "prefill@96"):
            st = row[key]
            assert all(math.isfinite(v) for v in st.values()), st
            assert st["ppl_lo"] <= st["ppl"] <= st["ppl_hi"] and st["delta_lo"] <= st["delta_hi"]
        for key in ("retrieval@0.2", "retrieval@0.8", "retrieval@all"):
            st = row[key]
            assert 0 <= st["acc"] <= 100 and st["acc_lo"] <= st["acc"] <= st["acc_hi"]
    dense = report.rows[0]
    assert dense["cont@96"]["delta_pct"] == 0 and dense["retrieval@all"]["delta_pts"] == 0
    assert len(report.perplexity["96"]["all-on"]["cont_nll"]) == 2
    assert len(report.retrieval["0.2"]["all-on"]["exact"]) == 2
    md = report.to_markdown()
    assert "| `all-on` |" in md and "Δ% C=96" in md and "acc d=0.8" in md
    assert "Multi-needle" not in md and not report.multi_retrieval
    json.dumps(report.to_json())


def test_quality_table_multi_needle_column(tiny_model):
    settings = dataclasses.replace(SMALL, contexts=(), depths=(0.5,), multi_needles=3)
    report = quality_table(tiny_model, parse_configs(["sda"]), settings, corpus=Corpus(), model_name="tiny")
    plain = quality_table(tiny_model, parse_configs(["sda"]), dataclasses.replace(settings, multi_needles=0),
                          corpus=Corpus(), model_name="tiny")
    assert report.retrieval == plain.retrieval  # adding the multi-needle prompts leaves the single-needle ones
    assert len(report.multi_retrieval["0.5"]["sda"]["exact"]) == 2
    for row in report.rows:
        for key in ("multi@0.5", "multi@all"):
            assert 0 <= row[key]["acc"] <= 100
        assert 0 <= row["multi_chars"] <= 100
    assert report.rows[0]["multi@all"]["delta_pts"] == 0
    md = report.to_markdown()
    assert "Multi-needle retrieval exact match (%), context 128: 3 needles per prompt" in md
    json.dumps(report.to_json())


def test_quality_table_time_budget_skips_configs(tiny_model):
    settings = dataclasses.replace(SMALL, depths=(), retrieval_trials=0)
    report = quality_table(tiny_model, parse_configs(["tsp", "sda"]), settings, corpus=Corpus(), max_seconds=0.0)
    assert [r["config"] for r in report.rows] == ["dense"] and report.skipped == ["tsp", "sda"]
    assert "Not evaluated (time budget)" in report.to_markdown()


def test_compiled_engine_scores_and_retrieves_what_the_reference_does(monkeypatch):
    # the production path behind the harness: quality_table(engine="compiled") gives the
    # reference's perplexities and retrieval, and its agreement table shows compiled == reference
    # logits. Inductor is swapped for eager execution of the rewritten graph (the flashloop ops run
    # their kernels either way) so that the test does not spend minutes compiling
    from flashloop_compile.backend import make_backend
    from flashloop_compile.models.ouro import OuroForCausalLM
    from flashloop_compile.quality import evaluate

    class EagerCompiledEngine(evaluate.CompiledEngine):
        def __init__(self, model, config, max_seq):
            super().__init__(model, config, max_seq, backend=make_backend(config, inner="eager"))

    monkeypatch.setattr(evaluate, "CompiledEngine", EagerCompiledEngine)
    model = OuroForCausalLM.from_preset("tiny", dtype=torch.float32, seed=0).eval()
    docs = {150: [torch.randint(0, 256, (170,), generator=torch.Generator().manual_seed(5))]}
    settings = EvalSettings(docs=1, contexts=(150,), continuation=20, retrieval_context=192, depths=(0.5,),
                            retrieval_trials=1, n_boot=20, agreement_docs=1)
    configs = {"all-on": named_config("all-on")}
    want = quality_table(model, configs, settings, documents=docs, fillers=[FILLER])
    got = quality_table(model, configs, settings, documents=docs, fillers=[FILLER], engine="compiled")
    for name in ("dense", "all-on"):
        for key in ("cont_nll", "prefill_nll"):
            assert got.perplexity["150"][name][key] == pytest.approx(want.perplexity["150"][name][key], rel=1e-4)
        assert got.retrieval["0.5"][name] == want.retrieval["0.5"][name]
        a = got.agreement[name]["150"]
        assert a["token_agreement"] == 100.0 and a["max_rel_err"] < 1e-4 and a["rows"] == 169 and a["docs"] == 1
    assert not want.agreement and got.settings["engine"] == "compiled"
    md = got.to_markdown()
    assert "the compiled engine" in md and "| `all-on` | 150 | 1 | 100.00 |" in md
    with pytest.raises(ValueError, match="engine must be one of"):
        quality_table(model, {}, engine="fast")
