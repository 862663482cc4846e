"""PackedKVCache: the DESIGN.md tensors, byte accounting, reset, geometry errors."""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.runtime import PackedKVCache, PackedKVOverflowError
from flashloop_compile.lowering.packed_layout import LAYER_TENSOR_NAMES, MODEL_TENSOR_NAMES

L, R, B, S, H, D, G = 2, 4, 2, 512, 2, 64, 64
CAPS = [512, 128, 64]


def make(**kw):
    args = dict(residual_capacity=CAPS, dtype=torch.bfloat16)
    args.update(kw)
    return PackedKVCache(L, R, B, S, H, D, **args)


def test_allocation_shapes_and_dtypes():
    c = make()
    NB, NG, CAPT = S // G, D // G, sum(CAPS)
    u8, f16, i32 = torch.uint8, torch.float16, torch.int32
    expected = {
        "k_base": ((B, H, S, D // 2), u8),
        "k_base_min": ((B, H, NB, D), f16),
        "k_base_scale": ((B, H, NB, D), f16),
        "v_base": ((B, H, S, D // 2), u8),
        "v_base_min": ((B, H, S, NG), f16),
        "v_base_scale": ((B, H, S, NG), f16),
        "k_res": ((B, H, CAPT, D // 2), u8),
        "k_res_min": ((R - 1, B, H, NB, D), f16),
        "k_res_scale": ((R - 1, B, H, NB, D), f16),
        "v_res": ((B, H, CAPT, D // 2), u8),
        "v_res_min": ((B, H, CAPT, NG), f16),
        "v_res_scale": ((B, H, CAPT, NG), f16),
        "k_tail": ((B, R, H, 2 * G, D), torch.bfloat16),
        "v_tail": ((B, R, H, 2 * G, D), torch.bfloat16),
        "flushed": ((B, R), i32),
        "row_count": ((B, R), i32),
    }
    assert tuple(expected) == LAYER_TENSOR_NAMES
    for layer in range(L):
        for name, t in zip(LAYER_TENSOR_NAMES, c.layer_tensors(layer)):
            assert (tuple(t.shape), t.dtype) == expected[name], name
            assert t.is_contiguous()
    # layers own separate tensors
    assert c.layers[0].k_base.data_ptr() != c.layers[1].k_base.data_ptr()
    rows, depth_count, layout, overflow = c.model_tensors()
    assert MODEL_TENSOR_NAMES == ("rows", "depth_count", "res_layout", "overflow")
    assert (rows.shape, rows.dtype) == ((R - 1, B, S), i32) and bool((rows == -1).all())
    assert (depth_count.shape, depth_count.dtype) == ((B, S), u8)
    assert layout.tolist() == [[0, 0, 512, 640], [S, 512, 128, 64]]
    assert (overflow.shape, overflow.dtype) == ((1,), i32)
    assert len(c.op_tensors(1)) == 20


def test_per_depth_views_are_the_design_tables():
    c = make()
    for d, cap in enumerate(CAPS, start=1):
        assert c.k_res(0, d).shape == (B, H, cap, D // 2) and c.v_res(0, d).shape == (B, H, cap, D // 2)
        assert c.v_res_params(0, d)[0].shape == (B, H, cap, D // G)
        assert c.k_res_params(0, d)[1].shape == (B, H, S // G, D)
        assert c.rows_of(d).shape == (B, S)
        c.k_res(0, d).fill_(d)  # the views partition the buffer
    assert torch.equal(c.layers[0].k_res[0, 0, :, 0].unique(), torch.tensor([1, 2, 3], dtype=torch.uint8))
    with pytest.raises(IndexError, match="residual depth must be in 1..3"):
        c.k_res(0, 0)


def test_nbytes_breakdown_and_ratio():
    c = make(residual_capacity=None)
    nb = c.nbytes()
    NB, NG, CAPT = S // G, D // G, S * (R - 1)
    payload = L * (2 * B * H * S * D // 2 + 2 * B * H * CAPT * D // 2)
    params = L * 2 * 2 * (B * H * NB * D + B * H * S * NG + (R - 1) * B * H * NB * D + B * H * CAPT * NG)
    maps = L * 2 * B * R * 4 + (R - 1) * B * S * 4 + B * S + 2 * R * 4 + 4
    tails = L * 2 * B * R * H * 2 * G * D * 2
    dense = B * S * R * L * H * D * 2 * 2
    assert (nb.payload, nb.params, nb.maps, nb.tails, nb.dense_equivalent) == (payload, params, maps, tails, dense)
    assert nb.total == payload + params + maps + tails
    assert nb.ratio == pytest.approx(dense / nb.total)
    d = nb.as_dict()
    assert d["total"] == nb.total and d["ratio"] == nb.ratio
    # full residual capacity at every depth: INT4 + params ~ 4.5 bits/value vs 16; the maps add
    # 4 bytes per position and depth, the tails a fixed 2*G tokens per depth.
    big = PackedKVCache(L, R, B, 8192, H, 128).nbytes()
    assert 2.5 < big.ratio < 3.5
    # compact residual capacities (retention 1, 1, 0.25, 0.10 of SPEC.md) save more
    sparse = PackedKVCache(L, R, B, 8192, H, 128, residual_capacity=[8192, 2048, 832]).nbytes()
    assert sparse.payload < big.payload and 4.0 < sparse.ratio < 6.0


def test_reset_all_slots_and_mask():
    c = make()
    for lay in c.layers:
        lay.flushed.fill_(64)
        lay.row_count.fill_(5)
    c.rows.fill_(3)
    c.depth_count.fill_(2)
    c.overflow.fill_(1)
    payload_ptr = c.layers[0].k_base.data_ptr()
    c.reset(torch.tensor([True, False]))
    assert c.layers[1].flushed.tolist() == [[0] * R, [64] * R]
    assert c.layers[0].row_count.tolist() == [[0] * R, [5] * R]
    assert bool((c.rows[:, 0] == -1).all()) and bool((c.rows[:, 1] == 3).all())
    assert c.depth_count[0].sum() == 0 and bool((c.depth_count[1] == 2).all())
    assert c.overflow.item() == 1  # a partial reset keeps the global flag
    c.reset(torch.tensor([1]))
    assert bool((c.rows == -1).all()) and int(c.depth_count.sum()) == 0
    c.overflow.fill_(1)
    c.reset()
    assert c.overflow.item() == 0 and c.layers[0].k_base.data_ptr() == payload_ptr
    with pytest.raises(ValueError, match="bool slot mask must have shape"):
        c.reset(torch.tensor([True]))


def test_check_overflow_message():
    c = make()
    c.check_overflow()
    c.overflow.fill_(1)
    c.layers[1].row_count[0, 2] = 200
    with pytest.raises(PackedKVOverflowError, match=r"depth 2: 200 rows needed, capacity 128.*residual_capacity"):
        c.check_overflow()


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(head_dim=48), r"head_dim=48 must be a multiple of group_size=64.*use group_size=16"),
        (dict(max_seq=500), r"max_seq=500 must be a multiple of group_size=64.*round max_seq up to 512"),
        (dict(tail=128), r"tail=128 must equal group_size=64.*set tail=64"),
        (dict(num_loops=1), r"num_loops must be >= 2"),
        (dict(group_size=48), r"group_size must be a power of two"),
        (dict(residual_capacity=[10, 10]), r"one entry per residual depth 1..3"),
        (dict(residual_capacity=0), r"residual_capacity of depth 1 must be an int in 1..max_seq=512"),
        (dict(dtype=torch.int8), r"dtype must be one of"),
        (dict(kv_heads=0), r"kv_heads must be a positive int"),
    ],
)
def test_geometry_errors(kw, match):
    args = dict(num_layers=L, num_loops=R, max_batch=B, max_seq=S, kv_heads=H, head_dim=D)
    args.update({k: v for k, v in kw.items() if k in args})
    extra = {k: v for k, v in kw.items() if k not in args}
    with pytest.raises(ValueError, match=match):
        PackedKVCache(**args, **extra)
