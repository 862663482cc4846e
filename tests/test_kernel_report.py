"""scripts/kernel_report.py compiles the packed-KV kernels for sm_90 on this CPU-only machine and
reads registers/spills from the cubin: the static check of a decode kernel's register budget."""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton


ROOT = Path(__file__).resolve().parents[1]
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def _report(*args: str, tuning: dict | None = None) -> list[dict]:
    """The rows of ``scripts/kernel_report.py --json`` with ``args`` (and ``--tuning``), in launch order."""
    extra = ["--tuning", json.dumps(tuning)] if tuning is not None else []
    run = subprocess.run(
        [sys.executable, "scripts/kernel_report.py", *args, "--json", *extra],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


def _report_by_name(*args: str) -> dict[str, dict]:
    return {r["kernel"]: r for r in _report(*args)}


def _script(name: str):
    """The module scripts/<name>.py, imported for one of its helpers (scripts/ is not a package)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "scripts"))


@pytest.mark.skipif(not (BIN / "ptxas").exists(), reason="the Triton wheel ships no ptxas here")
def test_decode_bulk_kernel_runs_one_warp_per_program_without_spills():
    # Loop 1 (depth 0, FAST_DECODE defaults): one-warp programs over 64-key tiles, split-K into
    # about 8 programs per SM, no spills; every load of the tile loop by cp.async (the codes in
    # 16-byte copies, the fp16 parameter pairs as 4-byte words), and the code conversion without
    # int -> float conversions (I2F)
    rows = _report("--only", "decode", "--depth", "0")
    kernels = [r["kernel"] for r in rows]
    assert kernels == ["decode fast B4 32K [_decode_bulk_kernel]", "decode fast B4 32K [_attn_kernel]",
                       "decode fast B4 32K [_combine_kernel]", "decode generic B4 32K [_attn_kernel]",
                       "decode generic B4 32K [_combine_kernel]"]
    bulk = rows[0]
    assert bulk["num_warps"] == 1 and bulk["spill_ops"] == 0, bulk
    assert bulk["grid"] == [64, 16], bulk  # B4 x 16 heads, 16 splits: 1024 programs
    assert bulk["loads"].get("LDGSTS.E.BYPASS.128", 0) > 0 and bulk["loads"].get("LDGSTS.E", 0) > 0, bulk["loads"]
    assert bulk["loop_mix"].get("I2F", 0) == 0, bulk["loop_mix"]
    tail = rows[1]  # FAST_DECODE tail_programs (4) programs per row for the ring and the in-flight keys
    assert tail["grid"] == [64, 4, 1] and tail["num_warps"] == 8 and tail["spill_ops"] == 0, tail


@pytest.mark.skipif(not (BIN / "ptxas").exists(), reason="the Triton wheel ships no ptxas here")
def test_decode_bulk_kernel_with_a_residual_stream_fits_one_warp():
    # depth 1 (FAST_DECODE block_n_residual: 32-key tiles; 64 spill at one warp): no spills
    bulk = _report("--only", "decode", "--depth", "1")[0]
    assert bulk["kernel"].endswith("[_decode_bulk_kernel]")
    assert bulk["num_warps"] == 1 and bulk["spill_ops"] == 0, bulk


@pytest.mark.skipif(not (BIN / "ptxas").exists(), reason="the Triton wheel ships no ptxas here")
def test_linear_reference_kernels_fit_without_spills_and_pipeline_their_parameter_loads():
    # The code-domain loop-2 reference. A 2-byte load per thread is left synchronous by
    # Triton's pipeliner (cp.async needs 4 bytes): with the V parameters loaded as fp16 the PV
    # kernel waited a memory latency per key tile (3x slower on the H200); as 32-bit words there is
    # no LDG.E.U16 left in it. Both kernels must compile without spills at ouro-1.4b's shape.
    rows = _report_by_name("--only", "sparse")
    scores = rows["sparse linear reference B4 32K [_scores_linear_kernel]"]
    pv = rows["sparse linear reference B4 32K [_pv_linear_kernel]"]
    for r in (scores, pv):
        assert r["spill_ops"] == 0 and r["warps_per_sm"] >= 8, r
    assert pv["loads"].get("LDG.E.U16", 0) == 0, pv["loads"]
    assert pv["loads"].get("LDGSTS.E.BYPASS.128", 0) > 0  # the codes by cp.async
    # the scores on tensor cores (gluon_scores.py, the body at this shape): one MMA per
    # 16 channels, stream and 16 keys (2 streams at depth 1: 16 per warp and 64-key tile), a key's
    # 16 code bytes per thread in one load, a third of the tl kernel's instructions per tile
    mma = rows["sparse linear reference mma B4 32K [_mma_scores_kernel]"]
    assert "sparse linear reference mma B4 32K [_scores_linear_kernel]" not in rows
    # (one value stored before the key loops and loaded after them: 2 local-memory ops, none in a loop)
    assert mma["spill_ops"] <= 2 and mma["mma"] == 16 and mma["loads"].get("LDG.E.128", 0) >= 4, mma
    # the report's loop is the largest: the window's BF16 loop (a few tiles per row, 374), the
    # code-domain loop is ~300 (scripts/kernel_report.py --dump)
    assert 2 * mma["loop"] < scores["loop"], (mma["loop"], scores["loop"])
    assert mma["warps_per_sm"] >= 24, mma
    # the PV on tensor cores (gluon_pv.py, the body at this shape), one-warp programs: one
    # MMA per 16 channels, stream and 16 keys (2 streams x 8 x 4 per 64-key tile), a key's 8 code
    # bytes per thread in one load, no spills at 168 registers (12 programs per SM, the split's
    # target); per 64 keys under half the tl kernel's warp instructions (4 warps, 32-key tiles)
    mpv = rows["sparse linear reference mma B4 32K [_mma_pv_kernel]"]
    assert "sparse linear reference mma B4 32K [_pv_linear_kernel]" not in rows
    assert mpv["spill_ops"] == 0 and mpv["mma"] == 64 and mpv["loads"].get("LDG.E.64", 0) >= 32, mpv
    assert mpv["warps_per_sm"] >= 12 and mpv["regs"] <= 168, mpv
    assert 2 * mpv["loop"] < 8 * pv["loop"], (mpv["loop"], pv["loop"])


@pytest.mark.skipif(not (BIN / "ptxas").exists(), reason="the Triton wheel ships no ptxas here")
def test_the_read_attend_correction_keeps_four_programs_per_sm_at_depths_two_and_three():
    # PACKED_READ attend_block_p: 16 keys per program at depth 3, where 32 took 176 registers (two
    # programs per SM) and lost per site. attend_maxnreg caps depths 2 and 3 at 128 registers: four
    # programs per SM instead of three (168 uncapped), 2-5% faster per B1 x 32K site
    # (benchmarks/results/2026-12-07/correction-chunk-layout); the tile's codes stay in 128-bit
    # loads (uncapped, the V-only correction of reuse_selected_probabilities: no spills)
    for depth, tiles in ((2, 103), (3, 205)):  # 3277 selected keys in tiles of 32 and 16
        row, values = _report("--only", "attend", "--depth", str(depth))
        assert row["kernel"].endswith("[_read_attend_kernel]") and row["grid"] == [4, 16, tiles], row
        assert row["regs"] <= 128 and row["warps_per_sm"] >= 16, row
        assert row["loads"].get("LDG.E.128", 0) > 0, row["loads"]
        assert values["kernel"].endswith("[_read_values_kernel]") and values["grid"] == [4, 16, tiles], values
        assert values["spill_ops"] == 0, values


@pytest.mark.skipif(not (BIN / "ptxas").exists(), reason="the Triton wheel ships no ptxas here")
def test_the_read_attend_bulk_tile_lays_keys_on_lanes_and_channel_chunks_on_warps(tmp_path):
    # _attend_bulk_tile's [keys, chunks, 16 pairs] tile: a key per lane, a 16-byte chunk of its
    # codes per warp, so the softmax and PV reductions over the tile's keys stay inside a warp and
    # only the scores' sum over chunks crosses warps. Triton lays [32 keys, 64 pairs] tiles out with
    # keys over 8 lanes x 4 warps (shared-memory reductions per tile: 80 shared stores and 37
    # barriers per program at depth 2 against 42 and 28 with this tile)
    run = subprocess.run(
        [sys.executable, "scripts/kernel_report.py", "--only", "attend", "--depth", "2", "--json", "--dump", str(tmp_path)],
        cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=900,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    row = json.loads(run.stdout.splitlines()[0])
    ttgir = next(tmp_path.glob("read_attend_*_read_attend_kernel.ttgir")).read_text()
    assert ("sizePerThread = [1, 1, 16], threadsPerWarp = [32, 1, 1], warpsPerCTA = [1, 4, 1]" in ttgir), (
        [line for line in ttgir.splitlines() if line.startswith("#blocked")])
    shared_stores = sum(n for op, n in row["stores"].items() if op.startswith("STS"))
    assert shared_stores <= 48 and row["bar_sync"] <= 30, (row["stores"], row["bar_sync"])


def test_loops_counts_each_loop_body_from_its_label_to_the_branch_back():
    # The per-tile instruction count of a key-tile loop (the report's "loop" column): a label and a
    # later branch back to it; a forward branch to a later label is not a loop.
    _loops = _script("kernel_report")._loops
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
    .L_x_1:
        /*0010*/                   HADD2.F32 R2, -RZ, R3.H0_H0 ;
        /*0020*/                   FFMA R4, R2, R5, R4 ;
        /*0030*/               @P0 BRA `(.L_x_2) ;
        /*0040*/                   FFMA R4, R2, R5, R4 ;
    .L_x_2:
        /*0050*/                   ISETP.GE.AND P1, PT, R6, R7, PT ;
        /*0060*/              @!P1 BRA `(.L_x_1) ;
        /*0070*/                   EXIT ;
    """
    (n, mix), = _loops(sass)
    assert n == 6 and mix == {"HADD2": 1, "FFMA": 2, "BRA": 2, "ISETP": 1}


def test_by_line_counts_each_instruction_at_the_source_line_marked_before_it():
    # `--lines N`: the source lines that cost the most SASS instructions (nvdisasm -g marks each
    # run of instructions with its line; an inlined helper's instructions carry the helper's line)
    _by_line = _script("kernel_report")._by_line
    sass = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
	//## File "/src/flashloop_compile/lowering/kernels/packed_write.py", line 60
        /*0010*/                   S2UR UR17, SR_CTAID.X ;
	//## File "/src/flashloop_compile/lowering/kernels/packed_codec.py", line 110
        /*0020*/                   FFMA R4, R2, R5, R4 ;
        /*0030*/              @!P1 IMAD.MOV R60, RZ, RZ, R35 ;
	//## File "/src/flashloop_compile/lowering/kernels/packed_write.py", line 60
        /*0040*/                   S2R R0, SR_TID.X ;
	//## File "/src/flashloop_compile/lowering/kernels/packed_codec.py", line 110
        /*0050*/                   FFMA.FTZ R4, R2, R5, R4 ;
    """
    assert [(w, n, dict(mix)) for w, n, mix in _by_line(sass)] == [
        ("packed_codec.py:110", 3, {"FFMA": 2, "IMAD": 1}),
        ("packed_write.py:60", 2, {"S2UR": 1, "S2R": 1}),
    ]


def test_ncu_summary_reads_one_row_per_launch_with_units_and_stalls():
    # scripts/ncu_summary.py on ncu's text layout: the kernel line opens a
    # row; "Memory Throughput" appears twice (% of peak, then a rate whose unit varies); the
    # stall metrics come from the command-line section.
    parse = _script("ncu_summary").parse
    text = """
  _correction_kernel (64, 26, 1)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: Command line profiler metrics
    smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio                    inst         1.93
    smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio            inst        14.91
    Section: GPU Speed Of Light Throughput
    Memory Throughput                 %        38.80
    Duration                         ms         1.25
    Compute (SM) Throughput           %        19.20
    Section: Memory Workload Analysis
    Memory Throughput                          Tbyte/s         1.87
    Section: Scheduler Statistics
    Issued Warp Per Scheduler                        0.23
    No Eligible                            %        76.70
  _read_bulk_kernel (4, 16, 103)x(128, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                         us       137.90
    Memory Throughput                          Gbyte/s       980.50
"""
    first, second = parse(text)
    assert (first["kernel"], first["grid"]) == ("_correction_kernel", "64x26x1")
    assert first["us"] == 1250.0 and first["mem%"] == 38.8 and first["GB/s"] == 1870.0
    assert first["ipc/smsp"] == 0.23 and first["noelig%"] == 76.7
    assert first["stalls"] == {"barrier": 1.93, "long_scoreboard": 14.91}
    assert (second["kernel"], second["us"], second["GB/s"]) == ("_read_bulk_kernel", 137.9, 980.5)


@pytest.mark.skipif(not (BIN / "ptxas").exists(), reason="the Triton wheel ships no ptxas here")
def test_residual_writes_compile_without_the_search_or_fp32_layout_conversions():
    # a decode step's write (launch_packed_kv_write's ONE_TOKEN): the flush kernel for
    # sm_90 without the binary search over the call's positions -- fewer instructions and 64-bit
    # loads than the prompt's write, no spills
    rows = _report_by_name("--only", "write", "--lines", "3")
    many, one = rows["write 8K depth 1 [_write_flush_kernel]"], rows["write one token depth 1 [_write_flush_kernel]"]
    # --lines: each kernel's three costliest source lines, by file name and line (the cubins carry line info)
    for r in (many, one):
        assert len(r["lines"]) == 3 and all(e["line"].split(":")[0].endswith(".py") and e["instructions"] > 0
                                            for e in r["lines"]), r["lines"]
    assert one["spill_ops"] == 0 and many["spill_ops"] == 0, (one, many)
    # the predecessor's codes load in the layout of K's and V's FP32 halves: no FP32 tile moves
    # through shared memory (eight did, and the 32K prompt's depth-1 write took 1.08 ms, not 0.58)
    assert one["f32_converts"] == 0 and many["f32_converts"] == 0, (one["f32_converts"], many["f32_converts"])
    assert one["instructions"] < many["instructions"], (one["instructions"], many["instructions"])
    assert one["loads"].get("LDG.E.64", 0) < many["loads"].get("LDG.E.64", 0), (one["loads"], many["loads"])
