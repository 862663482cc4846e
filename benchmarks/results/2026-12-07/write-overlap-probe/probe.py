"""How much of a prompt's packed write a side stream hides behind the work around it.

One B1 x T prompt site (16 heads, head_dim 128, BF16), on the GPU:
- ``layer``: an Ouro-1.4B layer's work outside attention at T tokens (QKV, o_proj, gate/up and
  down GEMMs, two RMSNorms, SiLU * up), eager;
- ``sdpa``: one dense loop's causal SDPA at T (FlashAttention / cuDNN);
- ``write dD``: the packed write at depth D from the state the lower depths leave (restored
  before every call, untimed; depths 2-3 on nested 25% / 10% of the rows, as token-sparse prefill);
- ``X + write dD serial``: both on one stream; ``X + write dD overlapped``: the write on a side
  stream forked after X's inputs and joined at the end.

hidden = overlapped vs serial: 1 - (overlapped - X) / write. Median of CUDA-event times.

    python3 benchmarks/results/2026-12-07/write-overlap-probe/probe.py [--tokens 32768]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from common import cuda_times  # noqa: E402

from flashloop_compile.lowering.kernels import packed_write as PW  # noqa: E402
from flashloop_compile.runtime import PackedKVCache  # noqa: E402

H, D, HID, INTER, R = 16, 128, 2048, 5632, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()  # without CUDA: a smoke run (TRITON_INTERPRET=1, no side stream)
    T, dev, dt = args.tokens, ("cuda" if cuda else "cpu"), (torch.bfloat16 if cuda else torch.float32)
    g = torch.Generator(device=dev).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, device=dev, dtype=dt, generator=g) * 0.02  # noqa: E731
    x = torch.randn(T, HID, device=dev, dtype=dt, generator=g)
    w_qkv, w_o, w_gu, w_d = rnd(3 * HID, HID), rnd(HID, HID), rnd(2 * INTER, HID), rnd(HID, INTER)
    n1, n2 = torch.ones(HID, device=dev, dtype=dt), torch.ones(HID, device=dev, dtype=dt)

    def layer():
        h = F.rms_norm(x, (HID,), n1)
        qkv = h @ w_qkv.t()
        a = qkv[:, :HID] @ w_o.t() + x
        gu = F.rms_norm(a, (HID,), n2) @ w_gu.t()
        return a + (F.silu(gu[:, :INTER]) * gu[:, INTER:]) @ w_d.t()

    q, k, v = (torch.randn(1, H, T, D, device=dev, dtype=dt, generator=g) for _ in range(3))

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    cache = PackedKVCache(1, R, 1, T + 256, H, D, dtype=dt, device=dev)
    pos = torch.arange(T, device=dev)[None]
    u = torch.rand(1, T, device=dev, generator=g)
    calls = [pos, pos, pos[u < 0.25][None].contiguous(), pos[u < 0.10][None].contiguous()]
    side = torch.cuda.Stream() if cuda else None
    rows = []
    cache.reset()
    for d, p in enumerate(calls):
        n = p.shape[1]
        kd, vd = (k[:, :, :n] + d).contiguous(), (v[:, :, :n] - d).contiguous()
        saved = [t.clone() for t in cache.op_tensors(0)]

        def restore(saved=saved):
            for t, s in zip(cache.op_tensors(0), saved):
                t.copy_(s)

        def write(kd=kd, vd=vd, p=p, d=d):
            PW.launch_packed_kv_write(cache.op_tensors(0), kd, vd, p, d)

        for other_name, other in (("layer", layer), ("sdpa", sdpa)):
            def serial(other=other, write=write):
                write()
                other()

            def overlapped(other=other, write=write):
                if side is None:
                    return serial()
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    write()
                other()
                main.wait_stream(side)

            t_other = statistics.median(cuda_times(other, 3, args.repeats))
            t_write = statistics.median(cuda_times(write, 3, args.repeats, before=restore))
            t_serial = statistics.median(cuda_times(serial, 3, args.repeats, before=restore))
            t_over = statistics.median(cuda_times(overlapped, 3, args.repeats, before=restore))
            hidden = 1 - (t_over - t_other) / t_write
            rows.append((d, other_name, t_other, t_write, t_serial, t_over, hidden))
            print(f"depth {d} ({n} rows) with {other_name}: {other_name} {t_other:.3f} ms, write {t_write:.3f}, "
                  f"serial {t_serial:.3f}, overlapped {t_over:.3f}: {100 * hidden:.0f}% of the write hidden", flush=True)
        restore()
        write()  # the next depth starts from this one
    if cuda:
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
