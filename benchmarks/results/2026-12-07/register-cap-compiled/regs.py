"""Does the read-and-attend correction's register cap hold inside a compiled graph?"""
import re, torch, inspect
from tests.lowering.test_correction_read_attend import _case
from flashloop_compile.lowering import packed_sparse_ops as PS
from flashloop_compile.lowering.kernels import packed_read as PR
import torch._inductor.runtime.triton_heuristics as th
src = inspect.getsource(th.CachingAutotuner._create_compile_options)
print("torch", torch.__version__, "inductor compile options mention maxnreg:", "maxnreg" in src)
for depth in (2, 3):
    tensors, args, inflight = _case(torch.bfloat16, depth)
    cu = lambda t: t.cuda() if isinstance(t, torch.Tensor) else t
    tensors = tuple(map(cu, tensors)); args = tuple(map(cu, args)); inflight = tuple(map(cu, inflight))
    f = torch.compile(lambda *a: torch.ops.flashloop.packed_correction_attention(*a), backend="inductor", fullgraph=True)
    got = f(*args, *inflight, depth, *tensors, 0.125)
    want = PS.packed_correction_attention_aten(*[t.cpu() if isinstance(t, torch.Tensor) else t for t in (*args, *inflight, depth, *tensors, 0.125)])
    err = (got.float().cpu() - want.float()).abs().max().item()
    regs = []
    for dev, caches in PR._read_attend_kernel.device_caches.items():
        for k in caches[0].values():
            k._init_handles() if hasattr(k, "_init_handles") else None
            regs.append((k.n_regs, getattr(k.metadata, "maxnreg", None)))
    print(f"depth {depth}: max err vs aten {err:.3g}; direct _read_attend_kernel compiles (n_regs, maxnreg): {regs}")
