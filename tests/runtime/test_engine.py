"""Engine: ragged batched generation equals each prompt alone and the reference, for dense and
each feature; chunked prefill; sampling; stop tokens; errors; decode without a graph on request;
capture forwards that leave live requests alone (the CUDA-graph checks: tests/gpu/test_engine_gpu.py)."""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch

from flashloop_compile import backend
from flashloop_compile.backend import make_backend
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.reference import ReferenceFlashLoop
from flashloop_compile.runtime.engine import Engine, Sampling
from flashloop_compile.runtime.state import state_for_model
from passes.conftest import SMALL, small, tiny

PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (13, 30, 21)]


def _engine(model, config, max_batch=4, max_seq=96, **kw):
    torch._dynamo.reset()
    return Engine(model, config, max_batch=max_batch, max_seq=max_seq, backend=make_backend(config, inner="eager"), **kw)


@pytest.mark.parametrize(
    "switches",
    [(False, False, False), (True, False, False), (False, True, False), (True, True, False)],
    ids=["dense", "token_sparse", "sparse_decode", "both"],
)
def test_ragged_batch_equals_each_prompt_alone_and_the_reference(switches):
    model = small()
    config = FlashLoopConfig.from_switches(*switches, **{"token_sparse_prefill.window": 8, **SMALL})
    batch = _engine(model, config).generate(PROMPTS, 6).tokens
    single = _engine(model, config, max_batch=1)
    alone = [single.generate([p], 6).tokens[0] for p in PROMPTS]
    reference = [ReferenceFlashLoop(model, config).greedy(p, 6).tolist() for p in PROMPTS]
    assert batch == alone == reference


def test_position_attention_generates_what_the_reference_does():
    # compilation.position_attention (exact) with token-sparse prefill (loops 1-2 rewritten, loop 3
    # already position_attention): a ragged batch, one-shot and in chunks (later chunks attend to
    # the earlier ones through the cache), equals the reference. Dense alone: the pass tests.
    model = small()
    config = FlashLoopConfig.from_switches(True, False, False, **{"token_sparse_prefill.window": 8, **SMALL,
                                                                  "compilation.position_attention": True})
    one_shot = _engine(model, config).generate(PROMPTS, 6).tokens
    prefill = [r for r in backend._reports if r.phase == "prefill"]
    assert prefill and prefill[-1].matched.get("PositionAttentionPass") == 3  # every site of small's 3 x 1
    chunked = _engine(model, config, prefill_chunk=16).generate(PROMPTS, 6).tokens
    reference = [ReferenceFlashLoop(model, config).greedy(p, 6).tolist() for p in PROMPTS]
    assert one_shot == chunked == reference


def test_chunked_prefill_aligned_to_windows_equals_one_shot():
    model = small()
    config = FlashLoopConfig.from_switches(True, False, False, **{"token_sparse_prefill.window": 8, **SMALL})
    one_shot = _engine(model, config).generate(PROMPTS, 4).tokens
    chunked = _engine(model, config, prefill_chunk=16).generate(PROMPTS, 4).tokens
    assert chunked == one_shot


def test_seeded_sampling_is_reproducible_and_stop_tokens_are_per_request():
    model = small()
    eng = _engine(model, FlashLoopConfig())
    s = Sampling(temperature=0.8, top_p=0.9, seed=7)
    a = eng.generate(PROMPTS, 5, sampling=s).tokens
    b = eng.generate(PROMPTS, 5, sampling=s).tokens
    assert a == b
    greedy = eng.generate(PROMPTS, 5).tokens
    stops = [[greedy[0][1]], [], [greedy[2][0]]]
    stopped = eng.generate(PROMPTS, 5, stop_tokens=stops).tokens
    assert stopped[0] == greedy[0][:2] and stopped[1] == greedy[1] and stopped[2] == greedy[2][:1]


def test_more_prompts_than_max_batch_run_in_waves():
    model = small()
    eng = _engine(model, FlashLoopConfig(), max_batch=2)
    assert eng.generate(PROMPTS, 3).tokens == _engine(model, FlashLoopConfig()).generate(PROMPTS, 3).tokens


