import os, sys
os.environ["TRITON_INTERPRET"] = "0"
sys.path.insert(0, "scripts"); sys.path.insert(0, ".gpurun")
import kernel_report as KR
import torch
from triton.runtime.driver import driver
driver.set_active(KR._AheadOfTimeDriver())
from flashloop_compile.lowering.kernels import common, packed_read as PR
common.cpu_semantics = lambda device: False
import rows_proto as RP
for depth in (2, 3):
    for nreg in (0, 96):
        sink = []
        wrap = KR._compiling_wrap(sink)
        t, q, kv, pos, out = KR._decode_setup(4, 32768)
        keys = torch.zeros(4, 16, 1, 3277, dtype=torch.int32)
        count = torch.full((4, 16, 1), 3277, dtype=torch.int32)
        sel = torch.zeros(4, 16, 3277, 3, dtype=torch.int32)
        PR.PACKED_READ["attend_maxnreg"] = (0, 0, 0, nreg)
        PR.launch_packed_read_attend(t, q, keys, count, depth, 0.088, inflight=(pos, kv, kv), wrap=wrap)
        RP.launch(t, q, keys, count, depth, 0.088, inflight=(pos, kv, kv), selrows=sel, wrap=wrap, maxnreg=nreg if depth == 3 else 0)
        for name, grid, kw, comp in sink:
            st = KR._sass_stats(comp.asm["cubin"], None, name)
            print(depth, nreg, name, {k: st[k] for k in ("regs", "spill_ops", "instructions", "loop")}, st["loads"])
