"""Static report of the packed-KV Triton kernels as compiled for the H200 (sm_90), on a machine
without a GPU: registers, spills, shared memory and the SASS instruction mix of each launch.

Triton compiles ahead of time for any target (ptxas, cuobjdump and nvdisasm ship with the Triton
wheel), so the kernels the GPU runs can be inspected where no GPU is. This is what a device minute
cannot be spent on: a variant that spills, or whose loads did not vectorize (LDG.E.U8 instead of
LDG.E.128), or that reduces across warps through shared memory every key tile (BAR.SYNC), shows
here before it is timed.

    python scripts/kernel_report.py                       # packed decode (fast, generic), prefill, sparse decode, read, write
    python scripts/kernel_report.py --only attend --depth 3  # the packed corrections alone (read and attend, V only)
    python scripts/kernel_report.py --only read --depth 3  # loop depth of the decode and read launches (a bulk-kernel constexpr)
    python scripts/kernel_report.py --only decode --tuning '{"block_n": 64}'
    python scripts/kernel_report.py --dump out/sass        # also writes each kernel's SASS and loops (.loops.txt)
    python scripts/kernel_report.py --only write --depth 0 --lines 8  # the source lines that cost the most SASS

The launchers run on CPU tensors at real shapes (ouro-1.4b: 16 kv heads x 128, bf16) with a fake
Triton driver that reports an sm_90 target, and every launch is compiled (JITFunction.warmup)
instead of run. The constexprs are the GPU's (the CPU-only choices the launchers make for the
interpreter are switched off). Register counts are ptxas's; a kernel needs at most 65536 /
(32 * num_warps) registers per thread to fit one program per SM and half that for two.
"""

from __future__ import annotations

import argparse
import dataclasses
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

if __name__ == "__main__":
    # compile, do not interpret (before triton's first import). Imported as a module (a test
    # reading one helper) it must not touch the environment: a process-wide TRITON_INTERPRET=0
    # sent every later interpreter test of that pytest worker to the compiled path
    os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TARGET = GPUTarget("cuda", 90, 32)


class _AheadOfTimeDriver:
    """Enough of Triton's driver interface for JITFunction.warmup to compile for TARGET."""

    def get_current_target(self):
        return TARGET

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda


def _compiling_wrap(sink: list):
    """A launcher ``wrap``: records each launch and compiles it for TARGET instead of running it."""

    def wrap(kernel):
        class _Grid:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    compiled = kernel.warmup(*args, grid=grid, **kwargs)
                    if isinstance(compiled, list):  # an Autotuner (launch options pinned by one config)
                        compiled = compiled[0]
                    fn = kernel.fn
                    while hasattr(fn, "fn"):
                        fn = fn.fn
                    sink.append((fn.__name__, grid, kwargs, compiled))

                return launch

        return _Grid()

    return wrap