def test_errors_say_what_to_change():
    model = tiny()
    config = FlashLoopConfig.from_switches(True, False, False, **{"token_sparse_prefill.window": 8})
    with pytest.raises(ValueError, match="multiple of token_sparse_prefill.window"):
        _engine(model, config, prefill_chunk=12)
    with pytest.raises(ValueError, match="needs token_sparse_prefill.window"):
        _engine(model, FlashLoopConfig.from_switches(True, False, False), prefill_chunk=16)
    eng = _engine(model, FlashLoopConfig(), max_seq=32)
    with pytest.raises(ValueError, match="max_seq"):
        eng.generate([PROMPTS[1]], 8)


@pytest.mark.parametrize("switches", list(itertools.product([False, True], repeat=3)), ids=lambda s: "".join("TSQ"[i] if on else "-" for i, on in enumerate(s)))
def test_all_eight_combinations_match_the_reference_through_tail_flushes(switches):
    # prompts past 128 tokens and 66 new tokens: the tail flushes whole blocks during decode
    model = small()
    config = FlashLoopConfig.from_switches(*switches, **{"token_sparse_prefill.window": 32, **SMALL})
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (70, 131)]
    got = _engine(model, config, max_batch=2, max_seq=256).generate(prompts, 66).tokens
    assert got == [ReferenceFlashLoop(model, config).greedy(p, 66).tolist() for p in prompts]


@pytest.mark.parametrize("token_sparse, quantize", [(False, False), (False, True), (True, True)],
                         ids=["bf16_cache", "packed_cache", "all_on"])
def test_reuse_selected_probabilities_matches_the_reference_through_tail_flushes(token_sparse, quantize):
    model = small()  # loop 3 reuses loop 2's selected probabilities
    config = FlashLoopConfig.from_switches(token_sparse, True, quantize, **{
        "sparse_decode_attention.reuse_selected_probabilities": True, "token_sparse_prefill.window": 32, **SMALL})
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (70, 131)]
    got = _engine(model, config, max_batch=2, max_seq=256).generate(prompts, 66).tokens
    assert got == [ReferenceFlashLoop(model, config).greedy(p, 66).tolist() for p in prompts]


def test_packed_cache_is_the_only_kv_storage_and_overflow_is_an_error():
    model = tiny()
    config = FlashLoopConfig.all_on(**{"token_sparse_prefill.window": 32, "kv_residual_quantization.group_size": 16})
    # capacities planned for 4 new tokens (loop 4 keeps 10% of a prompt: 17 rows with the 4,
    # rounded up to groups of 16 plus a spare group: 48 compact rows); 100 generated tokens, all
    # active at every loop, need more
    eng = _engine(model, config, max_batch=2, max_seq=128, max_new_tokens=4)
    assert all(c.k_cache.untyped_storage().nbytes() <= 4 for c in model.model.kv_caches)
    mem = eng.memory()
    assert mem.packed is not None and mem.ratio > 1
    assert eng.generate([PROMPTS[1]], 4).tokens[0] == ReferenceFlashLoop(model, config).greedy(PROMPTS[1], 4).tolist()
    assert state_for_model(model).packed is eng.packed  # the compiled graphs took the engine's cache
    from flashloop_compile.runtime.packed_kv import PackedKVOverflowError

    with pytest.raises(PackedKVOverflowError, match="capacity"):
        eng.generate([PROMPTS[0][:8]], 100)


@pytest.mark.parametrize("switches", [(False, False, False), (True, True, True)], ids=["dense", "all_on"])
def test_capture_forwards_leave_live_requests_untouched(switches):
    # a bucket's graph is captured at its first decode step, with requests live in its slots: the
    # warm-up and capture forwards (what _capture runs on _capture_inputs) must not change them
    model = small()
    config = FlashLoopConfig.from_switches(*switches, **{"token_sparse_prefill.window": 32, **SMALL})
    eng = _engine(model, config, max_seq=256)
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (150, 70, 131)]
    if eng.packed is not None:
        eng.packed.reset()
    eng.prefill(prompts)
    before = {n: t.clone() for n, t in eng.state_tensors().items()}
    assert any(n.startswith("packed" if switches[2] else "dense") for n in before)
    with torch.no_grad():
        eng.compiled(*eng._capture_inputs(4))
    scratch = eng.max_seq - 1  # the only position the dense cache may take
    for name, got in eng.state_tensors().items():
        want = before[name]
        if name.startswith("dense"):
            want, got = want[:, :, :scratch], got[:, :, :scratch]
        assert torch.equal(want, got), f"capture inputs changed {name}"


