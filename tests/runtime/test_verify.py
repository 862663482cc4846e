"""Multi-query decode (speculative verification, runtime/verify.py, Engine.verify/accept): a step
of k tokens per row and the rollback of a suffix of it.

- The packed cache after a k-token write rolled back to n tokens equals a cache that was only
  written those n tokens (tails, row maps, counts, flushed blocks), with and without a flush inside
  the step, exactly.
- On the tiny preset cut to one layer of 3 loops (passes.conftest.small), for dense, sparse decode,
  KV quantization and all on: row j of a verify step equals the reference's multi-row decode and
  a decode of token j after tokens 0..j-1; after a partial acceptance, further decoding equals a
  run that only ever saw the accepted tokens.
- Bad k, bad n, accept without a verify step: errors that say what to change.
"""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.backend import last_report, make_backend
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.lowering.packed_layout import LAYER_TENSOR_NAMES
from flashloop_compile.lowering.packed_ops import packed_kv_write, packed_read
from flashloop_compile.reference import ReferenceFlashLoop
from flashloop_compile.runtime.engine import Engine
from flashloop_compile.runtime.packed_kv import PackedKVCache
from flashloop_compile.runtime.verify import StepUndo, flushed_after
from passes.conftest import SMALL, small

# -- the packed cache ------------------------------------------------------------------------------
NL, R, B, S, H, D, G = 2, 3, 2, 128, 2, 32, 16


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NL, R, B, H, n, D, generator=g)
    return k, torch.randn(NL, R, B, H, n, D, generator=g)


