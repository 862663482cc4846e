"""flashloop_compile/lowering/kernels/gluon_scores.py on CPU. Gluon kernels do not run under the
Triton interpreter, so the tensor-core scores are checked here by their arithmetic: _prep_kernel
(a tl kernel, interpreted) and the MMA's sum over the codes as the kernel forms them (1024 + low
nibble, 1024 + 16 * high nibble, 1024 for an absent residual) against the FP64 scores of the
decoded keys, on the packed cache's layout (base, residuals per depth at their row offsets). The
kernel's layouts compile for sm_90 in tests/test_kernel_report.py; its numerics against the tl
kernel on the H200 in tests/gpu/test_packed_gpu.py::test_mma_scores_match_the_tl_scores_kernel."""

from pathlib import Path

import pytest
import torch

from flashloop_compile.lowering.kernels import gluon_scores as GS

ROOT = Path(__file__).resolve().parents[1]

D, G = GS.HEAD_DIM, GS.GROUP


def _codes(x):  # [.., D/2] bytes -> [.., D] codes, low nibble = even channel
    x = x.long()
    return torch.stack([x & 15, x >> 4], -1).flatten(-2)


def _packed(B, H, S, depth, seed):
    """The tensors _prep_kernel and the kernel read, at the cache's layout (packed_layout.py):
    k_base [B, H, S, D/2], k_base_* [B, H, NB, D], k_res [B, H, CAPT, D/2] with depth j's rows
    from res_layout[0, j], k_res_* [R-1, B, H, NB, D], rows [R-1, B, S] (-1: no residual)."""
    g = torch.Generator().manual_seed(seed)
    NB, R = S // G, 4
    cap = S
    t = dict(
        q=torch.randn(B, H, 1, D, generator=g).to(torch.bfloat16),
        k_base=torch.randint(0, 256, (B, H, S, D // 2), generator=g, dtype=torch.uint8),
        k_base_scale=(torch.rand(B, H, NB, D, generator=g) * 0.2 + 0.01).half(),
        k_base_min=(-torch.rand(B, H, NB, D, generator=g) * 1.5).half(),
        k_res=torch.randint(0, 256, (B, H, cap * (R - 1), D // 2), generator=g, dtype=torch.uint8),
        k_res_scale=(torch.rand(R - 1, B, H, NB, D, generator=g) * 0.02 + 0.001).half(),
        k_res_min=(-torch.rand(R - 1, B, H, NB, D, generator=g) * 0.15).half(),
    )
    rows = torch.full((R - 1, B, S), -1, dtype=torch.int32)
    active = torch.ones(B, S, dtype=torch.bool)
    for j in range(1, depth + 1):  # nested token-sparse residuals
        active &= torch.rand(B, S, generator=g) < 0.6
        for b in range(B):
            idx = active[b].nonzero().flatten()
            rows[j - 1, b, idx] = torch.arange(idx.numel(), dtype=torch.int32)
    t["rows"] = rows
    t["res_layout"] = torch.tensor([[0, 0, cap, 2 * cap], [cap] * R], dtype=torch.int32)
    return t


def _scores_fp64(t, depth):
    B, H, S, _ = t["k_base"].shape

    def per_key(x):  # [.., NB, D] -> [.., S, D]
        return x.double().repeat_interleave(G, dim=-2)

    k = per_key(t["k_base_min"]) + per_key(t["k_base_scale"]) * _codes(t["k_base"]).double()
    for j in range(1, depth + 1):
        r = t["rows"][j - 1].long()
        g = (t["res_layout"][0, j] + r.clamp_min(0))[:, None, :, None].expand(B, H, S, D // 2)
        c = _codes(torch.gather(t["k_res"], 2, g)).double()
        res = per_key(t["k_res_min"][j - 1]) + per_key(t["k_res_scale"][j - 1]) * c
        k = k + torch.where((r >= 0)[:, None, :, None], res, 0.0)
    return torch.einsum("bhd,bhsd->bhs", t["q"][:, :, 0].double(), k)


def _scores_emulated(t, depth):
    """The kernel's sum: sum_s sum_ch q'_s (1024 + code or 1024 + 16 code) + bias_0 + sum_j
    [residual j] bias_j, with q' and the biases from _prep_kernel (run as written)."""
    B, H, S, _ = t["k_base"].shape
    NB, rows_n = S // G, B * H
    a = torch.empty(depth + 1, rows_n, NB, D, dtype=torch.float16)
    bias = torch.empty(depth + 1, rows_n, NB, dtype=torch.float32)
    GS._prep_kernel[(rows_n, -(-NB // GS.PREP_BLOCKS))](
        t["q"], t["q"].stride(0), t["q"].stride(1), t["k_base_min"], t["k_base_scale"], t["k_res_min"],
        t["k_res_scale"], a, bias, H, B, NB, D=D, DEPTH=depth, BLK=GS.PREP_BLOCKS)

    def values(x):  # code bytes as the kernel's fp16 operands
        x = x.long()
        return torch.stack([1024 + (x & 15), 1024 + 16 * (x >> 4)], -1).flatten(-2).double()

    def per_key(x):  # [rows, NB, ...] -> [B, H, S, ...]
        return x.double().repeat_interleave(G, dim=1).view(B, H, S, *x.shape[2:])

    acc = (per_key(a[0]) * values(t["k_base"])).sum(-1) + per_key(bias[0])
    for j in range(1, depth + 1):
        r = t["rows"][j - 1].long()
        g = (t["res_layout"][0, j] + r.clamp_min(0))[:, None, :, None].expand(B, H, S, D // 2)
        v = torch.where((r >= 0)[:, None, :, None], values(torch.gather(t["k_res"], 2, g)), 1024.0)  # absent: bytes 0
        acc = acc + (per_key(a[j]) * v).sum(-1) + torch.where((r >= 0)[:, None, :], per_key(bias[j]), 0.0)
    return acc


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_the_tensor_core_scores_arithmetic_matches_the_decoded_keys(depth):
    t = _packed(2, 3, 256, depth, seed=depth)
    want, got = _scores_fp64(t, depth), _scores_emulated(t, depth)
    # q' rounded to fp16 per channel: ~1e-3 at scores of ~10-40 (unscaled); the 1024 offsets cancel
    # in FP32 without loss at this size
    assert (got - want).abs().max() < 2e-2 * max(1.0, want.abs().max().item() / 10), (got - want).abs().max()


def test_the_tensor_core_scores_apply_at_ouro_shapes_only():
    q = torch.empty(1, 16, 1, 128)
    assert GS.fits(q, 128, 64, 64, 1) and GS.fits(q, 128, 64, 64, 3)
    assert not GS.fits(q, 64, 64, 64, 1) and not GS.fits(q, 128, 32, 64, 1) and not GS.fits(q, 128, 64, 32, 1)


def test_the_op_is_registered_when_the_package_is_imported():
    # Inductor's generated code calls torch.ops.flashloop.mma_linear_scores by name; loaded from
    # the compile cache in a fresh process it runs before reference_attention's body, which
    # imports the module, is ever traced ("'_OpNamespace' 'flashloop' object has no attribute
    # 'mma_linear_scores'")
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", "import torch, flashloop_compile; "
                          "print(torch.ops.flashloop.mma_linear_scores.default, "
                          "torch.ops.flashloop.packed_correction_attention.default)"], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert run.returncode == 0 and "mma_linear_scores" in run.stdout, run.stderr[-2000:]
    assert "packed_correction_attention" in run.stdout


def test_the_op_level_benchmark_checks_against_fp64_scores():
    # benchmarks/bench_mma_scores.py: its inputs (the cache's layout) and FP64 reference, through
    # the tl kernel it times the tensor-core one against (interpreted here; the latter needs CUDA)
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_mma_scores as B
    finally:
        sys.path.pop(0)
    t = B.make_inputs(2, 2, 256, "cpu")  # batch row 1 shorter than the history: masked keys
    fn, probs, pm, pl = B.launch("tl", t, 0.088, 2)
    fn()
    ref = B.reference_scores(t, 0.088)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(probs), fin) and fin.any() and not fin.all()
    assert (probs.double() - ref)[fin].abs().max() < 1e-4
    lse = torch.logsumexp((pm + torch.log(pl)).double(), 1)
    torch.testing.assert_close(lse, torch.logsumexp(ref, 1), atol=1e-4, rtol=0)
