"""Prefix reuse (Engine.reuse_prefix, Engine.prefill(cached=)): a prompt whose first tokens another
row holds starts from a device copy of that row's cache and prefills only the rest.

- Features off, KV quantization, token-sparse prefill, all on: the request equals the engine
  prefilling the prefix and then the rest as a chunk (tokens equal, logits close), and the
  reference doing so (but where the engine's own chunked prefill deviates from it: token-sparse
  prefill with KV quantization, a chunk that flushes a block of the prefix's tail); without KV
  quantization it equals prefilling the whole prompt at once. A shared length off a window
  boundary is reused as the boundary below it. A fresh prompt next to a cached one equals the
  reference; the source row is untouched, and a copy writes nothing but its destination row.
- In the same engine, a request continued from a row's generated tokens (a conversation's next
  turn) equals that row continued in place; under KV quantization that row, having flushed past
  a shorter prefix, can no longer give it.
- Errors, before anything is written: rows out of range or equal, an empty source or a prefix
  longer than it holds, a row whose verify step awaits accept (busy), a packed source that flushed
  past the prefix, token-sparse selection without a window, bad ``cached`` counts.
"""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.backend import make_backend
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.reference import ReferenceFlashLoop
from flashloop_compile.runtime.engine import Engine
from passes.conftest import SMALL, small
from runtime.test_snapshot import _greedy

# (token-sparse prefill, sparse decode, KV quantization): the combinations that change what a prefix
# holds or how the rest reads it; sparse decode alone only changes decode steps (test_snapshot.py
# moves rows under all 8). Each case compiles three graphs (fresh prompt, chunk, decode)
SWITCHES = [(False, False, False), (False, False, True), (True, False, False), (True, True, True)]
IDS = ["".join("TSQ"[i] if on else "-" for i, on in enumerate(s)) for s in SWITCHES]
# group 16: the prefix rows flush blocks (the ring holds 16..31 tokens); window 16: a shared prefix of
# 40 tokens is reused as 32 (whole windows) where token-sparse prefill selects
GROUP = WINDOW = 16
MAX_SEQ = 128
STEPS = 4
ATOL = RTOL = 1e-5  # the moved row's logits against the in-place run's (test_snapshot.py's tolerance)


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


SHARED = _prompt(40, 1)
A = SHARED  # the cached request: the shared prefix as a prompt of its own
B = torch.cat([SHARED, _prompt(30, 2)])  # the new request: the prefix, then 30 tokens of its own
C = _prompt(50, 3)  # a fresh prompt prefilled in the same batch
D = torch.cat([SHARED, _prompt(6, 5)])  # another new request: its rest is prefilled without flushing a block


def _config(switches, **overrides) -> FlashLoopConfig:
    return FlashLoopConfig.from_switches(*switches, **{"token_sparse_prefill.window": WINDOW,
                                                       **SMALL,
                                                       "kv_residual_quantization.group_size": GROUP, **overrides})


def _engine(model, config, max_batch=3, **kw) -> Engine:
    torch._dynamo.reset()
    return Engine(model, config, max_batch=max_batch, max_seq=MAX_SEQ, backend=make_backend(config, inner="eager"), **kw)


def _reference(model, config, prompt: torch.Tensor, cached: int, steps: int) -> list[int]:
    """The reference prefilling ``prompt[:cached]`` as one chunk and the rest as another, then greedy."""
    req = ReferenceFlashLoop(model, config).request()
    req.prefill(prompt[:cached], final=False)
    tok = req.prefill(prompt[cached:]).logits[-1].argmax()
    out = [int(tok)]
    for _ in range(steps - 1):
        tok = req.decode(tok[None]).logits[-1].argmax()
        out.append(int(tok))
    return out


