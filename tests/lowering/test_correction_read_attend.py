"""Sparse decode's correction read and attended in one pass (packed_ops.correction_read_attend:
packed_read._read_attend_kernel, then correction's combine), run by the interpreter on CPU
tensors, against the ATen body of ``flashloop::packed_correction_attention`` (packed_read of the
selected keys, then correction_attention over that copy).

The kernel attends the values packed_read would have written, rounded to the compute dtype, so it
equals the two-op form up to FP32 summation order: 1e-5 on fp32 caches, bf16's 1e-2 otherwise.
Tiles of 16 keys cover all three kinds of program: a tile of the flushed bulk (no per-token
state), a tile with ring or in-flight keys (per-token resolution, sub-tile by sub-tile) and a tile
past the row's count (an empty partial)."""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.config import ceil_fraction
from flashloop_compile.lowering import packed_sparse_ops as PS
from flashloop_compile.lowering.kernels import packed_read as PR
from flashloop_compile.lowering.kernels.common import first_inflight
from flashloop_compile.lowering.packed_layout import PackedTensors
from tests.lowering.packed_scenario import nested_residual_cache

B, H, D, R, S = 2, 2, 128, 4, 256
LENGTHS = (200, 131)  # stored tokens per row: neither a multiple of the group
TILE = 16


def _case(dtype, depth: int, padded_row: bool = False, seed: int = 31, group: int = 64):
    """A cache with residuals on nested subsets, loop 2's selection from the ATen reference (keys in
    its order), and the arguments of a correction at ``depth`` with this depth's in-flight token."""
    cache, g = nested_residual_cache(dtype, group, S, LENGTHS, H, D, R, seed, lambda k, d: k * (1 + 0.5 * d),
                                     lambda v, d: v - 0.2 * d)
    q = (2.0 * torch.randn(B, H, 1, D, generator=g)).to(dtype)  # sharp: the in-flight token is selected
    ki = torch.randn(B, H, 1, D, generator=g).to(dtype)
    vi = torch.randn(B, H, 1, D, generator=g).to(dtype)
    ip = torch.tensor(LENGTHS)[:, None]
    if padded_row:
        ip[1, 0] = -1
    mask = (torch.arange(S)[None, :] <= ip)[:, None, None, :]
    tensors = cache.op_tensors(0)
    _, keys, count, mass, o_ref, c_ref = PS.packed_reference_attention_aten(
        q, ip, ki, vi, 1, *tensors, mask, 0.125, [0.25], [ceil_fraction(0.25, S)])
    keys, count = keys[0], count[0]
    # ascending positions (the selection's order is not a contract): low tiles in the flushed bulk,
    # the last in the ring; row 0, head 0 also takes the in-flight token in place of its first key
    valid = torch.arange(keys.shape[-1]) < count[..., None]
    keys = torch.where(valid, keys, S).sort(-1).values
    keys[0, 0, 0, 0] = LENGTHS[0]
    keys = torch.where(valid, keys, -1)
    kd, vd = (ki * 1.5).to(dtype), (vi - 0.3).to(dtype)  # this depth's in-flight token
    return tensors, (q, keys, count, mass[0], o_ref, c_ref[0]), (ip, kd, vd)


def _tile_kinds(tensors, keys, count, ip, depth: int) -> set[str]:
    """Which programs a read of TILE keys per program runs (the kernel's rule, on the host)."""
    flushed = PackedTensors(*tensors).flushed
    lim = first_inflight(ip, S)
    kinds = set()
    for b in range(B):
        bound = min(int(flushed[b, : depth + 1].min()), int(lim[b]))
        for h in range(H):
            n = int(count[b, h, 0])
            for z in range(0, keys.shape[-1], TILE):
                p = keys[b, h, 0, z:min(z + TILE, n)]
                kinds.add("empty" if z >= n else "bulk" if int(p.max()) < bound else "resolved")
    return kinds


@pytest.mark.parametrize("dtype, depth", [(torch.float32, 2), (torch.float32, 3), (torch.bfloat16, 3)],
                         ids=["fp32_d2", "fp32_d3", "bf16_d3"])
def test_read_attend_matches_read_then_correct(dtype, depth):
    tensors, args, inflight = _case(dtype, depth)
    q, keys, count = args[:3]
    assert _tile_kinds(tensors, keys, count, inflight[0], depth) == {"bulk", "resolved", "empty"}
    want = PS.packed_correction_attention_aten(*args, *inflight, depth, *tensors, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for block_p in (TILE, None):  # None: the interpreter's one tile per row
        got = PS.correction_read_attend(*args, inflight, depth, tensors, 0.125, block_p=block_p)
        assert got.dtype == q.dtype and got.shape == q.shape
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"block_p {block_p}: {m}")


