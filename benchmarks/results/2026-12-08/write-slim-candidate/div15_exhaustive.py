"""_div15 (write_slim.patch, packed_codec) against the correctly rounded FP32 a / 15 for every FP32
significand at several exponents, on the CPU (numpy, about 10 s):

    q0 = a * fl(1/15);  r = (a - 16 * q0) + q0;  q = q0 + r * fl(1/15)

- r equals a - 15 * q0 exactly (checked against float64);
- q, with its product and sum rounded separately (the interpreter) or fused (an FMA on the GPU),
  equals RN(a / 15) from an integer division;
- no fused sum lies within two float64 ulps of an FP32 midpoint, so the float64 model of the FMA
  is the FMA.
Prints the mismatch counts (all 0) and exits 1 on any."""

import sys

import numpy as np

m = np.arange(1 << 23, 1 << 24, dtype=np.int64)  # every 24-bit significand
inv = np.float32(1.0) / np.float32(15.0)


def rn_div15(e: int) -> np.ndarray:
    """RN(m * 2**e / 15) in float32, by integer division and an explicit round to nearest even."""
    s = 8
    q, r = np.divmod(m << s, 15)
    shift = np.floor(np.log2(q.astype(np.float64))).astype(np.int64) + 1 - 24
    keep = q >> shift
    dropped = q - (keep << shift)
    lhs, rhs = dropped * 15 + r, (np.int64(1) << (shift - 1)) * 15  # dropped + r/15 against half
    keep = keep + ((lhs > rhs) | ((lhs == rhs) & ((keep & 1) == 1)))
    return (keep.astype(np.float64) * np.exp2((shift + e - s).astype(np.float64))).astype(np.float32)


bad = 0
for e in (-100, -40, -23, -1, 0, 7, 23, 40, 100):
    a = (m.astype(np.float64) * 2.0**e).astype(np.float32)
    want = rn_div15(e)
    q0 = a * inv
    r = (a - q0 * np.float32(16.0)) + q0
    exact_r = int(((r.astype(np.float64)) != (a.astype(np.float64) - 15.0 * q0.astype(np.float64))).sum())
    twice = q0 + r * inv  # product and sum rounded separately
    t = r.astype(np.float64) * np.float64(inv) + q0.astype(np.float64)
    fused = t.astype(np.float32)
    half = np.spacing(np.abs(fused)).astype(np.float64) / 2
    near = int((np.minimum(np.abs(t - (fused - half)), np.abs(t - (fused + half))) <= 2 * np.spacing(np.abs(t))).sum())
    counts = (exact_r, int((twice != want).sum()), int((fused != want).sum()), near, int((q0 != want).sum()))
    print(f"2^{e:4d}: remainder inexact {counts[0]}, rounded twice {counts[1]}, fused {counts[2]}, "
          f"near a midpoint {counts[3]} (a * fl(1/15) alone: {counts[4]} of {m.size})")
    bad += sum(counts[:4])
sys.exit(1 if bad else 0)
