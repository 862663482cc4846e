"""KV residual quantization at every head_dim and group size the config accepts: the engine
(the flashloop backend's rewrite, packed ops' CPU bodies) gives the reference's logits, and what
the packed cache cannot hold is refused by the config with a message that says what to change.

The tolerance: both paths run the same FP32 arithmetic up to the order of a few reductions
(measured <= 2e-6 in logits and stored K/V). One INT4 code on the other side of a rounding
boundary moves a stored value by a whole quantization step (1e-3..1e-1) and logits by 1e-5..1e-2:
a reference that divided by sqrt(head_dim) where SDPA multiplies by 1/sqrt(head_dim) did that at
head_dim 32 and 128. The stored K/V are compared too, since a flipped code can move the logits of
a random model by little.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashloop_compile.backend import make_backend
from flashloop_compile.config import ConfigError, FlashLoopConfig
from flashloop_compile.lowering.packed_ops import packed_read
from flashloop_compile.models.ouro import PRESETS, OuroForCausalLM
from flashloop_compile.reference import ReferenceFlashLoop
from flashloop_compile.runtime.engine import Engine

ATOL = 1e-5  # logits and stored K/V (FP32)
DECODE_STEPS = 3

# (head_dim, query heads, kv heads, group_size) on the tiny preset's hidden size 128, GQA where the
# heads allow it, one layer per loop (compile time grows with the unrolled graph). Only a group
# size other than 64 is set: the tail follows it.
CASES = [(16, 8, 4, 16), (32, 4, 2, 32), (64, 2, 2, 64), (128, 2, 1, 128)]


def _model(head_dim: int, heads: int, kv_heads: int) -> OuroForCausalLM:
    config = dataclasses.replace(PRESETS["tiny"], head_dim=head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                 num_hidden_layers=1)
    torch.manual_seed(head_dim)
    return OuroForCausalLM(config).init_random_().eval()


def _config(all_on: bool, group_size: int) -> FlashLoopConfig:
    flat = {"token_sparse_prefill.window": 32}
    if group_size != 64:
        flat["kv_residual_quantization.group_size"] = group_size
    return FlashLoopConfig.from_switches(all_on, all_on, True, **flat)


def _check_stored(engine: Engine, requests, lengths) -> None:
    """Every layer's and depth's stored K/V as the packed cache returns them equal the reference
    store's (an INT4 code that differs shows here whatever the logits do)."""
    cache = engine.packed
    pos = torch.full((len(lengths), max(lengths)), -1, dtype=torch.long)
    for b, n in enumerate(lengths):
        pos[b, :n] = torch.arange(n)
    for layer in range(cache.num_layers):
        for depth in range(cache.num_loops):
            k, v = packed_read(cache, layer, pos, depth)
            for b, (req, n) in enumerate(zip(requests, lengths)):
                rk, rv = req.store.read(layer, depth, n)
                where = f"layer {layer} depth {depth} row {b}"
                torch.testing.assert_close(k[b, :, :n], rk.transpose(0, 1), rtol=0, atol=ATOL, msg=lambda m: f"K {where}: {m}")
                torch.testing.assert_close(v[b, :, :n], rv.transpose(0, 1), rtol=0, atol=ATOL, msg=lambda m: f"V {where}: {m}")


def _compare(model: OuroForCausalLM, config: FlashLoopConfig) -> None:
    """A ragged batch (one prompt past 2 groups: a flushed block; one inside the tail) prefilled
    and decoded for a few steps, each row's logits against its own reference request."""
    g = config.kv_residual_quantization.group_size
    lengths = (2 * g + 5, g + 3)
    max_seq = -(-(max(lengths) + DECODE_STEPS) // g) * g
    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    torch._dynamo.reset()
    engine = Engine(model, config, max_batch=2, max_seq=max_seq, backend=make_backend(config, inner="eager"))
    requests = [ReferenceFlashLoop(model, config).request() for _ in prompts]
    got = engine.prefill(prompts)
    want = torch.stack([r.prefill(p).logits[-1] for r, p in zip(requests, prompts)]).float()
    torch.testing.assert_close(got, want, rtol=0, atol=ATOL, msg=lambda m: f"prefill: {m}")
    _check_stored(engine, requests, lengths)
    for step in range(DECODE_STEPS):
        tok = want.argmax(-1)
        got = engine.decode(tok, torch.tensor([n + step for n in lengths]))
        want = torch.stack([r.decode(t[None]).logits[-1] for r, t in zip(requests, tok)]).float()
        torch.testing.assert_close(got.float(), want, rtol=0, atol=ATOL, msg=lambda m: f"decode step {step}: {m}")
    _check_stored(engine, requests, [n + DECODE_STEPS for n in lengths])
    assert engine.packed.layers[0].flushed[0, 0].item() > 0  # the long row did flush a block
    torch._dynamo.reset()


@pytest.mark.parametrize("all_on", [False, True], ids=["kvq", "all_on"])
@pytest.mark.parametrize("case", CASES, ids=[f"head_dim{c[0]}" for c in CASES])
def test_compiled_equals_reference_at_every_head_dim(case, all_on):
    head_dim, heads, kv_heads, group_size = case
    _compare(_model(head_dim, heads, kv_heads), _config(all_on, group_size))


def test_a_group_smaller_than_the_head_works():
    # V groups of 16 channels, four per head; K groups of 16-token blocks
    _compare(_model(64, 2, 1), _config(False, 16))


def test_what_the_cache_cannot_hold_is_refused_by_the_config():
    # a tail other than the group size: refused when the config is built
    with pytest.raises(ConfigError, match=r"tail must equal group_size=16.*set tail=16 or leave it out"):
        FlashLoopConfig.from_dict({"kv_residual_quantization.group_size": 16, "kv_residual_quantization.tail": 64})
    # a group size that does not divide the model's head_dim: refused with the model, before any compile
    model = _model(48, 2, 2)
    config = FlashLoopConfig.from_switches(False, False, True)
    with pytest.raises(ConfigError, match=r"group_size=64 must divide the model's head_dim=48.*group_size=16"):
        Engine(model, config, max_batch=1, max_seq=64, backend=make_backend(config, inner="eager"))
    with pytest.raises(ConfigError, match=r"group_size=64 must divide the model's head_dim=48"):
        ReferenceFlashLoop(model, config)
    # ... and by the backend, for a model compiled directly
    model.setup_caches(1, 64)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"group_size=64 must divide the model's head_dim=48.*group_size=16"):
        with torch.no_grad():
            torch.compile(model, backend=make_backend(config, inner="eager"), fullgraph=True)(
                torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None])
    torch._dynamo.reset()
