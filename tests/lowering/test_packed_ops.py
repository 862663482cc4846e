"""flashloop.packed_kv_write / packed_read / packed_attention (CPU ATen bodies) against the
reference QuantizedKVStore and the reference codec, through a generation with sparse depths."""

from __future__ import annotations

import math

import pytest
import torch

from flashloop_compile.lowering import packed_ops as P

from flashloop_compile.lowering import packed_sparse_ops as PS
from flashloop_compile.reference.attention import causal_attention
from flashloop_compile.runtime import PackedKVCache, PackedKVOverflowError
from tests.lowering.packed_scenario import (
    append_reference,
    batched_depth_call,
    batched_inflight,
    layer_perturb,
    reference_stores,
    scale_call,
    scenario,
)

G = 64
H, D, R, S = 2, 64, 4, 256


def _unpack(x):
    return torch.stack([x & 15, x >> 4], -1).flatten(-2).float()


def check_codec(cache: PackedKVCache, stores, layer: int) -> None:
    """Decoded base and residual groups of every flushed block equal the reference codec's (FP32,
    exactly), and the position -> row maps hold exactly the block's active tokens."""
    lay = cache.layers[layer]
    for b, store in enumerate(stores):
        for blk in store.blocks[layer]:
            s = blk.start
            j = s // G
            base_k = _unpack(lay.k_base[b, :, s : s + G]) * lay.k_base_scale[b, :, j][:, None].float() + lay.k_base_min[b, :, j][:, None].float()
            assert torch.equal(base_k, blk.base_k.decode().transpose(0, 1))
            vc = _unpack(lay.v_base[b, :, s : s + G]).view(H, G, D // G, G)
            base_v = lay.v_base_min[b, :, s : s + G][..., None].float() + lay.v_base_scale[b, :, s : s + G][..., None].float() * vc
            assert torch.equal(base_v.view(H, G, D), blk.base_v.decode().transpose(0, 1))
            for d in range(1, R):
                rows = cache.rows[d - 1, b, s : s + G]
                if d not in blk.rows:
                    assert bool((rows == -1).all())
                    continue
                assert torch.nonzero(rows >= 0).flatten().tolist() == blk.rows[d].tolist()
                g = cache.residual_offset[d - 1] + rows[rows >= 0].long()
                rk = _unpack(lay.k_res[b, :, g]) * lay.k_res_scale[d - 1, b, :, j][:, None].float() + lay.k_res_min[d - 1, b, :, j][:, None].float()
                assert torch.equal(rk, blk.residual_k[d].decode().transpose(0, 1))
                n = g.numel()
                vc = _unpack(lay.v_res[b, :, g]).view(H, n, D // G, G)
                rv = lay.v_res_min[b, :, g][..., None].float() + lay.v_res_scale[b, :, g][..., None].float() * vc
                assert torch.equal(rv.view(H, n, D), blk.residual_v[d].decode().transpose(0, 1))


def check_reads(cache: PackedKVCache, stores, layers: int, read=P.packed_read) -> None:
    lengths = [st.length for st in stores]
    n = max(lengths)
    pos = torch.full((len(stores), n), -1, dtype=torch.long)
    for b, m in enumerate(lengths):
        pos[b, :m] = torch.arange(m)
    for layer in range(layers):
        for b, st in enumerate(stores):
            assert cache.layers[layer].flushed[b].tolist() == [st.flushed[layer]] * R
            tail = st.length - st.flushed[layer]
            assert st.length < G or G <= tail < 2 * G
        for d in range(R):
            k, v = read(cache, layer, pos, d)
            for b, st in enumerate(stores):
                m = lengths[b]
                rk, rv = st.read(layer, d, m)
                assert torch.equal(k[b, :, :m], rk.transpose(0, 1)), (layer, d, b)
                assert torch.equal(v[b, :, :m], rv.transpose(0, 1)), (layer, d, b)
                assert bool((k[b, :, m:] == 0).all())


def explicit_attention(cache, layer, q, k_in, v_in, qpos, ipos, depth):
    """FP32 attention per row over packed_read of the stored prefix + the in-flight keys."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(q.shape[0]):
        iv = ipos[b] >= 0
        qv = qpos[b] >= 0
        if not bool(qv.any()):
            continue
        p0 = int(ipos[b][iv].min()) if bool(iv.any()) else int(qpos[b][qv].max()) + 1
        sk, sv = P.packed_read(cache, layer, torch.arange(p0)[None].expand(q.shape[0], -1).contiguous(), depth)
        keys = torch.cat([sk[b], k_in[b][:, iv]], 1).transpose(0, 1)
        vals = torch.cat([sv[b], v_in[b][:, iv]], 1).transpose(0, 1)
        kpos = torch.cat([torch.arange(p0), ipos[b][iv]])
        o = causal_attention(q[b][:, qv].transpose(0, 1), qpos[b][qv], keys, vals, kpos)
        out[b][:, qv] = o.transpose(0, 1)
    return out


def run_generation(cache, layers, dtype, hq, write=P.packed_kv_write, attention=P.packed_attention, check_attention=True, seed=0, tol=1e-2):
    stores = reference_stores(layers, R)
    g = torch.Generator().manual_seed(seed + 1)
    for f, fw in enumerate(scenario(H, D, R, dtype, seed=seed)):
        for d in range(R):
            k, v, pos = batched_depth_call(fw, d, H, D, dtype, pad="left" if f == 1 else "right")
            for layer in range(layers):
                kl, vl = scale_call(k, v, pos, layer)
                write(cache, layer, kl, vl, pos, d)
                if not check_attention:
                    continue
                ki, vi, ipos = batched_inflight(fw, d, H, D, dtype)
                ki, vi = scale_call(ki, vi, ipos, layer)
                q = torch.randn(pos.shape[0], hq, pos.shape[1], D, generator=g).to(dtype)
                out = attention(cache, layer, q, ki, vi, pos, ipos, d)
                ref = explicit_attention(cache, layer, q, ki, vi, pos, ipos, d)
                torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
        for layer in range(layers):
            append_reference(stores, layer, fw, lambda rf, layer=layer: layer_perturb(rf, layer))
        check_reads(cache, stores, layers)
        for layer in range(layers):
            check_codec(cache, stores, layer)
    return stores


@pytest.mark.parametrize("hq", [H, 2 * H])
def test_generation_matches_reference_bf16(hq):
    cache = PackedKVCache(2, R, 2, S, H, D, dtype=torch.bfloat16)
    stores = run_generation(cache, 2, torch.bfloat16, hq)
    # the scenario did flush: blocks with sparse residuals, partial and single-row K groups
    blocks = stores[0].blocks[0]
    assert len(blocks) == 2 and len(stores[1].blocks[0]) == 1
    sizes = [b.rows[3].numel() for b in blocks + stores[1].blocks[0] if 3 in b.rows]
    assert any(0 < n < G for n in sizes)
    assert cache.overflow.item() == 0
    cache.check_overflow()


def test_generation_matches_reference_fp32():
    cache = PackedKVCache(1, R, 2, S, H, D, dtype=torch.float32)
    run_generation(cache, 1, torch.float32, 2 * H, tol=1e-5, seed=3)


def test_single_active_row_gives_constant_k_residual_group():
    # One block, one token active at depth 1: its K residual group spans one row -> scale 0.
    cache = PackedKVCache(1, 2, 1, 256, H, D, dtype=torch.float32)
    n = 128
    k0, v0 = torch.randn(1, H, n, D), torch.randn(1, H, n, D)
    P.packed_kv_write(cache, 0, k0, v0, torch.arange(n)[None], 0)
    k1 = k0[:, :, 7:8] + 0.3
    P.packed_kv_write(cache, 0, k1, v0[:, :, 7:8] - 0.2, torch.tensor([[7]]), 1)
    lay = cache.layers[0]
    assert lay.flushed[0].tolist() == [64, 64] and lay.row_count[0, 1].item() == 1
    assert cache.rows[0, 0, 7].item() == 0 and int((cache.rows[0, 0] >= 0).sum()) == 1
    assert bool((lay.k_res_scale[0, 0, :, 0] == 0).all())
    assert bool((lay.k_res[0, :, 0] == 0).all())
    k, v = P.packed_read(cache, 0, torch.arange(64)[None], 1)
    kb, vb = P.packed_read(cache, 0, torch.arange(64)[None], 0)
    # token 7 = base + its (constant) residual; the others inherit depth 0
    others = torch.ones(64, dtype=torch.bool)
    others[7] = False
    assert torch.equal(k[:, :, others], kb[:, :, others]) and torch.equal(v[:, :, others], vb[:, :, others])
    assert (k[0, :, 7] - k1[0, :, 0]).abs().max() < 0.2


def test_overflow_flag_and_inheritance():
    cache = PackedKVCache(1, 3, 1, 256, H, D, residual_capacity=[8, 2], dtype=torch.float32)
    n = 130
    g = torch.Generator().manual_seed(0)
    k0, v0 = torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g)
    pos = torch.arange(n)[None]
    P.packed_kv_write(cache, 0, k0, v0, pos, 0)
    P.packed_kv_write(cache, 0, k0 + 0.1, v0 + 0.1, pos, 1)
    assert cache.overflow.item() == 1
    with pytest.raises(PackedKVOverflowError, match=r"depth 1: 64 rows needed, capacity 8"):
        cache.check_overflow()
    rows = cache.rows[0, 0, :64]
    assert rows[:8].tolist() == list(range(8)) and bool((rows[8:] == -1).all())
    k1, v1 = P.packed_read(cache, 0, pos[:, :64], 1)
    k0r, v0r = P.packed_read(cache, 0, pos[:, :64], 0)
    assert torch.equal(k1[:, :, 8:], k0r[:, :, 8:])  # beyond the capacity: inherit depth 0
    assert (k1[:, :, :8] - (k0[:, :, :8] + 0.1)).abs().max() < 0.05
    cache.reset()
    assert cache.overflow.item() == 0
    cache.check_overflow()


def test_decode_only_rows_and_empty_calls():
    # A row written one token at a time reaches a flush at 128 tokens; a call where every
    # position is padding changes nothing.
    cache = PackedKVCache(1, 2, 2, 256, H, D, dtype=torch.float32)
    ref = reference_stores(1, 2, B=1)[0]
    g = torch.Generator().manual_seed(2)
    for t in range(130):
        k = torch.randn(1, H, 1, D, generator=g)
        v = torch.randn(1, H, 1, D, generator=g)
        k2, v2 = k + 0.01, v - 0.01
        pos = torch.tensor([[t], [-1]])
        kk, vv = torch.cat([k, k]), torch.cat([v, v])
        P.packed_kv_write(cache, 0, kk, vv, pos, 0)
        P.packed_kv_write(cache, 0, torch.cat([k2, k2]), torch.cat([v2, v2]), pos, 1)
        ref.append(0, [k[0].transpose(0, 1), k2[0].transpose(0, 1)], [v[0].transpose(0, 1), v2[0].transpose(0, 1)], torch.tensor([2]))
    assert cache.layers[0].flushed.tolist() == [[64, 64], [0, 0]]
    assert int(cache.depth_count[1].sum()) == 0
    for d in range(2):
        k, v = P.packed_read(cache, 0, torch.arange(130)[None], d)
        rk, rv = ref.read(0, d, 130)
        assert torch.equal(k[0], rk.transpose(0, 1)) and torch.equal(v[0], rv.transpose(0, 1))


def test_reset_slot_then_reuse():
    cache = PackedKVCache(1, 2, 2, 256, H, D, dtype=torch.float32)
    k, v = torch.randn(2, H, 140, D), torch.randn(2, H, 140, D)
    pos = torch.arange(140)[None].repeat(2, 1)
    for d in range(2):
        P.packed_kv_write(cache, 0, k, v, pos, d)
    cache.reset(torch.tensor([1]))
    assert cache.layers[0].flushed[1].tolist() == [0, 0] and cache.layers[0].flushed[0].tolist() == [64, 64]
    assert int(cache.depth_count[1].sum()) == 0 and bool((cache.rows[:, 1] == -1).all())
    kr, _ = P.packed_read(cache, 0, pos, 1)
    assert bool((kr[1] == 0).all()) and not bool((kr[0] == 0).all())
    # a fresh request in slot 1 reads like a fresh cache
    fresh = PackedKVCache(1, 2, 1, 256, H, D, dtype=torch.float32)
    for d in range(2):
        P.packed_kv_write(cache, 0, k[:, :, :70] * 2, v[:, :, :70] * 2, torch.stack([pos[0, 70:], pos[1, :70]]), d)
        P.packed_kv_write(fresh, 0, k[1:, :, :70] * 2, v[1:, :, :70] * 2, pos[1:, :70], d)
    a, _ = P.packed_read(cache, 0, pos[:, :70], 1)
    b, _ = P.packed_read(fresh, 0, pos[1:, :70], 1)
    assert torch.equal(a[1], b[0])


def test_attention_padded_query_rows_and_scale():
    cache = PackedKVCache(1, 2, 1, 256, H, D, dtype=torch.float32)
    k, v = torch.randn(1, H, 100, D), torch.randn(1, H, 100, D)
    P.packed_kv_write(cache, 0, k, v, torch.arange(100)[None], 0)
    q = torch.randn(1, 2 * H, 3, D)
    qpos = torch.tensor([[100, -1, 101]])
    ki, vi = torch.randn(1, H, 2, D), torch.randn(1, H, 2, D)
    ipos = torch.tensor([[100, 101]])
    out = P.packed_attention(cache, 0, q, ki, vi, qpos, ipos, 0, scale=0.3)
    assert bool((out[:, :, 1] == 0).all())
    ref = explicit_attention(cache, 0, q * (0.3 * math.sqrt(D)), ki, vi, qpos, ipos, 0)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_opcheck():
    cache = PackedKVCache(1, 2, 1, 128, H, D, dtype=torch.float32)
    k, v = torch.randn(1, H, 70, D), torch.randn(1, H, 70, D)
    pos = torch.arange(70)[None]
    torch.library.opcheck(torch.ops.flashloop.packed_kv_write.default, (*cache.op_tensors(0), k, v, pos, 0),
                          test_utils=("test_schema", "test_faketensor"))
    P.packed_kv_write(cache, 0, k, v, pos, 0)
    step = (pos[:, -1:], k[:, :, -1:], v[:, :, -1:])  # one token in flight
    torch.library.opcheck(torch.ops.flashloop.packed_read.default, (*cache.op_tensors(0), pos, 0, *step))
    per_head = torch.stack([pos.flip(-1), pos])[None, :, 0]  # [1, H, P]: each kv head its own order
    torch.library.opcheck(torch.ops.flashloop.packed_read.default,
                          (*cache.op_tensors(0), per_head.contiguous(), 0, *P.no_inflight(cache, 1, pos.device)))
    q = torch.randn(1, 2 * H, 1, D)
    args = (q, k[:, :, -1:], v[:, :, -1:], pos[:, -1:], pos[:, -1:], 0, *cache.op_tensors(0), 0.125)
    torch.library.opcheck(torch.ops.flashloop.packed_attention.default, args)
    mask = (torch.arange(128) <= 69)[None, None, None, :]
    args = (q, *step, 0, *cache.op_tensors(0), mask, 0.125, [0.1, 0.5], [13, 64])
    torch.library.opcheck(torch.ops.flashloop.packed_reference_attention.default, args)


def test_packed_reference_is_the_reference_over_the_packed_read():
    # sparse decode's loop-2 reference under quantization: exactly reference_attention over
    # packed_read's whole history (positions 0..S-1, this step's token in flight), at depth 1
    from flashloop_compile.lowering import ops

    cache = PackedKVCache(1, 2, 2, 192, H, D, dtype=torch.float32)
    g = torch.Generator().manual_seed(9)
    k, v = torch.randn(2, H, 150, D, generator=g), torch.randn(2, H, 150, D, generator=g)
    pos = torch.stack([torch.arange(150), torch.where(torch.arange(150) < 90, torch.arange(150), -1)])  # ragged
    for d in range(2):
        P.packed_kv_write(cache, 0, k + d, v - d, pos, d)
    ip = torch.tensor([[150], [90]])
    step = (ip, torch.randn(2, H, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g))
    q = torch.randn(2, 2 * H, 1, D, generator=g)
    mask = (torch.arange(192)[None, :] <= ip)[:, None, None, :]
    got = PS.packed_reference_attention(cache, 0, q, step, 1, mask, 0.125, [0.1], [20])
    kf, vf = P.packed_read(cache, 0, torch.arange(192)[None].expand(2, -1), 1, inflight=step)
    ref = ops.reference_attention(q, kf, vf, mask, 0.125, [0.1], [20])
    for name, a, b in zip(("out", "keys", "count", "mass", "o_ref", "c_ref"), got, ref):
        assert torch.equal(a, b), name


def test_fake_contract_errors():
    cache = PackedKVCache(1, 2, 1, 128, H, D, dtype=torch.bfloat16)
    meta = [t.to("meta") for t in cache.op_tensors(0)]
    k = torch.empty(1, H, 3, D, dtype=torch.bfloat16, device="meta")
    pos = torch.empty(1, 3, dtype=torch.int64, device="meta")
    with pytest.raises(Exception, match="compute dtype"):
        torch.ops.flashloop.packed_kv_write(*meta, k.float(), k.float(), pos, 0)
    with pytest.raises(Exception, match="depth must be in 0..1"):
        torch.ops.flashloop.packed_kv_write(*meta, k, k, pos, 2)
    with pytest.raises(Exception, match="positions must be int64"):
        torch.ops.flashloop.packed_kv_write(*meta, k, k, pos.int(), 0)
    q = torch.empty(1, 3, 1, D, dtype=torch.bfloat16, device="meta")
    with pytest.raises(Exception, match="multiple of kv heads"):
        torch.ops.flashloop.packed_attention(q, k, k, pos[:, :1], pos, 0, *meta, 0.1)
    bad = list(meta)
    bad[1] = bad[1].float()
    with pytest.raises(Exception, match="k_base_min must be torch.float16"):
        torch.ops.flashloop.packed_read(*bad, pos, 0, pos, k, k)
    with pytest.raises(Exception, match="k_inflight must have the cache's compute dtype"):
        torch.ops.flashloop.packed_read(*meta, pos, 0, pos, k.float(), k.float())
    with pytest.raises(Exception, match=r"inflight_positions must be \[1, 3\]"):
        torch.ops.flashloop.packed_read(*meta, pos, 0, pos[:, :1], k, k)
    mask = torch.empty(1, 1, 1, 128, dtype=torch.bool, device="meta")
    q2 = torch.empty(1, 2 * H, 1, D, dtype=torch.bfloat16, device="meta")
    with pytest.raises(Exception, match="depth must be in 0..1"):
        torch.ops.flashloop.packed_reference_attention(q2, pos, k, k, 2, *meta, mask, 0.1, [0.1], [13])
    with pytest.raises(Exception, match=r"key capacity 200 must lie in 1..S=128"):
        torch.ops.flashloop.packed_reference_attention(q2, pos, k, k, 0, *meta, mask, 0.1, [0.1], [200])


def test_the_correction_op_contract_errors():
    # flashloop.packed_correction_attention: what its fake checks, on meta tensors
    cache = PackedKVCache(1, 4, 1, 128, H, D, dtype=torch.bfloat16)
    meta = [t.to("meta") for t in cache.op_tensors(0)]
    k = torch.empty(1, H, 1, D, dtype=torch.bfloat16, device="meta")
    ip = torch.empty(1, 1, dtype=torch.int64, device="meta")
    q = torch.empty(1, H, 1, D, dtype=torch.bfloat16, device="meta")
    keys = torch.empty(1, H, 1, 13, dtype=torch.int32, device="meta")
    count = torch.empty(1, H, 1, dtype=torch.int32, device="meta")
    mass = torch.empty(1, H, 1, dtype=torch.float32, device="meta")
    ref = torch.empty(1, H, 1, D, dtype=torch.float32, device="meta")
    ok = torch.ops.flashloop.packed_correction_attention(q, keys, count, mass, ref, ref, ip, k, k, 2, *meta, 0.1)
    assert ok.shape == q.shape and ok.dtype == q.dtype
    with pytest.raises(Exception, match=r"keys must be \[B, Hq, T, K\] int32"):
        torch.ops.flashloop.packed_correction_attention(q, keys.long(), count, mass, ref, ref, ip, k, k, 2, *meta, 0.1)
    with pytest.raises(Exception, match="depth must be in 0..3"):
        torch.ops.flashloop.packed_correction_attention(q, keys, count, mass, ref, ref, ip, k, k, 4, *meta, 0.1)
    with pytest.raises(Exception, match=r"reference state \(mass, o_ref, c_ref\) is FP32"):
        torch.ops.flashloop.packed_correction_attention(q, keys, count, mass, ref.bfloat16(), ref, ip, k, k, 2, *meta,
                                                        0.1)
    odd = H + 1  # query heads that no kv-head grouping gives

    def heads(t):
        return t.new_empty((t.shape[0], odd) + tuple(t.shape[2:]))

    with pytest.raises(Exception, match="multiple of kv heads"):
        torch.ops.flashloop.packed_correction_attention(heads(q), heads(keys), heads(count), heads(mass), heads(ref),
                                                        heads(ref), ip, k, k, 2, *meta, 0.1)


def test_the_correction_op_equals_read_then_correct():
    # its CPU body is the kv_quant pass's default two-op form: packed_read of the selected positions
    # per kv head, then correction_attention over that compact read (GQA: 2 query heads per kv head)
    from flashloop_compile.lowering import ops

    cache = PackedKVCache(1, 4, 2, 192, H, D, dtype=torch.float32)
    g = torch.Generator().manual_seed(15)
    k, v = torch.randn(2, H, 150, D, generator=g), torch.randn(2, H, 150, D, generator=g)
    pos = torch.stack([torch.arange(150), torch.where(torch.arange(150) < 90, torch.arange(150), -1)])
    for d in range(3):
        P.packed_kv_write(cache, 0, k * (1 + 0.5 * d), v - 0.2 * d, pos, d)
    ip = torch.tensor([[150], [90]])
    step = (ip, torch.randn(2, H, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g))
    q = torch.randn(2, 2 * H, 1, D, generator=g)
    mask = (torch.arange(192)[None, :] <= ip)[:, None, None, :]
    _, keys, count, mass, o_ref, c_ref = PS.packed_reference_attention(cache, 0, q, step, 1, mask, 0.125, [0.1], [20])
    q3 = torch.randn(q.shape, generator=g)
    got = PS.packed_correction_attention(cache, 0, q3, keys[0], count[0], mass[0], o_ref, c_ref[0], step, 2, 0.125)
    k_sel, v_sel = P.packed_read(cache, 0, PS.selected_positions(keys[0], count[0], H), 2, inflight=step)
    want = ops.correction_attention(q3, k_sel, v_sel, PS.local_keys(keys[0], H), count[0], mass[0], o_ref, c_ref[0],
                                    0.125)
    assert torch.equal(got, want)
    assert not torch.equal(got, o_ref)  # the correction moved the output
