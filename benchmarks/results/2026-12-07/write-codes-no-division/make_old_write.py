"""Writes the packed write of d8151e0^ with that commit's ``_codes`` (a correctly rounded division
per element) defined after its imports: the A side of
``bench_packed_prefill.py --write-against FILE`` for d8151e0. Run it from the repository root
where git has the commit (the device's copy of .git can be stale), then carry the file:

    python3 benchmarks/results/2026-12-07/write-codes-no-division/make_old_write.py .gpurun/old_write.py
"""

import subprocess
import sys

REV = "d8151e0^"
KERNELS = "flashloop_compile/lowering/kernels"


def show(path: str) -> str:
    return subprocess.run(["git", "show", f"{REV}:{path}"], check=True, capture_output=True, text=True).stdout


write = show(f"{KERNELS}/packed_write.py")
codec = show(f"{KERNELS}/packed_codec.py")
codes = codec[codec.index("@triton.jit\ndef _codes("):codec.index("@triton.jit\ndef _params(")]
anchor = "from flashloop_compile.lowering.packed_layout import PackedTensors\n"
assert anchor in write
out = sys.argv[1] if len(sys.argv) > 1 else ".gpurun/old_write.py"
with open(out, "w") as f:
    f.write(write.replace(anchor, anchor + f"\n\n# {REV}'s codes: a correctly rounded division per element\n" + codes))
print(out)