@pytest.mark.parametrize("group", [16, 32])
def test_read_attend_matches_read_then_correct_at_every_group_size(group):
    # a bulk tile's chunk of channel pairs lies in one V group (16 pairs at the default group 64,
    # fewer below 32 channels): each chunk's V parameters are its group's
    tensors, args, inflight = _case(torch.float32, 2, group=group)
    want = PS.packed_correction_attention_aten(*args, *inflight, 2, *tensors, 0.125)
    got = PS.correction_read_attend(*args, inflight, 2, tensors, 0.125, block_p=TILE)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_read_attend_takes_the_keys_in_any_order_and_a_padded_row():
    # the selection's order is not a contract: the valid prefix of each row shuffled; row 1 is
    # padding this step (query position -1: its reference selects nothing, the output is O_ref - C_ref)
    tensors, args, inflight = _case(torch.float32, 3, padded_row=True, seed=5)
    q, keys, count, *rest = args
    assert int(count[1].max()) == 0
    g = torch.Generator().manual_seed(0)
    valid = torch.arange(keys.shape[-1]) < count[..., None]
    keys = torch.gather(keys, -1, torch.where(valid, torch.rand(keys.shape, generator=g), 2.0).argsort(-1))
    shuffled = (q, keys, count, *rest)
    want = PS.packed_correction_attention_aten(*args, *inflight, 3, *tensors, 0.125)
    got = PS.correction_read_attend(*shuffled, inflight, 3, tensors, 0.125, block_p=TILE)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_read_attend_refuses_several_query_heads_per_kv_head():
    tensors, (q, keys, count, *_rest), inflight = _case(torch.float32, 2)
    q2 = q.repeat_interleave(2, dim=1)
    assert not PR.read_attend_fits(q2, tensors)
    with pytest.raises(ValueError, match="one query row per kv head"):
        PR.launch_packed_read_attend(tensors, q2, keys.repeat_interleave(2, dim=1), count.repeat_interleave(2, dim=1), 2,
                                    0.125, inflight=inflight)


def test_read_attend_refuses_a_tile_that_is_not_a_power_of_two(monkeypatch):
    tensors, (q, keys, count, *_rest), inflight = _case(torch.float32, 3)
    monkeypatch.setitem(PR.PACKED_READ, "attend_block_p", (32, 32, 32, 24))
    with pytest.raises(ValueError, match="power of two, got 24 keys"):
        PR.launch_packed_read_attend(tensors, q, keys, count, 3, 0.125, inflight=inflight)
    PR.launch_packed_read_attend(tensors, q, keys, count, 2, 0.125, inflight=inflight)  # depth 2: 32


def test_an_in_flight_token_inside_the_flushed_bulk_is_read_from_flight():
    # a position both stored below the flushed boundaries and in flight (a token rewritten this
    # step) reads its in-flight K/V: the bulk rule must stop at the row's first in-flight position,
    # which the kernel takes from the in-flight positions itself
    tensors, args, (ip, kd, vd) = _case(torch.float32, 2, seed=5)
    keys = args[1]
    low = int(keys[0, 1, 0, 2])
    assert low < int(PackedTensors(*tensors).flushed[0].min())  # below every depth's flushed boundary of row 0
    ip = ip.clone()
    ip[0, 0] = low
    want = PS.packed_correction_attention_aten(*args, ip, kd, vd, 2, *tensors, 0.125)
    got = PS.correction_read_attend(*args, (ip, kd, vd), 2, tensors, 0.125, block_p=TILE)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_p", [TILE, 0], ids=["tile16", "default"])
def test_the_read_attend_op_states_its_partials_for_inductor(block_p):
    # flashloop::packed_read_attend is opaque to Inductor so that its register cap (launched
    # directly) holds in a compiled step: its fake states the partials' shapes (NT tiles per row),
    # and opcheck runs the schema, fake and autograd-registration checks on the interpreter
    tensors, (q, keys, count, *_rest), inflight = _case(torch.float32, 3)
    args = (q, keys, count, *inflight, 3, *tensors, 0.125, block_p)
    part_m, part_l, part_acc = torch.ops.flashloop.packed_read_attend(*args)
    nt = -(-keys.shape[-1] // (block_p or 128))  # the interpreter's default: one 128-key tile
    assert part_m.shape == part_l.shape == (B * H, nt) and part_acc.shape == (B * H, nt, D)
    torch.library.opcheck(torch.ops.flashloop.packed_read_attend.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
