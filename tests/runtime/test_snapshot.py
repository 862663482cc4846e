"""Snapshot and restore of one request's cache (runtime/snapshot.py, Engine.snapshot/restore): a
request snapshotted mid-generation and restored into another row of a fresh engine (or, through a
file, of an engine in another process) continues with the tokens of the uninterrupted run, for all
8 feature combinations; a restore that does not fit is an error that leaves the target unchanged."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashloop_compile.backend import make_backend
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.reference import ReferenceFlashLoop
from flashloop_compile.runtime.engine import Engine
from flashloop_compile.runtime.snapshot import FORMAT_VERSION, RowSnapshot, SnapshotMismatchError
from passes.conftest import SMALL, small, tiny

ROOT = Path(__file__).resolve().parents[2]
SWITCHES = list(itertools.product([False, True], repeat=3))
IDS = ["".join("TSQ"[i] if on else "-" for i, on in enumerate(s)) for s in SWITCHES]


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


# group 16 keeps the prompts short and still moves flushed state: the tail ring has 32 slots and
# holds 16..31 tokens. The moved request (row 1 of engine A, 58 prompt tokens) has flushed 32
# tokens when it is snapshotted at 61 and flushes again after the restore (at 64).
GROUP = 16
PROMPTS_A = [_prompt(30, 1), _prompt(58, 2)]
# engine B: row 0 holds a longer request that the restore replaces, row 1 a request that stays
PROMPTS_B = [_prompt(90, 3), _prompt(20, 4)]
BEFORE, AFTER = 3, 4  # decode steps before the snapshot, after the restore
MAX_SEQ = 128
# the moved row's logits against the uninterrupted run's: the bytes move exactly; the batch around
# the row differs (other rows, other row index), which may change float summation order
ATOL = RTOL = 1e-5


def _config(switches, **overrides) -> FlashLoopConfig:
    return FlashLoopConfig.from_switches(*switches, **{"token_sparse_prefill.window": 32,
                                                       "kv_residual_quantization.group_size": GROUP, **overrides})


def _engine(model, config, max_batch=2, max_seq=MAX_SEQ, **kw) -> Engine:
    torch._dynamo.reset()
    return Engine(model, config, max_batch=max_batch, max_seq=max_seq, backend=make_backend(config, inner="eager"), **kw)


def _greedy(engine: Engine, logits: torch.Tensor, pos: torch.Tensor, steps: int):
    """``steps`` greedy decode steps from the logits that choose the next tokens; the tokens
    [steps, B] and the logits [steps, B, V] of each step."""
    tokens, out = [], []
    for _ in range(steps):
        tok = logits.argmax(-1)
        logits = engine.decode(tok, pos).clone()
        pos = pos + 1
        tokens.append(tok)
        out.append(logits)
    return torch.stack(tokens), torch.stack(out)


def _run_until_snapshot(model, config, path=None):
    """Engine A: prefill PROMPTS_A, decode BEFORE steps, snapshot row 1, then run on AFTER steps
    (the uninterrupted run). The snapshot, and row 1's tokens and logits after it."""
    a = _engine(model, config)
    logits = a.prefill(PROMPTS_A)
    pos = torch.tensor([len(p) for p in PROMPTS_A])
    _, before = _greedy(a, logits, pos, BEFORE)
    logits, pos = before[-1], pos + BEFORE
    snap = a.snapshot(1, int(pos[1]), logits=logits[1], path=path)
    tokens, after = _greedy(a, logits, pos, AFTER)
    return snap, tokens[:, 1], after[:, 1]


@pytest.mark.parametrize("switches", SWITCHES, ids=IDS)
def test_a_request_restored_into_another_row_of_a_fresh_engine_continues_as_if_never_moved(switches):
    model = small()  # all 8 combinations: the small model compiles in a third of the time
    config = _config(switches, **SMALL)
    snap, want_tokens, want_logits = _run_until_snapshot(model, config)

    b = _engine(small(), config)  # an engine allocates its model's caches: another model of the same weights
    first = b.prefill(PROMPTS_B)
    restored = b.restore(snap, 0)  # replaces row 0's longer request
    assert restored.position == len(PROMPTS_A[1]) + BEFORE
    logits = torch.stack([restored.logits, first[1]])
    tokens, after = _greedy(b, logits, torch.tensor([restored.position, len(PROMPTS_B[1])]), AFTER)

    assert tokens[:, 0].tolist() == want_tokens.tolist()
    torch.testing.assert_close(after[:, 0], want_logits, atol=ATOL, rtol=RTOL)
    # the request that stayed in row 1 is untouched by the restore
    assert tokens[:, 1].tolist() == ReferenceFlashLoop(model, config).greedy(PROMPTS_B[1], AFTER).tolist()