def test_decode_graph_false_runs_the_compiled_model_without_a_graph():
    model = small()
    config = FlashLoopConfig.from_switches(False, True, False)
    tok, pos = torch.tensor([5, 6, 7]), torch.tensor([13, 30, 21])
    plain = _engine(model, config, cuda_graphs=False)
    plain.prefill(PROMPTS)
    expected = plain.decode(tok, pos)
    # cuda_graphs=True on the CPU: a graph step would capture (CUDA only); graph=False must not
    eng = _engine(model, config, cuda_graphs=True)
    captured = []

    def capture(bucket):
        captured.append(bucket)
        raise RuntimeError("capture")

    eng._capture = capture
    eng.prefill(PROMPTS)
    got = eng.decode(tok, pos, graph=False)
    assert captured == [] and eng.num_graphs == 0
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="capture"):
        eng.decode(tok, pos)  # the default path takes the bucket's graph: 3 rows -> bucket 4
    assert captured == [4]


def test_caches_are_freed_with_their_engine_and_its_compiled_code():
    # the backend keeps its recent rewrite reports: reports holding graph nodes kept the graph
    # modules alive, and with them the packed cache registered on each (GiBs past its engine)
    model = small()
    eng = _engine(model, FlashLoopConfig.all_on(**{"token_sparse_prefill.window": 32, **SMALL}), max_seq=256)
    eng.generate(PROMPTS[:2], 3)
    caches = [weakref.ref(t) for t in eng.state_tensors().values()]
    assert any(name.startswith("packed") for name in eng.state_tensors())
    del eng
    torch._dynamo.reset()
    model.clear_caches()
    gc.collect()
    assert all(ref() is None for ref in caches), "a cache outlived its engine and its compiled code"


@pytest.mark.parametrize("prompt, max_new_tokens, message", [
    (torch.rand(5), 2, r"prompt 0 has dtype torch.float32: token ids must be integers"),
    ([1.0, 2.0], 2, r"prompt 0 has dtype torch.float32: token ids must be integers"),
    (torch.ones(2, 3, dtype=torch.long), 2, r"prompt 0 has shape \(2, 3\): give each prompt as a 1-D sequence"),
    ([3, 256], 2, r"prompt 0 has token ids in \[3, 256\]: the model's vocabulary is \[0, 256\)"),
    ([-1, 4], 2, r"prompt 0 has token ids in \[-1, 4\]"),
    ([1, 2], 0, r"max_new_tokens must be a positive integer, got 0"),
    ([1, 2], 1.5, r"max_new_tokens must be a positive integer, got 1.5"),
])
def test_bad_prompts_and_token_counts_are_errors(prompt, max_new_tokens, message):
    """A float prompt was cast to zeros and max_new_tokens=0 returned one token."""
    engine = _engine(tiny(), FlashLoopConfig())
    with pytest.raises((TypeError, ValueError), match=message):
        engine.generate([prompt], max_new_tokens)


def test_engine_sizes_past_the_model_are_errors():
    model = tiny()  # max_position_embeddings=1024
    with pytest.raises(ValueError, match=r"max_seq=2048 exceeds the model's max_position_embeddings=1024: give max_seq <= 1024"):
        _engine(model, FlashLoopConfig(), max_seq=2048)
    with pytest.raises(ValueError, match=r"max_new_tokens=96 must be in \[1, max_seq=96\)"):
        _engine(model, FlashLoopConfig(), max_new_tokens=96)
    engine = _engine(model, FlashLoopConfig(), max_seq=64)
    with pytest.raises(ValueError, match=r"a prompt of 60 tokens \+ max_new_tokens=8 exceeds max_seq=64"):
        engine.generate([list(range(60))], 8)


@pytest.mark.parametrize("progress", [True, False])
def test_warm_up_compiles_ahead_and_shows_progress_when_asked(progress, capfd):
    model = small()
    config = FlashLoopConfig.all_on(**SMALL)
    engine = _engine(model, config, max_batch=2, max_seq=128, progress=progress)
    assert engine.warm_up(20, 2) > 0
    err = capfd.readouterr().err
    if progress:
        assert "warm-up (token_sparse_prefill+sparse_decode_attention+kv_residual_quantization)" in err
        assert "compiling prefill (first compile: about 1-6 min on CPU" in err and "compiling decode" in err
    else:
        assert err == ""
    # the warm-up leaves no state behind: generation equals the reference
    got = engine.generate(PROMPTS[:2], 4).tokens
    assert got == [ReferenceFlashLoop(model, config).greedy(p, 4).tolist() for p in PROMPTS[:2]]