def _sass_stats(cubin: bytes, dump: Path | None, name: str, lines: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([BIN / "cuobjdump", "-res-usage", path], capture_output=True, text=True).stdout
        # Triton's cubins carry line info: -g marks each run of instructions with its source line
        sass = subprocess.run([BIN / "nvdisasm", "-c", "-g", "-hex", path], capture_output=True, text=True).stdout
    if dump is not None:
        dump.mkdir(parents=True, exist_ok=True)
        (dump / f"{name}.sass").write_text(sass)
    loops = _loops(sass)
    if dump is not None and loops:
        (dump / f"{name}.loops.txt").write_text("".join(
            f"{n} instructions: " + ", ".join(f"{k} {v}" for k, v in mix.most_common()) + "\n" for n, mix in loops))
    regs = re.search(r"REG:(\d+)", usage)
    stack = re.search(r"STACK:(\d+)", usage)
    ops = collections.Counter()
    for line in sass.splitlines():
        m = _INSTR.match(line)
        if m:
            ops[m.group(1)] += 1
    loads = {k: v for k, v in ops.items() if k.startswith(("LDG", "LDS", "LDL", "LDSM"))}
    stores = {k: v for k, v in ops.items() if k.startswith(("STG", "STS", "STL"))}
    return {
        "regs": int(regs.group(1)) if regs else None,
        "stack_bytes": int(stack.group(1)) if stack else None,
        "spill_ops": sum(v for k, v in ops.items() if k.startswith(("LDL", "STL"))),
        "instructions": sum(ops.values()),
        "bar_sync": sum(v for k, v in ops.items() if k.startswith("BAR")),
        "shfl": sum(v for k, v in ops.items() if k.startswith("SHFL")),
        "mma": sum(v for k, v in ops.items() if k.startswith(("HMMA", "HGMMA", "WGMMA"))),
        "loop": max((n for n, _ in loops), default=0),
        "loop_mix": dict(loops[0][1]) if loops else {},  # the largest loop's opcodes (no modifiers)
        "loads": dict(sorted(loads.items())),
        "stores": dict(sorted(stores.items())),
        "lines": [{"line": where, "instructions": n, "mix": dict(mix.most_common(5))}
                  for where, n, mix in _by_line(sass)[:lines]],
    }


_LINE = re.compile(r'\s*//## File "([^"]+)", line (\d+)')


def _by_line(sass: str) -> list[tuple[str, int, collections.Counter]]:
    """SASS instructions per source line of a listing with line info (``nvdisasm -g``), as
    (file name:line, instructions, opcode mix without modifiers), most first. A helper inlined
    into the kernel counts at its own line (``packed_codec.py:110``), summed over its call sites.
    The counts are static: a loop's body counts once, and so does a branch that never runs."""
    where, mix = None, collections.defaultdict(collections.Counter)
    for line in sass.splitlines():
        m = _LINE.match(line)
        if m:
            where = f"{Path(m.group(1)).name}:{m.group(2)}"
            continue
        m = _INSTR.match(line)
        if m and where is not None:
            mix[where][m.group(1).split(".")[0]] += 1
    return sorted(((w, sum(c.values()), c) for w, c in mix.items()), key=lambda x: -x[1])


_INSTR = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def _loops(sass: str) -> list[tuple[int, collections.Counter]]:
    """The loops of a SASS listing (a label ``.L_x_N:`` and a later branch back to it), each as
    (instructions in the body, opcode mix without modifiers), largest first. A key-tile loop's
    count is the per-tile cost that launch points and layouts change; they showed synchronous
    loads and the per-tile conversions of the linear kernels."""
    ops, labels, loops = [], {}, []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(ops)
            continue
        m = _INSTR.match(line)
        if m:
            ops.append(m.group(1))
            target = re.search(r"(\.L_x_\d+)", m.group(2))
            if m.group(1).startswith("BRA") and target and labels.get(target.group(1), len(ops)) < len(ops) - 1:
                body = ops[labels[target.group(1)]:]
                loops.append((len(body), collections.Counter(o.split(".")[0] for o in body)))
    return sorted(loops, key=lambda x: -x[0])


def _decode_setup(B: int, S: int, T: int = 1):
    from flashloop_compile.runtime import PackedKVCache

    H, D, R = 16, 128, 4
    cache = PackedKVCache(1, R, B, S, H, D, dtype=torch.bfloat16, device="cpu")
    q = torch.empty(B, H, T, D, dtype=torch.bfloat16)
    kv = torch.empty(B, H, T, D, dtype=torch.bfloat16)
    pos = torch.full((B, T), S - T, dtype=torch.int64) + torch.arange(T)
    out = torch.empty(B, H, T, D, dtype=torch.bfloat16)
    return cache.op_tensors(0), q, kv, pos, out


def launches(only: str | None, tuning: dict, depth: int = 1) -> list[tuple]:
    """(label, grid, launch kwargs, compiled kernel) of every launch of the chosen groups."""
    from flashloop_compile.lowering.kernels import common
    from flashloop_compile.lowering.kernels import packed_attention as PA, packed_read as PR, packed_write as PW

    sink: list = []
    wrap = _compiling_wrap(sink)
    labels = []

    def run(label, fn):
        n = len(sink)
        fn()
        labels.extend(f"{label} [{sink[i][0]}]" for i in range(n, len(sink)))

    common.cpu_semantics = lambda device: False  # the GPU's constexprs (bf16 dots, the GPU's tiles)
    if only in (None, "decode"):
        t, q, kv, pos, out = _decode_setup(4, 32768)
        run("decode fast B4 32K", lambda: PA.launch_packed_attention(t, q, kv, kv, pos, pos, depth, 0.088, out, wrap=wrap, tuning=tuning))
        run("decode generic B4 32K", lambda: PA.launch_packed_attention(t, q, kv, kv, pos, pos, depth, 0.088, out, wrap=wrap, fast=False))
    if only in (None, "prefill"):
        t, q, kv, pos, out = _decode_setup(1, 8192 + 256, T=8192)
        pos = torch.arange(8192)[None]
        run("prefill 8K", lambda: PA.launch_packed_attention(t, q, kv, kv, pos, pos, 0, 0.088, out, wrap=wrap, tuning=tuning))
    if only in (None, "sparse"):
        from flashloop_compile.lowering.kernels import correction as CO, reference_attention as RA, sparse_config as SC

        SC.check_runnable = lambda kernel, device: None
        RA.sm_count = CO.sm_count = lambda device: 132
        SC.Launcher.__call__ = lambda self, kernel, grid: wrap(kernel)[grid]
        from flashloop_compile.lowering.kernels import gluon_scores as GS

        GS._run = lambda kernel, grid: wrap(kernel)[grid]  # the tensor-core scores' launches (an opaque op)
        from flashloop_compile.lowering.kernels import gluon_pv as GPV

        GPV._run = lambda kernel, grid: wrap(kernel)[grid]  # ... and the tensor-core PV's
        B, H, S, D = 4, 16, 32768, 128
        q = torch.empty(B, H, 1, D, dtype=torch.bfloat16)
        k = torch.empty(B, H, S, D, dtype=torch.bfloat16)
        mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        caps = [-(-S // 10)]
        refs = []
        run("sparse reference B4 32K", lambda: refs.append(RA.reference_attention_triton(q, k, k, mask, 0.088, [0.1], caps)))
        _, keys, count, mass, o_ref, c_ref = refs[0]
        run("sparse correction B4 32K", lambda: CO.correction_attention_triton(q, k, k, keys, count, mass, o_ref, c_ref, 0.088))
        for bk, st in ((64, 1), (32, 2)):  # the gathers not pipelined, and at 32-key tiles (num_stages_corr)
            cfg = dataclasses.replace(SC.DEFAULT_CONFIG, block_k=bk, num_stages_corr=st)
            run(f"sparse correction bk{bk} stages{st} B4 32K",
                lambda cfg=cfg: CO.correction_attention_triton(q, k, k, keys, count, mass, o_ref, c_ref, 0.088, config=cfg))
        t = _decode_setup(B, S)[0]
        window = torch.empty(B, H, 192, D, dtype=torch.bfloat16)  # the code-domain reference: codes + a window
        linear = (t, depth, torch.full((B,), S - 128, dtype=torch.int64))
        # the tl kernels (_scores_linear_kernel, _pv_linear_kernel): the body where the Gluon ones do not fit
        fits = GS.fits, GPV.fits
        GS.fits = GPV.fits = lambda *args: False
        run("sparse linear reference B4 32K",
            lambda: RA.reference_attention_triton(q, window, window, mask, 0.088, [0.1], caps, linear=linear))
        GS.fits, GPV.fits = fits
        run("sparse linear reference mma B4 32K",  # gluon_scores.py, gluon_pv.py: the body at this shape
            lambda: RA.reference_attention_triton(q, window, window, mask, 0.088, [0.1], caps, linear=linear))
    if only in (None, "read"):
        t, q, kv, pos, out = _decode_setup(4, 32768)
        grid_pos = torch.arange(32768)[None].expand(4, -1)
        full = torch.empty(4, 16, 32768, 128, dtype=torch.bfloat16)
        run("read B4 32K (loop-2 reference)", lambda: PR.launch_packed_read(t, grid_pos, depth, full, full, wrap=wrap, bulk=False))
        run("read B4 32K bulk", lambda: PR.launch_packed_read(t, grid_pos, depth, full, full, wrap=wrap, bulk=True))
    if only in (None, "read", "attend"):
        # a correction's selected keys read and attended in one pass
        t, q, kv, pos, out = _decode_setup(4, 32768)
        keys = torch.zeros(4, 16, 1, 3277, dtype=torch.int32)
        count = torch.full((4, 16, 1), 3277, dtype=torch.int32)
        run(f"read attend B4 32K (correction, {PR.PACKED_READ['attend_block_p'][min(depth, 3)]} keys)",
            lambda: PR.launch_packed_read_attend(t, q, keys, count, depth, 0.088, inflight=(pos, kv, kv), wrap=wrap))
        probs = torch.zeros(4, 16, 1, 3277)
        run("read values B4 32K (reuse_selected_probabilities' V-only correction)",
            lambda: PR.launch_packed_read_values(t, keys, count, probs, depth, inflight=(pos, kv), wrap=wrap))
    if only in (None, "write"):
        t, q, kv, pos, out = _decode_setup(1, 8192 + 256, T=8192)
        pos = torch.arange(8192)[None]
        run(f"write 8K depth {depth}", lambda: PW.launch_packed_kv_write(t, kv, kv, pos, depth, wrap=wrap))
        t1, _q1, kv1, pos1, _out1 = _decode_setup(4, 32768)  # a decode step's write (ONE_TOKEN)
        run("write one token depth 1", lambda: PW.launch_packed_kv_write(t1, kv1, kv1, pos1, 1, wrap=wrap))
    return [(label, grid, kwargs, compiled) for label, (_, grid, kwargs, compiled) in zip(labels, sink)]


def resident_warps(regs: int | None, warps: int, shared: int) -> int | None:
    """Warps of this kernel one H100/H200 SM holds at once (64K registers allocated per warp in
    units of 256, at most 64 warps and 32 programs, 227 KB of shared memory per SM)."""
    if regs is None:
        return None
    per_warp = -(-regs * 32 // 256) * 256
    programs = min(65536 // (per_warp * warps), 64 // warps, 32, (227 * 1024) // max(shared, 1))
    return programs * warps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["decode", "prefill", "sparse", "read", "attend", "write"])
    ap.add_argument("--tuning", default="{}", help="JSON launch overrides for the attention launches")
    ap.add_argument("--depth", type=int, default=1, help="loop depth of the decode, read and prompt-write launches (0..R-1; a constexpr of the bulk and write kernels)")
    ap.add_argument("--dump", type=Path, help="write each kernel's SASS and TTGIR here")
    ap.add_argument("--json", action="store_true", help="one JSON line per kernel instead of the table")
    ap.add_argument("--lines", type=int, default=0, metavar="N",
                    help="also the N source lines with the most SASS instructions of each kernel, and their opcodes")
    args = ap.parse_args()
    driver.set_active(_AheadOfTimeDriver())
    rows = []
    for label, grid, kwargs, compiled in launches(args.only, json.loads(args.tuning), args.depth):
        name = re.sub(r"[^A-Za-z0-9]+", "_", label).strip("_")
        stats = _sass_stats(compiled.asm["cubin"], args.dump, name, args.lines)
        ttgir = compiled.asm["ttgir"]
        if args.dump is not None:  # Triton's GPU IR: the layout conversions behind SHFL/BAR counts
            (args.dump / f"{name}.ttgir").write_text(ttgir)
        # FP32 tiles moved between layouts (through shared memory unless the layouts agree on
        # every thread's elements): what a mismatch between a kernel's tiles costs
        stats["f32_converts"] = len(re.findall(r"ttg\.convert_layout %\S+ : tensor<[0-9x]+xf32", ttgir))
        warps = compiled.metadata.num_warps
        rows.append({"kernel": label, "grid": list(grid), "num_warps": warps, "shared": compiled.metadata.shared,
                     **stats, "warps_per_sm": resident_warps(stats["regs"], warps, compiled.metadata.shared)})
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return
    print(f"{'kernel':52s} {'warps':>5s} {'regs':>5s} {'w/SM':>5s} {'spill':>5s} {'smem':>7s} {'instr':>6s} {'bar':>4s} {'shfl':>5s} {'mma':>4s} {'loop':>5s}  loads")
    for r in rows:
        loads = " ".join(f"{k}x{v}" for k, v in r["loads"].items())
        print(f"{r['kernel']:52s} {r['num_warps']:5d} {r['regs']!s:>5s} {r['warps_per_sm']!s:>5s} {r['spill_ops']:5d} {r['shared']:7d} "
              f"{r['instructions']:6d} {r['bar_sync']:4d} {r['shfl']:5d} {r['mma']:4d} {r['loop']:5d}  {loads}")
        for e in r["lines"]:
            mix = " ".join(f"{k}x{v}" for k, v in e["mix"].items())
            print(f"    {e['instructions']:6d}  {e['line']:32s} {mix}")


if __name__ == "__main__":
    main()
