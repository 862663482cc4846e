"""Calibration: the output is a valid FlashLoopConfig; thresholds move it the right way."""

from __future__ import annotations

import json

import pytest
import torch

from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.quality.calibrate import KEY_FRACTION_GRID, RETENTION_GRID, calibrate, retention_errors


def _seqs(n=2, t=128):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 256, (t,), generator=g) for _ in range(n)]


def test_calibrated_config_is_valid(tiny_model):
    res = calibrate(tiny_model, _seqs(), 0.05)
    cfg = res.config.resolve(4)
    r = cfg.token_sparse_prefill.retention
    assert r[:2] == (1.0, 1.0) and list(r) == sorted(r, reverse=True) and len(r) == 4
    assert cfg.sparse_decode_attention.key_fraction[0] in KEY_FRACTION_GRID
    assert cfg.kv_residual_quantization.enabled  # base: every feature on
    assert all(e <= 0.05 for e in res.retention_errors.values())
    payload = res.to_json()
    assert FlashLoopConfig.from_dict(json.loads(json.dumps(payload))["config"]) == cfg
    assert set(res.end_to_end) == {"final_state_error", "logits_kl_nats", "top1_agreement"}
    md = res.to_markdown()
    assert "### Calibration" in md and "key fraction" in md


def test_threshold_moves_the_schedule(tiny_model):
    seqs = _seqs()
    loose = calibrate(tiny_model, seqs, 0.99, end_to_end=False)
    tight = calibrate(tiny_model, seqs, 0.001, end_to_end=False)
    assert loose.retention[2:] == [RETENTION_GRID[0]] * 2 and loose.key_fraction == [KEY_FRACTION_GRID[0]]
    assert tight.retention == [1.0] * 4 and tight.key_fraction == [1.0]
    per_loop = calibrate(tiny_model, seqs, 0.3, per_loop_key_fraction=True, end_to_end=False)
    assert len(per_loop.key_fraction) == 2
    per_loop.config.resolve(4)


def test_inheritance_error_is_zero_at_full_retention_and_shrinks_with_retention(tiny_model):
    seqs = _seqs()
    assert retention_errors(tiny_model, seqs, [1.0, 1.0]) == [0.0, 0.0]
    errs = [retention_errors(tiny_model, seqs, [rho, rho]) for rho in (0.1, 0.5, 0.9)]
    assert errs[0][1] > errs[1][1] > errs[2][1] > 0


def test_strict_mode_checks_end_to_end(tiny_model):
    res = calibrate(tiny_model, _seqs(1, 96), 0.5, strict=True)
    assert res.end_to_end["final_state_error"] <= 0.5 or res.retention == [1.0] * 4
    with pytest.raises(ValueError):
        calibrate(tiny_model, _seqs(1, 32), 1.5)
