import os, sys, torch
sys.path.insert(0, ".gpurun")
from tests.lowering.test_correction_read_attend import _case
from flashloop_compile.lowering.kernels import packed_read as PR
import rows_proto as RP
for dtype, depth in [(torch.float32, 2), (torch.float32, 3), (torch.bfloat16, 3)]:
    tensors, args, inflight = _case(dtype, depth)
    q, keys, count = args[:3]
    bp = PR.PACKED_READ["attend_block_p"][depth]
    old = PR.launch_packed_read_attend(tensors, q, keys, count, depth, 0.125, inflight=inflight, block_p=bp)
    sel = RP.resolve_rows(tensors, keys, depth)
    new = RP.launch(tensors, q, keys, count, depth, 0.125, inflight=inflight, selrows=sel)
    for a, b_, n in zip(old[:3], new[:3], "mla"):
        assert torch.equal(a, b_), (depth, n, (a - b_).abs().max())
    print(dtype, depth, "bit-equal partials", old[3], "tiles")
