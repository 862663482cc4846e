"""What each kernel launch writes, as Inductor sees it.

Inside a ``triton_op`` body, ``torch.library.wrap_triton`` compiles each launched kernel to TTIR and
reads its stores to decide which tensor arguments the launch mutates; functionalization then clones
every mutated argument it cannot write in place. A launch that passes one tensor under several
parameter names (prefill's packed attention passes ``out`` as the unused split partials) must store
through at most one of them: otherwise the buffer gets cloned, and with a dynamic prompt length
Inductor's decomposition of the launch fails (``replace_by_example`` asserts). Stores the kernel
can never reach still count: TTIR keeps code after a ``return`` in a constexpr branch.

The analysis is torch's own, run on CPU against the sm_90 target (no GPU needed) in a child process
with the interpreter off (it needs compiled ``JITFunction``s): the launchers run with CPU tensors
and the GPU's launch choices, each launch is recorded instead of run."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


class _Recorder:
    def __init__(self, kernel, calls):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kw = dict(zip(self.kernel.arg_names, args))
            kw.update(kwargs)
            self.calls.append((self.kernel, kw))

        return launch


def _recording():
    """Launches recorded, not run; the launchers take the GPU's choices; TTIR for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget

    from flashloop_compile.lowering.kernels import common

    calls = []
    common.cpu_semantics = lambda device: False
    triton.runtime.driver.set_active(types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", 90, 32)))
    return (lambda kernel: common._Complete(kernel, _Recorder(kernel, calls))), calls


def _written(kernel, kwargs) -> set[str]:
    """The parameter names torch's wrap_triton analysis says the launch stores to."""
    from torch._higher_order_ops import triton_kernel_wrap as tkw

    if hasattr(tkw, "identify_accessed_tensors"):  # torch >= 2.12
        acc = tkw.identify_accessed_tensors(kernel, kwargs, {})
        return {dep.name for dep in acc.read_writes.writes}
    return set(tkw.identify_mutated_tensors(kernel, kwargs, {}))


_FLUSH = {"k_base", "k_base_min", "k_base_scale", "v_base", "v_base_min", "v_base_scale", "k_res", "k_res_min",
          "k_res_scale", "v_res", "v_res_min", "v_res_scale", "rows", "overflow", "counts", "scratch"}
# what each launch may store to: its outputs and the cache tensors it owns, never its inputs
WRITES = {
    "_write_flush_kernel": _FLUSH,
    "_write_tail_kernel": {"k_tail", "v_tail", "flushed", "row_count", "depth_count"},
    "_attn_kernel": {"out", "part_ml", "part_acc"},
    "_decode_bulk_kernel": {"part_ml", "part_acc"},
    "_combine_kernel": {"out"},
    "_read_bulk_kernel": {"out_k", "out_v"},
    "_read_kernel": {"out_k", "out_v"},
    "_position_attention_kernel": {"o_ptr"},
    "_scores_kernel": {"s_ptr", "pm_ptr", "pl_ptr"},
    "_select_first_kernel": {"p_ptr", "hist_ptr"},
    "_select_level_kernel": {"hcur_ptr", "pre_cur_ptr", "rnk_cur_ptr", "above_ptr"},
    "_select_compact_kernel": {"keys_ptr", "thr_ptr", "cut_ptr", "psel_ptr"},
    "_pv_kernel": {"po_ptr", "pmass_ptr"},
    "_pv_combine_kernel": {"out_ptr", "oref_ptr", "cref_ptr", "mass_ptr"},
    "_reuse_correction_kernel": {"out_ptr", "pacc_ptr"},
    "_reuse_combine_kernel": {"out_ptr"},
    "_read_values_kernel": {"part_acc"},
    "_running_extrema_kernel": {"premax", "sufmin"},
}


def _check(calls):
    assert calls
    for kernel, kwargs in calls:
        name = kernel.fn.__name__
        written = _written(kernel, kwargs)
        assert written, f"{name}: the analysis found no store (it fails open: every input mutated)"
        assert written <= WRITES[name], f"{name} stores to its inputs {sorted(written - WRITES[name])}"
        tensors = [n for n, v in kwargs.items() if isinstance(v, torch.Tensor)]
        for name in written:
            aliases = {n for n in tensors if kwargs[n] is kwargs[name]}
            assert len(aliases & written) == 1, (
                f"{name} stores through {sorted(aliases & written)}, one tensor passed under several names")


B, H, Hq, S, D, T = 2, 2, 4, 128, 64, 8  # T: 4 binary-search steps in the write (the analysis is exponential in them)


def _cache():
    from flashloop_compile.runtime import PackedKVCache

    return PackedKVCache(1, 4, B, S, H, D, group_size=64, tail=64).op_tensors(0)


def _tokens(heads, t):
    return torch.randn(B, heads, t, D, dtype=torch.bfloat16)


def prefill_launches():
    from flashloop_compile.lowering.kernels import packed_attention, packed_write, prefill_attention

    wrap, calls = _recording()
    cache = _cache()
    k, v, q = _tokens(H, T), _tokens(H, T), _tokens(Hq, T)
    pos = torch.arange(T)[None].expand(B, T).contiguous()
    packed_write.launch_packed_kv_write(cache, k, v, pos, 1, wrap=wrap)
    packed_attention.launch_packed_attention(cache, q, k, v, pos, pos, 1, 0.125, torch.empty_like(q), wrap=wrap,
                                             mode="prefill")
    prefill_attention.position_attention_triton(q, k, v, pos, 0.125, wrap=wrap)
    _check(calls)


def decode_launches():
    from flashloop_compile.lowering.kernels import packed_attention, packed_read, packed_write

    wrap, calls = _recording()
    cache = _cache()
    k, v, q = _tokens(H, 1), _tokens(H, 1), _tokens(H, 1)
    pos = torch.full((B, 1), T)
    packed_write.launch_packed_kv_write(cache, k, v, pos, 0, wrap=wrap)
    packed_attention.launch_packed_attention(cache, q, k, v, pos, pos, 0, 0.125, torch.empty_like(q), wrap=wrap)
    grid = torch.arange(T)[None].expand(B, T).contiguous()
    out_k, out_v = torch.empty(B, H, T, D, dtype=torch.bfloat16), torch.empty(B, H, T, D, dtype=torch.bfloat16)
    packed_read.launch_packed_read(cache, grid, 1, out_k, out_v, inflight=(pos, k, v), wrap=wrap)
    _check(calls)


def reuse_launches():
    """reuse_selected_probabilities' launches: the reference with and without the kept probabilities
    (without, the compaction gets the scratch row under psel_ptr too and must not store through it),
    the V-only corrections (one split: the partials' name aliases o_ref), the packed V-only read."""
    from flashloop_compile.lowering.kernels import correction, packed_read, reference_attention, sparse_config

    wrap, calls = _recording()
    sparse_config.no_wrap = wrap  # Launcher(wrap=False) launches through it
    sparse_config.check_runnable = lambda kernel, device: None  # recorded, not run
    q, k, v = _tokens(Hq, 1), _tokens(H, S), _tokens(H, S)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    for keep in (False, True):
        reference_attention.reference_attention_triton(q, k, v, mask, 0.125, [0.1], [13], keep_probs=keep)
    keys = torch.arange(13, dtype=torch.int32).expand(B, Hq, 1, 13).contiguous()
    count = torch.full((B, Hq, 1), 13, dtype=torch.int32)
    probs = torch.rand(B, Hq, 1, 13)
    o_ref, c_ref = torch.randn(B, Hq, 1, D), torch.randn(B, Hq, 1, D)
    for split in (1, 3):
        cfg = sparse_config.KernelConfig(split_corr=split, block_k=4)
        correction.reuse_correction_triton(v, keys, count, probs, o_ref, c_ref, config=cfg)
    cache = _cache()
    pos = torch.full((B, 1), T)
    packed_read.launch_packed_read_values(cache, keys[:, :H], count[:, :H], probs[:, :H], 2, inflight=(pos, _tokens(H, 1)),
                                          wrap=wrap)
    _check(calls)


def _in_child(which: str) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    run = subprocess.run([sys.executable, __file__, which], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_prefill_launches_store_through_one_name_per_tensor():
    _in_child("prefill_launches")


def test_decode_launches_store_through_one_name_per_tensor():
    _in_child("decode_launches")


def test_reuse_launches_store_through_one_name_per_tensor():
    _in_child("reuse_launches")


if __name__ == "__main__":
    globals()[sys.argv[1]]()
