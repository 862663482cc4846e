"""Per-request KV stores (SPEC.md section 3): residuals against the reconstructed predecessor,
compact maps and inheritance, the rolling tail, bounded reconstruction error, byte accounting."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashloop_compile.reference.kvstore import DenseKVStore, QuantizedKVStore

U16 = 2.0**-11
G = 64


def make_logical(x0: torch.Tensor, count: torch.Tensor, depths: int, step: float, g: torch.Generator):
    """Logical per-depth values: a token changes at depth d iff it is active there (count > d),
    otherwise it inherits depth d-1's value."""
    xs = [x0]
    for d in range(1, depths):
        nxt = xs[-1].clone()
        rows = count > d
        nxt[rows] += step * torch.randn(int(rows.sum()), *x0.shape[1:], generator=g)
        xs.append(nxt)
    return xs


def fill(store, layers, ks, vs, count, chunks):
    """Append positions in the given chunk sizes, every layer, like a forward does."""
    start = 0
    for n in chunks:
        for layer in range(layers):
            sl = slice(start, start + n)
            store.append(layer, [k[sl] for k in ks[layer]], [v[sl] for v in vs[layer]], count[sl])
        start += n
    return store


def half_scale_bound(scale: torch.Tensor, minimum: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Per-element bound for a value decoded from a group with these FP16 parameters: scale/2 plus
    the FP16 rounding of the parameters (|m - lo| and |R - 15 s|, each <= U16 times the group's
    magnitude, which |m| + 15 s bounds up to the same rounding; doubled for margin) plus FP32
    rounding of the subtraction/addition chain (relative to the value's magnitude)."""
    s, m = scale.double(), minimum.double()
    return s / 2 + 2 * U16 * (m.abs() + 15 * s) + 2.0**-20 + 1e-6 * x.double().abs()


# --------------------------------------------------------------------------------------------
# The SPEC residual example
# --------------------------------------------------------------------------------------------


def test_spec_residual_example():
    # Values (t + c) % 16 are integers 0..15 in every K group (channel across 64 rows) and every V
    # group (64 channels of a row): min 0, max 15, scale exactly 1, exact decode. One element,
    # position 0 / channel 0, is 10.03: it decodes to round(10.03) = 10.00 in both K and V.
    t, c = torch.arange(2 * G)[:, None], torch.arange(G)[None, :]
    x1 = ((t + c) % 16).float()[:, None, :]  # [128, 1, 64]
    x1[0, 0, 0] = 10.03
    x2 = x1.clone()
    x2[0, 0, 0] = 10.08  # loop 2 moves it by 0.05 from its source, 0.08 from its reconstruction
    count = torch.ones(2 * G, dtype=torch.long)
    count[:2] = 2  # positions 0 and 1 are recomputed at loop 2
    store = QuantizedKVStore(1, 2)
    store.append(0, [x1, x2], [x1.clone(), x2.clone()], count)
    assert len(store.blocks[0]) == 1
    block = store.blocks[0][0]
    for base in (block.base_k.decode(), block.base_v.decode()):
        assert base[0, 0, 0].item() == 10.0
        assert torch.equal(base[1:], x1[1:G])
    assert block.rows[1].tolist() == [0, 1]
    for res in (block.residual_k[1].decode(), block.residual_v[1].decode()):
        assert res.shape == (2, 1, G)
        assert res[0, 0, 0].item() == pytest.approx(0.08, abs=1e-4)  # not 0.05
        assert res[1].abs().max().item() == 0.0
    k, v = store.read(0, 1, 2 * G)
    assert k[0, 0, 0].item() == pytest.approx(10.08, abs=1e-4)
    assert v[0, 0, 0].item() == pytest.approx(10.08, abs=1e-4)
    k0, _ = store.read(0, 0, 2 * G)
    assert k0[0, 0, 0].item() == 10.0


@pytest.mark.parametrize("heads,dim", [(1, 64), (2, 32), (4, 64)])
def test_residual_is_against_reconstruction_and_error_bounded(heads, dim):
    # Coarse base (wide range -> large base scale) and small loop-to-loop changes: a residual
    # taken against the source X[r-1] would keep the base's error (~ base scale / 2); against
    # the reconstruction the error is that of the last residual only (its scale / 2).
    g = torch.Generator().manual_seed(heads * 100 + dim)
    depths, n = 4, 3 * G + 20
    count = torch.randint(1, depths + 1, (n,), generator=g)
    count[: n // 3] = depths
    ks = make_logical(torch.randn(n, heads, dim, generator=g) * 10, count, depths, 0.01, g)
    vs = make_logical(torch.randn(n, heads, dim, generator=g) * 10, count, depths, 0.01, g)
    store = fill(QuantizedKVStore(1, depths), 1, [ks], [vs], count, [n])
    blocks = store.blocks[0]
    assert len(blocks) == 2
    for b in blocks:
        sl = slice(b.start, b.start + G)
        cnt = count[sl]
        k_prev, v_prev = b.reconstruct(0)
        for d in range(1, depths):
            rows = b.rows[d]
            assert rows.tolist() == torch.nonzero(cnt > d).flatten().tolist()
            # The stored residual approximates X[d] - X_hat[d-1] ...
            dk = ks[d][sl][rows] - k_prev[rows]
            dv = vs[d][sl][rows] - v_prev[rows]
            rk, rv = b.residual_k[d], b.residual_v[d]
            err_k = (rk.decode() - dk).abs().double()
            assert bool((err_k <= half_scale_bound(rk.scale[None], rk.minimum[None], dk)).all())
            nv = rows.numel()
            err_v = (rv.decode() - dv).abs().double().reshape(nv, -1, G)
            assert bool((err_v <= half_scale_bound(rv.scale[..., None], rv.minimum[..., None], dv.reshape(nv, -1, G))).all())
            # ... and X_hat[d] = X_hat[d-1] + decoded residual on those rows, inherited elsewhere.
            k_cur, v_cur = b.reconstruct(d)
            torch.testing.assert_close(k_cur[rows], k_prev[rows] + rk.decode(), atol=1e-6, rtol=0)
            others = torch.ones(G, dtype=torch.bool)
            others[rows] = False
            assert torch.equal(k_cur[others], k_prev[others]) and torch.equal(v_cur[others], v_prev[others])
            k_prev, v_prev = k_cur, v_cur

    # Reading any depth: each token's error is bounded by the half-scale of the last group that
    # wrote it (its last residual, or the base) -- far below the base's own error.
    for d in range(depths):
        k, v = store.read(0, d, n)
        base_err_max = 0.0
        for b in blocks:
            sl = slice(b.start, b.start + G)
            last = torch.clamp(count[sl] - 1, max=d)  # depth of the last write at or below d
            base_k = b.base_k.decode()
            base_err_max = max(base_err_max, (base_k - ks[0][sl]).abs().max().item())
            for i in range(G):
                e = int(last[i])
                if e == 0:
                    qk, r = b.base_k, i
                    qv_scale, qv_min = b.base_v.scale[i], b.base_v.minimum[i]
                else:
                    r = b.rows[e].tolist().index(i)
                    qk = b.residual_k[e]
                    qv_scale, qv_min = b.residual_v[e].scale[r], b.residual_v[e].minimum[r]
                ek = (k[b.start + i] - ks[d][b.start + i]).abs().double()
                assert bool((ek <= half_scale_bound(qk.scale, qk.minimum, ks[d][b.start + i])).all())
                ev = (v[b.start + i] - vs[d][b.start + i]).abs().double().reshape(-1, G)
                assert bool((ev <= half_scale_bound(qv_scale[:, None], qv_min[:, None], vs[d][b.start + i].reshape(-1, G))).all())
        # Tokens active past depth 0 are reconstructed much better than the base alone.
        if d >= 1:
            active = torch.cat([count[b.start : b.start + G] > 1 for b in blocks])
            flushed = slice(0, len(blocks) * G)
            err_active = (k[flushed][active] - ks[d][flushed][active]).abs().max().item()
            assert err_active < base_err_max / 4
        # The tail is exact.
        assert torch.equal(k[len(blocks) * G :], ks[d][len(blocks) * G :])
        assert torch.equal(v[len(blocks) * G :], vs[d][len(blocks) * G :])


# --------------------------------------------------------------------------------------------
# Loop-4 read resolution, compact maps, inheritance
# --------------------------------------------------------------------------------------------


def test_loop4_read_resolution_and_inheritance():
    g = torch.Generator().manual_seed(11)
    depths, n, heads, dim = 4, 2 * G, 2, 32
    # Block 0: a pattern of last-active loops 2/3/4 (zero-based depth 1/2/3) plus a few loop-1-only.
    count = torch.full((n,), 4)
    count[:G] = torch.tensor([2, 3, 2, 4] * 15 + [1, 2, 3, 4])
    ks = make_logical(torch.randn(n, heads, dim, generator=g), count, depths, 0.3, g)
    vs = make_logical(torch.randn(n, heads, dim, generator=g), count, depths, 0.3, g)
    store = fill(QuantizedKVStore(1, depths), 1, [ks], [vs], count, [n])
    (block,) = store.blocks[0]
    cnt = count[:G]
    for d in range(1, depths):
        assert block.rows[d].tolist() == torch.nonzero(cnt > d).flatten().tolist()
        assert block.residual_k[d].codes.shape[0] == int((cnt > d).sum())  # compact, not G rows
        assert block.residual_v[d].codes.shape[0] == int((cnt > d).sum())
    k3, v3 = store.read(0, 3, n)
    k1, v1 = store.read(0, 1, n)
    base_k, base_v = block.base_k.decode(), block.base_v.decode()

    def resolved(i):
        """base + d2 (+ d3 (+ d4)) through the explicit position -> row maps."""
        ek, ev = base_k[i].clone(), base_v[i].clone()
        for d in range(1, depths):
            rows = block.rows[d].tolist()
            if i in rows:
                r = rows.index(i)
                ek += block.residual_k[d].decode()[r]
                ev += block.residual_v[d].decode()[r]
        return ek, ev

    # The SPEC's three tokens: t1 last active at loop 2, t2 at loop 3, t4 at loop 4.
    for i, n_res in [(0, 1), (1, 2), (3, 3)]:
        assert sum(i in block.rows[d].tolist() for d in range(1, depths)) == n_res
        ek, ev = resolved(i)
        torch.testing.assert_close(k3[i], ek, atol=1e-6, rtol=0)
        torch.testing.assert_close(v3[i], ev, atol=1e-6, rtol=0)
    t4_k = base_k[3] + sum(block.residual_k[d].decode()[block.rows[d].tolist().index(3)] for d in (1, 2, 3))
    torch.testing.assert_close(k3[3], t4_k, atol=1e-6, rtol=0)
    for i in range(G):
        ek, ev = resolved(i)
        torch.testing.assert_close(k3[i], ek, atol=1e-6, rtol=0)
        torch.testing.assert_close(v3[i], ev, atol=1e-6, rtol=0)

    # Inheritance: a token active only to depth 1 reads the same at depth 3 as at depth 1 -- not
    # base + code 0 (which decodes to each residual group's minimum).
    only_d1 = torch.nonzero(cnt == 2).flatten()
    assert only_d1.numel() > 0
    assert torch.equal(k3[only_d1], k1[only_d1]) and torch.equal(v3[only_d1], v1[only_d1])
    # Such groups' minima are far from zero, so "code 0" would be visibly wrong.
    assert block.residual_k[3].minimum.float().abs().max().item() > 0.05
    # A token never recomputed after loop 1 reads its base at every depth.
    never = int(torch.nonzero(cnt == 1).flatten()[0])
    for d in range(depths):
        kd, vd = store.read(0, d, n)
        assert torch.equal(kd[never], base_k[never]) and torch.equal(vd[never], base_v[never])


def test_all_inactive_depth_has_no_residual():
    depths = 3
    count = torch.full((2 * G,), 2)
    g = torch.Generator().manual_seed(3)
    ks = make_logical(torch.randn(2 * G, 1, G, generator=g), count, depths, 0.1, g)
    store = fill(QuantizedKVStore(1, depths), 1, [ks], [[k.clone() for k in ks]], count, [2 * G])
    (block,) = store.blocks[0]
    assert 1 in block.rows and 2 not in block.rows
    assert 2 not in block.residual_k and 2 not in block.residual_v
    k1, _ = store.read(0, 1, 2 * G)
    k2, _ = store.read(0, 2, 2 * G)
    assert torch.equal(k1, k2)


# --------------------------------------------------------------------------------------------
# Rolling tail
# --------------------------------------------------------------------------------------------

chunk_lists = st.lists(
    st.one_of(st.just(1), st.integers(1, 70), st.sampled_from([64, 128, 200])), min_size=1, max_size=10
)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(chunks=chunk_lists, layout=st.sampled_from([(64, 64), (16, 32), (32, 96)]), seed=st.integers(0, 2**16))
def test_tail_rollover(chunks, layout, seed):
    gs, tail = layout
    depths, layers, heads, dim = 2, 2, 1, 64
    n = sum(chunks)
    g = torch.Generator().manual_seed(seed)
    count = torch.randint(1, depths + 1, (n,), generator=g)
    ks = [[x.to(torch.bfloat16) for x in make_logical(torch.randn(n, heads, dim, generator=g), count, depths, 0.1, g)]
          for _ in range(layers)]
    vs = [[x.to(torch.bfloat16) for x in make_logical(torch.randn(n, heads, dim, generator=g), count, depths, 0.1, g)]
          for _ in range(layers)]
    store = QuantizedKVStore(layers, depths, gs, tail)
    appended = 0
    for c in chunks:
        for layer in range(layers):
            sl = slice(appended, appended + c)
            store.append(layer, [k[sl] for k in ks[layer]], [v[sl] for v in vs[layer]], count[sl])
            total = appended + c
            flushed = store.flushed[layer]
            tail_len = store.tail_k[layer][0].shape[0]
            assert flushed + tail_len == total
            assert flushed % gs == 0
            assert [b.start for b in store.blocks[layer]] == list(range(0, flushed, gs))
            if total >= tail:
                assert tail <= tail_len <= tail + gs - 1
            else:
                assert flushed == 0
            assert all(t.shape[0] == tail_len for t in store.tail_k[layer] + store.tail_v[layer])
            assert store.tail_count[layer].shape[0] == tail_len
        appended += c
        assert store.length == appended
        # The tail reads back exactly (same dtype, same bits); length truncates.
        for layer in range(layers):
            f = store.flushed[layer]
            for d in range(depths):
                k, v = store.read(layer, d, appended)
                assert k.dtype == torch.bfloat16 and k.shape[0] == appended
                assert torch.equal(k[f:], ks[layer][d][f:appended])
                assert torch.equal(v[f:], vs[layer][d][f:appended])
        k_short, _ = store.read(0, 0, min(appended, 5))
        assert k_short.shape[0] == min(appended, 5)

    # Block contents depend only on the block's tokens, never on the chunking.
    whole = QuantizedKVStore(layers, depths, gs, tail)
    fill(whole, layers, ks, vs, count, [n])
    for layer in range(layers):
        assert len(whole.blocks[layer]) == len(store.blocks[layer])
        for a, b in zip(whole.blocks[layer], store.blocks[layer]):
            assert torch.equal(a.base_k.codes, b.base_k.codes) and torch.equal(a.base_v.scale, b.base_v.scale)
            assert a.rows.keys() == b.rows.keys()
            for d in a.rows:
                assert torch.equal(a.rows[d], b.rows[d])
                assert torch.equal(a.residual_k[d].codes, b.residual_k[d].codes)
                assert torch.equal(a.residual_v[d].minimum, b.residual_v[d].minimum)


def test_decode_style_single_tokens_flush_whole_blocks():
    depths, heads, dim = 3, 1, 64
    g = torch.Generator().manual_seed(5)
    store = QuantizedKVStore(1, depths)
    n_prompt = 100
    prompt = torch.randn(n_prompt, heads, dim, generator=g)
    count = torch.tensor([1, 2, 3] * 33 + [3])
    store.append(0, [prompt] * depths, [prompt] * depths, count)
    assert store.flushed[0] == 0 and store.length == 100
    tail_sizes = []
    for _ in range(100):  # decode tokens update every depth
        tok = [torch.randn(1, heads, dim, generator=g) for _ in range(depths)]
        store.append(0, tok, tok, torch.tensor([depths]))
        tail_sizes.append(store.tail_k[0][0].shape[0])
        assert G <= tail_sizes[-1] <= 2 * G - 1
    assert store.length == 200
    assert store.flushed[0] == 128  # flushed at 128 and 192 appended tokens
    assert tail_sizes[27] == 64 and tail_sizes[26] == 127  # the flush at 128: 127 -> 64
    # Decode tokens carry a residual at every depth.
    last_block = store.blocks[0][-1]
    assert last_block.start == 64
    for d in range(1, depths):
        assert set(range(100 - 64, G)) <= set(last_block.rows[d].tolist())


# --------------------------------------------------------------------------------------------
# Byte accounting
# --------------------------------------------------------------------------------------------


def retention_counts(n: int) -> torch.Tensor:
    """Depth counts for retention [1, 1, 0.25, 0.10]: 10% run 4 loops, 15% run 3, the rest 2."""
    r = torch.arange(n) % 20
    return torch.where(r < 2, 4, torch.where(r < 5, 3, 2))


def quant_store(n: int, count: torch.Tensor, heads=2, dim=64, depths=4, layers=2):
    g = torch.Generator().manual_seed(n)
    ks = [[x.to(torch.bfloat16) for x in make_logical(torch.randn(n, heads, dim, generator=g), count, depths, 0.1, g)]
          for _ in range(layers)]
    vs = [[x.to(torch.bfloat16) for x in make_logical(torch.randn(n, heads, dim, generator=g), count, depths, 0.1, g)]
          for _ in range(layers)]
    return fill(QuantizedKVStore(layers, depths), layers, ks, vs, count, [n // 2, n - n // 2])


def test_nbytes_accounting():
    n, heads, dim, depths, layers = 2048, 2, 64, 4, 2
    count = retention_counts(n)
    store = quant_store(n, count, heads, dim, depths, layers)
    nb = store.nbytes()
    flushed = store.flushed[0]
    tail_len = n - flushed
    hd = heads * dim
    # Dense BF16 equivalent: every token, K and V, every depth, every layer.
    assert nb.dense_equivalent == n * hd * 2 * 2 * depths * layers
    # Payload: 4 bits per stored value, residuals only for the active rows (compacted).
    fc = count[:flushed]
    stored_rows = flushed + sum(int((fc > d).sum()) for d in range(1, depths))
    assert nb.payload == stored_rows * hd // 2 * 2 * layers
    # Parameters: FP16 min and scale per group. K: one group per channel per block and depth
    # (residual groups over the block's active rows); V: one group per token per 64 channels.
    n_blocks = flushed // G
    k_groups = n_blocks * hd * depths  # every block has active rows at every depth here
    v_groups = stored_rows * hd // G
    assert nb.params == (k_groups + v_groups) * 2 * 2 * layers
    for b in store.blocks[0]:
        for q in [b.base_k, b.base_v, *b.residual_k.values(), *b.residual_v.values()]:
            assert q.minimum.dtype == torch.float16 and q.scale.dtype == torch.float16
    # Tail: BF16 at every depth.
    assert nb.tail == tail_len * hd * 2 * 2 * depths * layers
    # Position -> row maps are counted: at least one int32 per compact residual row.
    assert nb.maps > 0
    assert nb.maps >= 4 * sum(int((fc > d).sum()) for d in range(1, depths))
    assert nb.total == nb.payload + nb.params + nb.maps + nb.tail
    # Payload-only ratio of the flushed part: 4 x 16 bits vs 2.35 x 4 bits, about 6.8.
    payload_ratio = (flushed * hd * 2 * 2 * depths * layers) / nb.payload
    assert payload_ratio == pytest.approx(64 / (4 * 2.35), rel=0.02)
    assert nb.ratio > 4


def test_nbytes_ratio_grows_with_length_and_sparsity():
    short = quant_store(100, retention_counts(100)).nbytes()
    assert short.payload == 0 and short.params == 0 and short.maps == 0
    assert short.ratio == pytest.approx(1.0)  # all in the BF16 tail
    mid = quant_store(512, retention_counts(512)).nbytes()
    long = quant_store(2048, retention_counts(2048)).nbytes()
    assert 1 < mid.ratio < long.ratio
    # Compacting residuals is what saves capacity: all tokens active at every depth costs more.
    dense_active = quant_store(2048, torch.full((2048,), 4)).nbytes()
    assert dense_active.payload > long.payload
    assert dense_active.ratio < long.ratio
    assert dense_active.ratio > 1


# --------------------------------------------------------------------------------------------
# DenseKVStore
# --------------------------------------------------------------------------------------------


def test_dense_store_reads_what_was_appended():
    g = torch.Generator().manual_seed(9)
    layers, depths, heads, dim = 2, 3, 2, 4
    chunks = [5, 1, 1, 9]
    n = sum(chunks)
    ks = [[torch.randn(n, heads, dim, generator=g).to(torch.bfloat16) for _ in range(depths)] for _ in range(layers)]
    vs = [[torch.randn(n, heads, dim, generator=g).to(torch.bfloat16) for _ in range(depths)] for _ in range(layers)]
    store = DenseKVStore(layers, depths)
    start = 0
    for c in chunks:
        for layer in range(layers):
            sl = slice(start, start + c)
            store.append(layer, [k[sl] for k in ks[layer]], [v[sl] for v in vs[layer]], torch.full((c,), depths))
            if layer < layers - 1:
                assert store.length == start  # counted once the last layer is in
        start += c
        assert store.length == start
        for layer in range(layers):
            for d in range(depths):
                k, v = store.read(layer, d, start)
                assert torch.equal(k, ks[layer][d][:start]) and torch.equal(v, vs[layer][d][:start])
                assert k.dtype == torch.bfloat16
    k, v = store.read(1, 2, 3)
    assert torch.equal(k, ks[1][2][:3]) and torch.equal(v, vs[1][2][:3])
    nb = store.nbytes()
    assert nb.payload == nb.dense_equivalent == n * heads * dim * 2 * 2 * depths * layers
    assert nb.ratio == 1.0


def test_dense_and_quantized_agree_on_tail_and_roughly_on_blocks():
    g = torch.Generator().manual_seed(10)
    depths, n = 3, 3 * G
    count = torch.randint(1, depths + 1, (n,), generator=g)
    ks = make_logical(torch.randn(n, 1, G, generator=g), count, depths, 0.2, g)
    vs = make_logical(torch.randn(n, 1, G, generator=g), count, depths, 0.2, g)
    dense = fill(DenseKVStore(1, depths), 1, [ks], [vs], count, [40, 1, 1, n - 42])
    quant = fill(QuantizedKVStore(1, depths), 1, [ks], [vs], count, [40, 1, 1, n - 42])
    assert dense.length == quant.length == n
    for d in range(depths):
        kd, vd = dense.read(0, d, n)
        kq, vq = quant.read(0, d, n)
        f = quant.flushed[0]
        assert f == 2 * G  # 192 tokens: two whole blocks flushed, 64 in the tail
        assert torch.equal(kq[f:], kd[f:]) and torch.equal(vq[f:], vd[f:])
        # INT4 with per-group ranges of ~6 sigma: error well under a unit.
        assert (kq[:f] - kd[:f]).abs().max().item() < 0.5
        assert (vq[:f] - vd[:f]).abs().max().item() < 0.5