def _write(cache: PackedKVCache, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
    """Tokens start..start+n-1 of both rows, every depth of every layer (a decode step's writes)."""
    n = k.shape[-2]
    pos = torch.arange(start, start + n)[None].expand(B, -1).contiguous()
    for layer in range(NL):
        for d in range(R):
            packed_kv_write(cache, layer, k[layer, d].float(), v[layer, d].float(), pos, d)


def _live_state(cache: PackedKVCache, length: int) -> dict[str, torch.Tensor]:
    """What a reader can see of rows holding ``length`` tokens: counters, maps, every ring slot,
    the codes of flushed blocks and of the compact rows in use, and every depth's logical K/V."""
    out = {"rows": cache.rows.clone(), "depth_count": cache.depth_count.clone()}
    flushed = flushed_after(length, G)
    for layer in range(NL):
        t = dict(zip(LAYER_TENSOR_NAMES, cache.layer_tensors(layer)))
        for name in ("k_tail", "v_tail", "flushed", "row_count"):
            out[f"{layer}.{name}"] = t[name].clone()
        for name in ("k_base", "v_base", "v_base_min", "v_base_scale"):
            out[f"{layer}.{name}"] = t[name][:, :, :flushed].clone()
        for name in ("k_base_min", "k_base_scale"):
            out[f"{layer}.{name}"] = t[name][:, :, : flushed // G].clone()
        used = int(t["row_count"][:, 1:].max())
        for name in ("k_res", "v_res", "v_res_min", "v_res_scale"):
            out[f"{layer}.{name}"] = t[name][:, :, :used].clone()
        grid = torch.arange(length)[None].expand(B, -1)
        for d in range(R):
            out[f"{layer}.read{d}"] = torch.cat(packed_read(cache, layer, grid, d))
    return out


@pytest.mark.parametrize(
    "prefix,k,n",
    [(20, 4, 2), (30, 4, 1), (30, 4, 2), (30, 8, 0), (47, 8, 5), (5, 3, 0)],
    ids=["no-flush", "flush-undone", "flush-kept", "flush-all-rejected", "flush-at-the-last-kept", "short-row"],
)
def test_a_rolled_back_write_equals_a_cache_that_saw_only_the_accepted_tokens(prefix, k, n):
    # G = 16: the ring holds 16..31 tokens; a prefix of 30 plus 4 tokens flushes block 0..15, a
    # prefix of 30 plus 1 does not (the undone flush); 30 + 2 flushes (kept)
    kp, vp = _tokens(prefix, 0)
    ks, vs = _tokens(k, 1)
    caches = [PackedKVCache(NL, R, B, S, H, D, group_size=G, tail=G, dtype=torch.float32) for _ in range(2)]
    for c in caches:
        _write(c, kp, vp, 0)
    rolled, clean = caches
    undo = StepUndo.capture(rolled, [prefix, prefix], k)
    _write(rolled, ks, vs, prefix)
    for row in range(B):
        undo.roll_back(rolled, row, n)
    if n:
        _write(clean, ks[..., :n, :], vs[..., :n, :], prefix)
    a, b = _live_state(rolled, prefix + n), _live_state(clean, prefix + n)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # and both continue alike: the next tokens (a flush now or later) leave equal caches
    kn, vn = _tokens(20, 2)
    for c in caches:
        _write(c, kn, vn, prefix + n)
    a, b = _live_state(rolled, prefix + n + 20), _live_state(clean, prefix + n + 20)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# -- the engine on small() -----------------------------------------------------------------------
GROUP = 16  # the ring holds 16..31 tokens: row 0 (30 prompt tokens) flushes block 0..15 at length 32
PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (30, 21)]
K, CONTINUE = 4, 3  # draft tokens per verify step; greedy decode steps after the acceptance
# float32 on CPU: the same math in other GEMM shapes (k query rows against one)
ATOL = RTOL = 1e-5
# a row that reads a packed block quantized in one run and exact in the other: INT4 noise of one
# block (the largest seen on these prompts: 0.29 against logits of magnitude ~3)
FLUSH_ATOL = 0.5


def _config(name: str) -> FlashLoopConfig:
    switches = {"dense": (False, False, False), "sparse_decode": (False, True, False), "quant": (False, False, True),
                "all_on": (True, True, True)}[name]
    return FlashLoopConfig.from_switches(*switches, **{"token_sparse_prefill.window": 32, **SMALL,
                                                       "kv_residual_quantization.group_size": GROUP})


def _engine(model, config, max_batch=2, max_seq=64) -> Engine:
    torch._dynamo.reset()
    return Engine(model, config, max_batch=max_batch, max_seq=max_seq, backend=make_backend(config, inner="eager"))


def _save(engine: Engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.state_tensors().items()}


def _load(engine: Engine, state: dict[str, torch.Tensor]) -> None:
    for n, t in engine.state_tensors().items():
        t.copy_(state[n])


def _continue(engine: Engine, logits: torch.Tensor, pos: torch.Tensor) -> tuple[list[torch.Tensor], list[list[int]]]:
    """CONTINUE greedy decode steps from the logits [B, V] that pick the first token."""
    out, tokens = [], []
    for _ in range(CONTINUE):
        tok = logits.argmax(-1)
        tokens.append(tok.tolist())
        logits = engine.decode(tok, pos).clone()
        out.append(logits)
        pos = pos + 1
    return out, tokens


# (config, tokens kept): row 0's step crosses the flush at length 32 (kept with 3 tokens, undone
# with 1 or 0); row 1's never flushes
CASES = [("dense", 3), ("sparse_decode", 1), ("quant", 0), ("all_on", 3), ("all_on", 1)]


@pytest.mark.parametrize("name,n", CASES, ids=[f"{c}-keep{n}" for c, n in CASES])
def test_verify_rows_equal_decode_and_a_partial_acceptance_continues_as_if_only_those_tokens_were_fed(name, n):
    model = small()
    config = _config(name)
    quant, token_sparse = config.kv_residual_quantization.enabled, config.token_sparse_prefill.enabled
    engine = _engine(model, config)
    prompt_logits = engine.prefill(PROMPTS).clone()
    start = _save(engine)
    pos = torch.tensor([len(p) for p in PROMPTS])
    drafts = torch.randint(0, 256, (2, K), generator=torch.Generator().manual_seed(7))

    # row j of the step: a decode of token j after tokens 0..j-1, and the reference's multi-row decode
    seq = torch.stack([engine.decode(drafts[:, j], pos + j).clone() for j in range(K)], 1)
    _load(engine, start)
    verified = engine.verify(drafts, pos).clone()
    assert verified.shape == (2, K, model.config.vocab_size)
    if config.sparse_decode_attention.enabled:  # the k-row graph got the decode rewrites, not the prefill ones
        report = last_report()
        assert report.phase == "decode" and report.matched.get("SparseDecodeAttentionPass") == 2, report
        assert "TokenSparsePrefillPass" not in report.matched, report
    for row, prompt in enumerate(PROMPTS):
        req = ReferenceFlashLoop(model, config).request()
        req.prefill(prompt)
        ref = req.decode(drafts[row]).logits
        # under token-sparse prefill + KV quantization a step's depth-0 flush changes what later
        # depths read of tokens the prefill left inactive (the engine's decode does the same)
        tol = FLUSH_ATOL if (row == 0 and quant and token_sparse) else ATOL
        torch.testing.assert_close(verified[row], ref, atol=tol, rtol=RTOL)
        # a row whose step crosses a flush reads the block exactly where one-token decodes read it quantized
        flushes = quant and row == 0
        torch.testing.assert_close(verified[row, :2], seq[row, :2], atol=ATOL if not (flushes and token_sparse) else FLUSH_ATOL,
                                   rtol=RTOL)
        torch.testing.assert_close(verified[row, 2:], seq[row, 2:], atol=FLUSH_ATOL if flushes else ATOL, rtol=RTOL)

    # keep n tokens of both rows, then decode on
    for row in range(2):
        assert engine.accept(row, n) == len(PROMPTS[row]) + n
    first = verified[:, n - 1] if n else prompt_logits
    rolled, rolled_tokens = _continue(engine, first, pos + n)

    # a run that only ever saw the kept tokens: the same step of n tokens (a decode for one)
    _load(engine, start)
    if n >= 2:
        first = engine.verify(drafts[:, :n], pos)[:, n - 1].clone()
    elif n == 1:
        first = engine.decode(drafts[:, 0], pos).clone()
    else:
        first = prompt_logits
    clean, clean_tokens = _continue(engine, first, pos + n)
    assert rolled_tokens == clean_tokens
    for a, b in zip(rolled, clean):
        # row 0 under token-sparse prefill + KV quantization: its kept tokens were computed in a
        # step whose depth-0 flush the n-token step does not make (the leak above)
        torch.testing.assert_close(a[0], b[0], atol=FLUSH_ATOL if quant and token_sparse else ATOL, rtol=RTOL)
        torch.testing.assert_close(a[1], b[1], atol=ATOL, rtol=RTOL)


def test_bad_steps_and_acceptances_are_errors_that_say_what_to_change():
    model = small()
    config = _config("dense")
    engine = _engine(model, config)
    with pytest.raises(ValueError, match=r"accept\(row=0, n=1\): no verify step is open"):
        engine.accept(0, 1)
    engine.prefill(PROMPTS)
    pos = torch.tensor([len(p) for p in PROMPTS])
    tokens = torch.zeros(2, K, dtype=torch.long)
    with pytest.raises(ValueError, match=r"k in 2..8 tokens per row, got k=1: feed one token with decode\(\)"):
        engine.verify(tokens[:, :1], pos)
    with pytest.raises(ValueError, match=r"k in 2..8 tokens per row, got k=9"):
        engine.verify(torch.zeros(2, 9, dtype=torch.long), pos)
    with pytest.raises(ValueError, match=r"verify takes tokens \[B, k\]"):
        engine.verify(tokens[0], pos)
    with pytest.raises(TypeError, match="token ids must be integers"):
        engine.verify(tokens.float(), pos)
    with pytest.raises(ValueError, match=r"verify takes pos \[B=2\]"):
        engine.verify(tokens, pos[:1])
    with pytest.raises(ValueError, match=r"row 1 at position 61: a verify step of k=4 tokens needs .* position \+ k <= max_seq=64"):
        engine.verify(tokens, torch.tensor([30, 61]))
    with pytest.raises(ValueError, match=r"row 0 at position 0: .*needs a prefilled row"):
        engine.verify(tokens, torch.tensor([0, 21]))
    engine.verify(tokens, pos)
    for n in (5, -1, True, 1.0):
        with pytest.raises(ValueError, match=rf"accept\(row=0, n={n!r}\): n must be an int in 0..k=4"):
            engine.accept(0, n)
    with pytest.raises(ValueError, match=r"accept\(row=2, n=1\): the last verify step has rows 0..1"):
        engine.accept(2, 1)
    assert engine.accept(0, 2) == 32
    with pytest.raises(ValueError, match=r"accept\(row=0, n=2\): row 0 was already accepted"):
        engine.accept(0, 2)
    engine.decode(torch.zeros(2, dtype=torch.long), torch.tensor([32, 25]))
    with pytest.raises(ValueError, match=r"accept\(row=1, n=1\): no verify step is open"):
        engine.accept(1, 1)


def test_verify_needs_a_flashloop_backend():
    torch._dynamo.reset()
    engine = Engine(small(), FlashLoopConfig(), max_batch=1, max_seq=64, backend="eager")
    with pytest.raises(ValueError, match=r"verify needs the engine's backend to be flashloop_compile.backend.make_backend"):
        engine.verify(torch.zeros(1, 2, dtype=torch.long), torch.tensor([5]))