def _row(engine: Engine, row: int) -> dict[str, torch.Tensor]:
    """Every cache tensor's part that belongs to batch row ``row``."""
    out = {}
    for name, t in engine.state_tensors().items():
        if name.endswith(("res_layout", "overflow")):  # shared by every row
            continue
        axis = 1 if name.endswith(("k_res_min", "k_res_scale", "packed.rows")) else 0
        out[name] = t.select(axis, row).clone()
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("switches", SWITCHES, ids=IDS)
def test_a_prompt_after_a_reused_prefix_equals_prefilling_the_prefix_then_the_rest(switches):
    model = small()
    config = _config(switches)
    token_sparse, _, quantize = switches
    n = 32 if token_sparse else 40  # the shared 40 tokens, in whole windows where token-sparse prefill selects
    engine = _engine(model, config)
    # row 0: B's first n tokens, row 1: a fresh prompt, row 2: A (the cached request: B's and D's first 40 tokens)
    engine.prefill([B[:n], C, A])
    cached_row = _row(engine, 2)

    # the engine prefilling B's prefix and then the rest as a chunk, in place, next to a fresh prompt
    logits = engine.prefill([B, C], cached=[n, 0])
    in_place, in_place_logits = _greedy(engine, logits, torch.tensor([len(B), len(C)]), STEPS)
    assert in_place[:, 1].tolist() == ReferenceFlashLoop(model, config).greedy(C, STEPS).tolist()

    # B and D starting from copies of A's first n tokens; each copy writes its destination row only
    for dst in (0, 1):
        others = {r: _row(engine, r) for r in (0, 1, 2) if r != dst}
        assert engine.reuse_prefix(2, dst, 40) == n
        assert all(_same(_row(engine, r), state) for r, state in others.items())
    logits = engine.prefill([B, D], cached=[n, n])
    tokens, out = _greedy(engine, logits, torch.tensor([len(B), len(D)]), STEPS)

    assert tokens[:, 0].tolist() == in_place[:, 0].tolist()
    torch.testing.assert_close(out[:, 0], in_place_logits[:, 0], atol=ATOL, rtol=RTOL)
    # the reference prefilling the prefix, then the rest. Under token-sparse prefill and KV
    # quantization the engine's chunk that flushes a block of the prefix's tail deviates from it
    # (DESIGN.md section 5, "Known deviation": its later loops read that block quantized where the
    # reference still reads the tail); D's rest flushes nothing in its step
    if not (token_sparse and quantize):
        assert tokens[:, 0].tolist() == _reference(model, config, B, n, STEPS)
    assert tokens[:, 1].tolist() == _reference(model, config, D, n, STEPS)
    if not quantize:  # without KV quantization a chunk on a window boundary is exact
        assert tokens.T.tolist() == [ReferenceFlashLoop(model, config).greedy(p, STEPS).tolist() for p in (B, D)]
    assert _same(_row(engine, 2), cached_row)  # the source row, through every step after its prefill

    # a conversation's next turn: row 0's prompt B and the STEPS tokens it generated, then 14 new
    # ones. Row 1 starts from a copy of row 0 (74 tokens: 64 in whole windows), row 0 continues in
    # place from there; both then hold the same cache
    held = len(B) + STEPS
    turn = torch.cat([B, tokens[:, 0], _prompt(14, 4)])
    kept = held // WINDOW * WINDOW if token_sparse else held
    assert engine.reuse_prefix(0, 1, held) == kept
    logits = engine.prefill([turn, turn], cached=[kept, kept])
    torch.testing.assert_close(logits[1], logits[0], atol=ATOL, rtol=RTOL)
    tokens, out = _greedy(engine, logits, torch.tensor([len(turn)] * 2), 2)
    assert tokens[:, 1].tolist() == tokens[:, 0].tolist()
    torch.testing.assert_close(out[:, 1], out[:, 0], atol=ATOL, rtol=RTOL)
    if quantize:
        # row 1 holds 88 + 2 tokens and has flushed 64: a prefix of 40 is no longer exact in its tail
        row2 = _row(engine, 2)
        with pytest.raises(ValueError, match=rf"row 1 has flushed 64 tokens .* a row of {n} tokens has flushed 16: the positions "
                                             rf"16\.\.{n - 1} of its prefix are quantized"):
            engine.reuse_prefix(1, 2, 40)
        assert _same(_row(engine, 2), row2)
    if not any(switches):
        _errors_of_a_filled_engine(engine)


def _errors_of_a_filled_engine(engine: Engine) -> None:
    """The errors that need rows holding tokens (run on the features-off case's engine: its graphs
    are compiled): row 0 holds 88 + 2 tokens, row 1 as many, row 2 the 40 of A."""
    with pytest.raises(ValueError, match=r"row 2 holds 40 tokens .*, fewer than length=41"):
        engine.reuse_prefix(2, 0, 41)
    # a verify step's rows are busy until accepted: the cache holds tokens that may be rolled back
    engine.verify(torch.zeros(2, 2, dtype=torch.long), torch.tensor([90, 90]))
    with pytest.raises(ValueError, match=r"the source row 0 is busy: its last verify step awaits accept\(0, n\)"):
        engine.reuse_prefix(0, 2, 16)
    with pytest.raises(ValueError, match=r"the destination row 1 is busy: .* accept it first"):
        engine.reuse_prefix(2, 1, 0)
    assert engine.accept(0, 1) == 91
    assert engine.reuse_prefix(0, 2, 91) == 91  # settled: its tokens and the accepted one


def test_errors_say_what_to_change():
    model = small()
    engine = _engine(model, _config((False, False, False)), max_batch=3)
    with pytest.raises(ValueError, match="src_row and dst_row are both 1"):
        engine.reuse_prefix(1, 1, 0)
    with pytest.raises(ValueError, match=r"dst_row=3 is not a row of this engine \(0\.\.2\)"):
        engine.reuse_prefix(0, 3, 0)
    with pytest.raises(ValueError, match=r"row 0 is empty .*: prefill the prefix there first"):
        engine.reuse_prefix(0, 1, 5)
    with pytest.raises(ValueError, match="length must be the shared prefix's token count"):
        engine.reuse_prefix(0, 1, -1)
    assert engine.reuse_prefix(0, 1, 0) == 0  # nothing to reuse: nothing copied
    with pytest.raises(ValueError, match="cached has 1 entries for 2 prompts"):
        engine.prefill([A, C], cached=[0])
    with pytest.raises(ValueError, match=r"cached\[0\]=40 must be an int in 0\.\.39"):
        engine.prefill([A], cached=[40])
    with pytest.raises(ValueError, match=r"cached\[1\]=8: row 1 holds 0 tokens"):
        engine.prefill([A, C], cached=[0, 8])

    global_selection = _engine(small(), _config((True, False, False), **{"token_sparse_prefill.window": None}), max_batch=2)
    with pytest.raises(ValueError, match="reuse_prefix needs token_sparse_prefill.window"):
        global_selection.reuse_prefix(0, 1, 0)
    windows = _engine(small(), _config((True, False, False)), max_batch=2)
    with pytest.raises(ValueError, match=r"cached\[0\]=8 is not a multiple of token_sparse_prefill.window=16"):
        windows.prefill([A], cached=[8])