_CHILD = """
import json, sys, torch
from flashloop_compile.backend import make_backend
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.runtime.engine import Engine
from passes.conftest import small

path, out, steps, config = sys.argv[1], sys.argv[2], int(sys.argv[3]), FlashLoopConfig.from_dict(json.loads(sys.argv[4]))
engine = Engine(small(), config, max_batch=2, max_seq=128, backend=make_backend(config, inner="eager"))
snap = engine.restore(path, 0)
tok, pos, tokens, logits = snap.logits.argmax()[None], torch.tensor([snap.position]), [], []
for _ in range(steps):
    step = engine.decode(tok, pos)
    tokens.append(int(tok))
    logits.append(step[0].clone())
    tok, pos = step.argmax(-1), pos + 1
torch.save(torch.stack(logits), out)
print(json.dumps(tokens))
"""


def test_a_request_restored_from_a_file_in_another_process_continues_as_if_never_moved(tmp_path):
    model = small()  # the child process builds the same weights
    config = _config((True, True, True), **SMALL)
    path, want_tokens, want_logits = _run_until_snapshot(model, config, path=tmp_path / "request.safetensors")
    assert path == tmp_path / "request.safetensors"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    out = tmp_path / "logits.pt"
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(out), str(AFTER), json.dumps(config.to_dict())],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == want_tokens.tolist()
    torch.testing.assert_close(torch.load(out), want_logits, atol=ATOL, rtol=RTOL)


# -- the row's bytes, without running the model ------------------------------------------------------------------

