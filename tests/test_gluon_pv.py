"""flashloop_compile/lowering/kernels/gluon_pv.py on CPU. Gluon kernels do not run under the Triton
interpreter, so the tensor-core PV is checked here by its arithmetic: the per-tile power-of-two
factor (its exponent bit tricks), W's fp16 rounding, the codes as fp16 subnormals (the high nibble
as 16 code) and the minima and masses summed per key, emulated on benchmarks/bench_mma_pv.py's
inputs and compared with that benchmark's FP64 sums. Its layouts compile for sm_90 in
tests/test_kernel_report.py; its numerics against the tl kernel on the H200 in
tests/gpu/test_packed_gpu.py::test_mma_pv_matches_the_tl_pv_kernel."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashloop_compile.lowering.kernels import gluon_pv as GP

ROOT = Path(__file__).resolve().parents[1]
D, G, BN = GP.HEAD_DIM, GP.GROUP, GP.TILE


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_mma_pv as B
    finally:
        sys.path.pop(0)
    return B


def _factor(mx: torch.Tensor):
    """The kernel's f and 2^24 / f from the tile maximum's float bits (_add_stream)."""
    e = ((mx.float().view(torch.int32) >> 23) & 255).clamp(14, 244)
    f = ((268 - e) << 23).to(torch.int32).view(torch.float32)
    unit = ((e + 10) << 23).to(torch.int32).view(torch.float32)
    return f, unit


def test_the_power_of_two_factor_puts_the_tile_maximum_at_the_top_of_fp16():
    for mx in (1e-30, 3.1e-7, 0.0173, 0.5, 1.0, 7.9, 4000.0):
        f, unit = _factor(torch.tensor(mx))
        assert 2.0**14 <= mx * f.item() < 2.0**15, mx
        assert unit.item() * f.item() == 2.0**24  # the MMA's codes are code * 2^-24
    f, unit = _factor(torch.tensor(0.0))  # an all-zero tile (no residual present): finite factors
    assert torch.isfinite(f) and torch.isfinite(unit)


def _emulate(t, R: int, S: int):
    """O_ref / C_ref [R, D] and the masses as _mma_pv_kernel sums them (bulk below lo, whole tiles):
    per stream and tile, fp16(W * f) times exact fp16 codes * 2^-24, times 2^24 / f; the high
    nibble's channel carries 16 code and is divided by 16 at the end; minima per key and column."""
    lo = int(t["lo"][0])
    p = t["probs"].double()
    pa = p.clamp_min(0.0)
    keys = torch.where(p >= 0, p.float().view(torch.int32).clamp_max((1 << 30) - 2) + 1, 0)
    n = torch.arange(S)[None, :]
    sel = (keys > t["thr"][:, None]) | ((keys == t["thr"][:, None]) & (n <= t["cut"][:, None]))
    ps = torch.where(sel, pa, 0.0)
    H = t["v_base"].shape[1]
    out = torch.zeros(2, R, D, dtype=torch.float64)
    mins = torch.zeros(2, R, D, dtype=torch.float64)

    def codes(x):  # [.., D/2] bytes -> [.., D]: low nibble code, high nibble 16 code, as fp16 * 2^-24
        x = x.long()
        c = torch.stack([x & 15, (x >> 4) * 16], -1).flatten(-2)
        return (c.double() * 2.0**-24).half().double()  # exact: fp16 subnormals

    for r in range(R):
        b, h = divmod(r, H)
        for n0 in range(0, lo, BN):
            sl = slice(n0, n0 + BN)
            streams = [(t["v_base"][b, h, sl], t["v_base_scale"][b, h, sl], t["v_base_min"][b, h, sl],
                        torch.ones(BN, dtype=torch.bool))]
            rj = t["rows"][0, b, sl].long()
            has = rj >= 0
            gi = (t["res_layout"][0, 1] + rj.clamp_min(0)).long()
            streams.append((t["v_res"][b, h][gi], t["v_res_scale"][b, h][gi], t["v_res_min"][b, h][gi], has))
            for code_bytes, sc, mn, ok in streams:
                sc = torch.where(ok[:, None], sc.double(), 0.0)
                mn = torch.where(ok[:, None], mn.double(), 0.0)
                f, unit = _factor((pa[r, sl][:, None] * sc).float().max())  # one factor: both slots, both groups
                for slot, ws in enumerate((pa[r, sl], ps[r, sl])):
                    w = (ws[:, None] * sc).float().double()  # [BN, groups], FP32 in the kernel
                    w16 = (w * f.double()).float().half().double()
                    c = codes(code_bytes)  # [BN, D]
                    w_ch = w16.repeat_interleave(G, 1)  # each channel's group
                    out[slot, r] += (w_ch * c).sum(0) * unit.double()
                    mins[slot, r] += (ws[:, None] * mn).sum(0).repeat_interleave(G)
    odd = torch.arange(D) % 2 == 1
    out[:, :, odd] /= 16
    return out + mins, pa[:, :lo].sum(1), ps[:, :lo].sum(1)


def test_the_emulated_sum_matches_fp64_within_fp16_weights(bench):
    # the window (keys from lo on: BF16 rows on CUDA cores) is left out: lo = S - 128 and the FP64
    # sums below are taken over the bulk only
    B, H, S = 1, 2, 512
    t = bench.make_inputs(B, H, S, "cpu", nw=192)
    lo = int(t["lo"][0])
    got, m_all, m_sel = _emulate(t, B * H, S)
    window = t["probs"].clone()
    t_bulk = dict(t)
    t_bulk["probs"] = torch.where(torch.arange(S)[None, :] < lo, window, torch.full_like(window, -1.0))
    o_ref, c_ref, ma, ms = bench.reference(t_bulk)
    scale = o_ref.abs().max().item()
    # W rounded to fp16 (11 bits) per key: ~1e-4 of the output's scale, far inside bf16's 1e-2
    assert (got[0] - o_ref).abs().max() < 1e-3 * scale, (got[0] - o_ref).abs().max()
    assert (got[1] - c_ref).abs().max() < 1e-3 * scale, (got[1] - c_ref).abs().max()
    torch.testing.assert_close(m_all, ma, atol=1e-12, rtol=0)
    torch.testing.assert_close(m_sel, ms, atol=1e-12, rtol=0)
    assert 0 < ms.min() and (ms < ma).all()  # a real selection: some keys in, some out


def test_the_tensor_core_pv_applies_at_ouro_shapes_only():
    p = torch.empty(64, 32768)
    assert GP.fits(p, 128, 64, 1) and GP.fits(p, 128, 64, 3)
    assert GP.fits(p, 128, 64, 0)  # the base alone
    assert not GP.fits(p, 64, 64, 1) and not GP.fits(p, 128, 32, 1)


@pytest.mark.parametrize("rows, s", [(16, 32768), (64, 32768), (64, 8192), (4, 200), (1024, 4096)])
def test_the_split_fills_one_wave_with_whole_tiles(rows, s):
    chunk, split = GP.splits(132, rows, s)
    assert chunk % BN == 0 and (split - 1) * chunk < s <= split * chunk  # every key, no empty split
    assert rows * split <= max(12 * 132, rows)  # at most one wave of 12 programs per SM


def test_the_op_is_registered_when_the_package_is_imported():
    # as mma_linear_scores (tests/test_gluon_scores.py): Inductor's cached code calls it by name
    run = subprocess.run([sys.executable, "-c", "import torch, flashloop_compile; "
                          "print(torch.ops.flashloop.mma_linear_pv.default)"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0 and "mma_linear_pv" in run.stdout, run.stderr[-2000:]