def _fill(engine: Engine, seed: int, position: int) -> None:
    """Random contents in every cache tensor as a stand-in for live requests; the counters stay
    in range: flushed <= position, row_count <= position / 4 (within every capacity here)."""
    g = torch.Generator().manual_seed(seed)
    for name, t in engine.state_tensors().items():
        if name.endswith((".flushed", ".row_count")):
            t.copy_(torch.randint(0, (position if name.endswith("flushed") else position // 4) + 1, t.shape, generator=g))
        elif t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=g))
        elif not name.endswith(("res_layout", "overflow")):
            t.copy_(torch.randint(-1 if t.dtype == torch.int32 else 0, 5, t.shape, generator=g).to(t.dtype))


def _state(engine: Engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.state_tensors().items()}


@pytest.mark.parametrize("quantize", [False, True], ids=["dense", "packed"])
def test_restore_writes_the_rows_bytes_and_nothing_else(quantize):
    model = tiny()
    config = _config((True, True, quantize))
    # an engine allocates its model's caches: two engines, two models
    source, target = _engine(model, config, max_batch=3), _engine(tiny(), config, max_batch=2)
    position = 100
    _fill(source, 0, position)
    _fill(target, 1, MAX_SEQ)
    snap = RowSnapshot.from_bytes(source.snapshot(2, position))
    before = _state(target)
    target.restore(snap, 1)
    after = _state(target)
    src = source.row_caches()
    rows = {n: v for n, v in target.row_caches().row_views(1, position, src.compact_rows(2))}
    for name, view in src.row_views(2, position, src.compact_rows(2)):
        assert torch.equal(rows[name], view), name
    for name in after:  # every other row is bit-unchanged
        batch_axis = 1 if name.endswith(("k_res_min", "k_res_scale", "packed.rows")) else 0
        assert torch.equal(after[name].select(batch_axis, 0), before[name].select(batch_axis, 0)), name
    if quantize:  # past the row's length its maps read as a fresh slot
        assert (target.packed.rows[:, 1, position:] == -1).all() and (target.packed.depth_count[1, position:] == 0).all()
    # only the row's part travels: its first `position` tokens (blocks, ring slots, compact rows used)
    R, H, D = model.config.num_loops, 2, 64
    if not quantize:
        assert snap.nbytes == 2 * R * model.config.num_hidden_layers * H * position * D * 4  # K and V of R x N sites, fp32
    else:
        t, used = snap.tensors, src.compact_rows(2)["layer0"]
        assert t["packed.layer0.k_base"].shape == (H, position, D // 2)
        assert t["packed.layer0.k_res_min"].shape == (R - 1, H, 7, D)  # blocks of GROUP tokens
        assert t["packed.layer0.k_tail"].shape == (R, H, 2 * GROUP, D)  # the whole ring (position >= 2 * GROUP)
        assert [t[f"packed.layer0.k_res.depth{d}"].shape[1] for d in (1, 2, 3)] == used
        assert t["packed.rows"].shape == (R - 1, position) and t["packed.depth_count"].shape == (position,)


def _snapshot_bytes(position=100) -> bytes:
    model = tiny()
    source = _engine(model, _config((True, True, True)))
    _fill(source, 0, position)
    return source.snapshot(1, position)


def _with_version(data: bytes, version: int) -> bytes:
    snap = RowSnapshot.from_bytes(data)
    return dataclasses.replace(snap, descriptor=dataclasses.replace(snap.descriptor, format_version=version)).to_bytes()


CASES = {
    "config": (lambda: (tiny(), _config((True, True, True), **{"token_sparse_prefill.window": 16}), {}), 1, None,
               r"snapshot taken under FlashLoopConfig hash \w+, this engine runs \w+: restore it into an engine built with "
               r"the same FlashLoopConfig"),
    "geometry": (lambda: (tiny(num_hidden_layers=1), _config((True, True, True)), {}), 1, None,
                 r"snapshot geometry differs: num_layers=2 \(here 1\); restore it into an engine of the same model"),
    "dtype": (lambda: (tiny().to(torch.bfloat16), _config((True, True, True)), {}), 1, None,
              r"snapshot dtype torch.float32 differs from this engine's torch.bfloat16"),
    "format": (lambda: (tiny(), _config((True, True, True)), {}), 1, FORMAT_VERSION + 1,
               rf"snapshot format version {FORMAT_VERSION + 1} is not readable here: this flashloop_compile reads version "
               rf"{FORMAT_VERSION}"),
    "row": (lambda: (tiny(), _config((True, True, True)), {}), 2, None,
            r"row 2 is out of range: this cache has rows 0..1 \(max_batch=2\)"),
    "negative_row": (lambda: (tiny(), _config((True, True, True)), {}), -1, None, r"row -1 is out of range"),
    "max_seq": (lambda: (tiny(), _config((True, True, True)), {"max_seq": 64}), 1, None,
                r"snapshot holds 100 tokens, this engine's max_seq is 64"),
    "capacity": (lambda: (tiny(), _config((True, True, True)), {"max_new_tokens": 4}), 1, None,
                 r"snapshot uses \d+ compact residual rows at depth 3, this engine's capacity is \d+"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_snapshot_that_does_not_fit_is_an_error_and_the_target_is_unchanged(case):
    build, row, version, message = CASES[case]
    data = _snapshot_bytes()
    if version is not None:
        data = _with_version(data, version)
    if case == "capacity":  # a request that used more compact rows than the target planned for
        snap = RowSnapshot.from_bytes(data)
        for name, t in list(snap.tensors.items()):
            if ".depth3" in name:
                snap.tensors[name] = t[:, :1].expand(t.shape[0], 100, *t.shape[2:]).contiguous()
        data = snap.to_bytes()
    model, config, kw = build()
    target = _engine(model, config, **kw)
    _fill(target, 1, 60)
    before = _state(target)
    with pytest.raises(SnapshotMismatchError, match=message):
        target.restore(data, row)
    after = _state(target)
    assert after.keys() == before.keys() and all(torch.equal(after[n], before[n]) for n in before)


def test_bytes_that_are_not_a_snapshot_or_of_a_later_layout_are_an_error():
    from safetensors.torch import save

    target = _engine(tiny(), FlashLoopConfig())
    with pytest.raises(SnapshotMismatchError, match="not a flashloop_compile cache snapshot"):
        target.restore(b"\x00" * 64, 0)
    later = save({"x": torch.zeros(1)}, metadata={"flashloop_snapshot": json.dumps({"descriptor": {"format_version": 2}})})
    with pytest.raises(SnapshotMismatchError, match="snapshot format version 2 is not readable here"):
        target.restore(later, 0)


def test_a_snapshot_of_what_a_row_does_not_hold_is_an_error():
    engine = _engine(tiny(), _config((True, True, True)))
    _fill(engine, 0, 40)
    with pytest.raises(ValueError, match=r"row 2 is out of range: this cache has rows 0..1"):
        engine.snapshot(2, 40)
    with pytest.raises(ValueError, match=r"position must be the row's token count in 1..max_seq=128, got 0"):
        engine.snapshot(0, 0)
    with pytest.raises(ValueError, match=r"logits must be the row's \[vocab_size=256\] logits, got shape \(2, 256\)"):
        engine.snapshot(0, 40, logits=torch.zeros(2, 256))
    engine.packed.layers[0].flushed[0, 0] = 48
    with pytest.raises(ValueError, match=r"position=40 is behind row 0's cache, which has 48 tokens flushed"):
        engine.snapshot(0, 40)
    engine.packed.layers[0].flushed[0, 0] = 32
    engine.packed.layers[1].row_count[0, 3] = 129
    with pytest.raises(ValueError, match=r"row 0 overflowed its compact residual rows \(layer1, depth 3: 129 needed, capacity 128\)"):
        engine.snapshot(0, 40)
