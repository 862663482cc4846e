"""FlashLoopConfig: defaults, construction, round trips, hashing, printing and validation."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashloop_compile.config import (
    ConfigError,
    FlashLoopConfig,
    KVResidualQuantization,
    SparseDecodeAttention,
    TokenSparsePrefill,
    ceil_fraction,
)

GROUPS = ("token_sparse_prefill", "sparse_decode_attention", "kv_residual_quantization")
SWITCHES = list(itertools.product([False, True], repeat=3))


# --------------------------------------------------------------------------------------------
# Defaults and constructors
# --------------------------------------------------------------------------------------------


def test_defaults_all_off():
    cfg = FlashLoopConfig()
    assert cfg.switches == (False, False, False)
    assert not cfg.any_enabled
    assert not cfg.token_sparse_prefill.enabled
    assert not cfg.sparse_decode_attention.enabled
    assert not cfg.kv_residual_quantization.enabled
    # Disabled groups never select, whatever their ratios.
    assert not cfg.token_sparse_prefill.selects
    assert not cfg.sparse_decode_attention.selects
    # Default parameters as documented.
    assert cfg.token_sparse_prefill.window is None
    assert cfg.token_sparse_prefill.retention == (1.0, 1.0, 0.25, 0.10)
    assert cfg.token_sparse_prefill.keep_last_token is False
    assert cfg.sparse_decode_attention.reference_loop == 2
    assert cfg.sparse_decode_attention.key_fraction == (0.10,)
    q = cfg.kv_residual_quantization
    assert (q.bits, q.group_size, q.param_dtype, q.tail) == (4, 64, "float16", 64)
    # The empty dict and None mean the same thing.
    assert FlashLoopConfig.from_dict({}) == cfg
    assert FlashLoopConfig.from_dict(None) == cfg


def test_all_on():
    cfg = FlashLoopConfig.all_on()
    assert cfg.switches == (True, True, True)
    assert cfg.any_enabled
    assert cfg.token_sparse_prefill.selects and cfg.sparse_decode_attention.selects
    # Default parameters otherwise.
    assert cfg.token_sparse_prefill.retention == FlashLoopConfig().token_sparse_prefill.retention
    assert cfg.kv_residual_quantization.group_size == 64


def test_all_on_overrides():
    cfg = FlashLoopConfig.all_on(**{"token_sparse_prefill.window": 128, "kv_residual_quantization.enabled": False})
    assert cfg.switches == (True, True, False)
    assert cfg.token_sparse_prefill.window == 128


@pytest.mark.parametrize("switches", SWITCHES)
def test_from_switches(switches):
    cfg = FlashLoopConfig.from_switches(*switches)
    assert cfg.switches == switches
    assert cfg.any_enabled == any(switches)
    for g, on in zip(GROUPS, switches):
        assert getattr(cfg, g).enabled is on


def test_from_switches_overrides():
    cfg = FlashLoopConfig.from_switches(True, False, False, **{"token_sparse_prefill.retention": [1, 1, 0.5]})
    assert cfg.token_sparse_prefill.retention == (1.0, 1.0, 0.5)
    assert cfg.switches == (True, False, False)


def test_full_retention_skips_selection():
    cfg = FlashLoopConfig.all_on(
        **{"token_sparse_prefill.retention": [1, 1, 1, 1], "sparse_decode_attention.key_fraction": [1.0]}
    )
    assert cfg.any_enabled
    assert not cfg.token_sparse_prefill.selects
    assert not cfg.sparse_decode_attention.selects


# --------------------------------------------------------------------------------------------
# Round trips and hashing
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("switches", SWITCHES)
def test_dict_round_trip(switches):
    cfg = FlashLoopConfig.from_switches(*switches)
    flat = cfg.to_dict()
    # Flat "group.param" keys covering every parameter of every group, lists for tuples.
    assert all(k.partition(".")[0] in GROUPS + ("compilation",) for k in flat)
    assert flat["compilation.outline_layers"] is False
    assert flat["token_sparse_prefill.retention"] == [1.0, 1.0, 0.25, 0.10]
    assert isinstance(flat["sparse_decode_attention.key_fraction"], list)
    for g, on in zip(GROUPS, switches):
        assert flat[f"{g}.enabled"] is on
    back = FlashLoopConfig.from_dict(flat)
    assert back == cfg
    assert back.hash() == cfg.hash()
    # Through JSON too (the CLI's --options form).
    again = FlashLoopConfig.from_dict(json.loads(json.dumps(flat)))
    assert again == cfg and again.hash() == cfg.hash()


def test_dict_round_trip_non_default_params():
    cfg = FlashLoopConfig.from_dict(
        {
            "token_sparse_prefill.enabled": True,
            "token_sparse_prefill.window": 256,
            "token_sparse_prefill.retention": [1, 1, 0.5, 0.2],
            "token_sparse_prefill.keep_last_token": True,
            "sparse_decode_attention.enabled": True,
            "sparse_decode_attention.key_fraction": [0.2, 0.05],
            "kv_residual_quantization.enabled": True,
            "kv_residual_quantization.group_size": 32,
        }
    )
    back = FlashLoopConfig.from_dict(cfg.to_dict())
    assert back == cfg
    assert back.hash() == cfg.hash()
    assert back.token_sparse_prefill.window == 256
    assert back.sparse_decode_attention.key_fraction == (0.2, 0.05)
    assert back.kv_residual_quantization.tail == 32


def test_hash_is_deterministic_and_short_hex():
    a, b = FlashLoopConfig.all_on(), FlashLoopConfig.all_on()
    assert a is not b
    assert a.hash() == b.hash() == a.hash()
    h = a.hash()
    assert len(h) == 16 and all(c in "0123456789abcdef" for c in h)


def test_hash_same_for_equivalent_spellings():
    # Ints vs floats, tuples vs lists vs the comma-separated string form are the same config.
    spellings = [
        [1, 1, 0.25, 0.1],
        (1.0, 1.0, 0.25, 0.10),
        "1, 1, 0.25, 0.10",
    ]
    hashes = {
        FlashLoopConfig.from_dict({"token_sparse_prefill.enabled": True, "token_sparse_prefill.retention": r}).hash()
        for r in spellings
    }
    assert len(hashes) == 1
    assert FlashLoopConfig.from_dict({"sparse_decode_attention.key_fraction": 0.1}).hash() == FlashLoopConfig().hash()


def test_hash_differs_for_different_configs():
    configs = [FlashLoopConfig.from_switches(*s) for s in SWITCHES]
    on = {f"{g}.enabled": True for g in GROUPS}
    variants = {
        "token_sparse_prefill.window": 64,
        "token_sparse_prefill.retention": [1, 1, 0.25, 0.2],
        "token_sparse_prefill.keep_last_token": True,
        "sparse_decode_attention.key_fraction": [0.2],
        "sparse_decode_attention.reuse_selected_probabilities": True,
        "kv_residual_quantization.group_size": 32,
    }
    for key, value in variants.items():
        configs.append(FlashLoopConfig.from_dict({**on, key: value}))
    hashes = [c.hash() for c in configs]
    assert len(set(hashes)) == len(configs), hashes
    assert len(set(configs)) == len(configs)


def test_hash_stable_across_processes():
    # The hash keys compile caches and benchmark records: it must not depend on the process
    # (e.g. Python's randomized str hashing). config.py needs only the standard library, so the
    # child loads it by path (no torch import: fast).
    import flashloop_compile.config as config_module

    code = (
        "import importlib.util, sys;"
        "spec = importlib.util.spec_from_file_location('flc_config', sys.argv[1]);"
        "m = importlib.util.module_from_spec(spec); sys.modules['flc_config'] = m; spec.loader.exec_module(m);"
        "C = m.FlashLoopConfig;"
        "print(C().hash(), C.all_on(**{'token_sparse_prefill.window': 64}).hash())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code, config_module.__file__], env=env, capture_output=True, text=True, check=True
    )
    expected = f"{FlashLoopConfig().hash()} {FlashLoopConfig.all_on(**{'token_sparse_prefill.window': 64}).hash()}"
    assert out.stdout.strip() == expected


def test_str_readable():
    off = str(FlashLoopConfig())
    for g in GROUPS:
        assert f"{g}=off" in off
    assert FlashLoopConfig().hash() in off

    cfg = FlashLoopConfig.from_switches(True, False, True, **{"token_sparse_prefill.window": 128})
    s = str(cfg)
    assert cfg.hash() in s
    assert "token_sparse_prefill=on(" in s
    assert "sparse_decode_attention=off" in s
    assert "kv_residual_quantization=on(" in s
    assert "window=128" in s
    assert "retention=[1.0, 1.0, 0.25, 0.1]" in s
    assert "group_size=64" in s
    # Disabled groups don't print parameters, so key_fraction is absent here.
    assert "key_fraction" not in s
    full = str(FlashLoopConfig.all_on())
    assert "key_fraction=[0.1]" in full
    assert "reference_loop=2" in full


# --------------------------------------------------------------------------------------------
# Validation: every error is a ConfigError naming the offending key
# --------------------------------------------------------------------------------------------

INVALID = [
    ({"bogus": 1}, "bogus"),
    ({"token_sparse_prefill": True}, "token_sparse_prefill"),
    ({"made_up_group.enabled": True}, "made_up_group.enabled"),
    ({"token_sparse_prefill.windw": 64}, "token_sparse_prefill.windw"),
    ({"kv_residual_quantization.group": 64}, "kv_residual_quantization.group"),
    ({"token_sparse_prefill.retention": [1, 0.5, 0.25]}, "token_sparse_prefill.retention"),
    ({"token_sparse_prefill.retention": [0.5, 1, 0.25]}, "token_sparse_prefill.retention"),
    ({"token_sparse_prefill.retention": [1]}, "token_sparse_prefill.retention"),
    ({"token_sparse_prefill.retention": [1, 1, 0.1, 0.25]}, "token_sparse_prefill.retention"),
    ({"token_sparse_prefill.retention": [1, 1, 0.0, 0.0]}, "token_sparse_prefill.retention"),
    ({"token_sparse_prefill.retention": [1, 1, 1.5]}, "token_sparse_prefill.retention"),
    ({"token_sparse_prefill.retention": [1, 1, -0.25]}, "token_sparse_prefill.retention"),
    ({"token_sparse_prefill.retention": [1, 1, float("nan")]}, "token_sparse_prefill.retention"),
    ({"token_sparse_prefill.retention": ["a", "b"]}, "token_sparse_prefill.retention"),
    ({"sparse_decode_attention.key_fraction": [0.0]}, "sparse_decode_attention.key_fraction"),
    ({"sparse_decode_attention.key_fraction": [1.01]}, "sparse_decode_attention.key_fraction"),
    ({"sparse_decode_attention.key_fraction": []}, "sparse_decode_attention.key_fraction"),
    ({"token_sparse_prefill.window": 0}, "token_sparse_prefill.window"),
    ({"token_sparse_prefill.window": -8}, "token_sparse_prefill.window"),
    ({"token_sparse_prefill.window": 2.5}, "token_sparse_prefill.window"),
    ({"token_sparse_prefill.window": True}, "token_sparse_prefill.window"),
    ({"kv_residual_quantization.bits": 8}, "kv_residual_quantization.bits"),
    ({"kv_residual_quantization.bits": 2}, "kv_residual_quantization.bits"),
    ({"kv_residual_quantization.group_size": 48}, "kv_residual_quantization.group_size"),
    ({"kv_residual_quantization.group_size": 0}, "kv_residual_quantization.group_size"),
    ({"kv_residual_quantization.param_dtype": "bfloat16"}, "kv_residual_quantization.param_dtype"),
    ({"kv_residual_quantization.tail": 96}, "kv_residual_quantization.tail"),
    ({"kv_residual_quantization.tail": 32}, "kv_residual_quantization.tail"),
    ({"kv_residual_quantization.tail": 0}, "kv_residual_quantization.tail"),
    ({"kv_residual_quantization.tail": 128}, "kv_residual_quantization.tail"),
    ({"kv_residual_quantization.tail": 64.0}, "kv_residual_quantization.tail"),
    ({"kv_residual_quantization.tail": True}, "kv_residual_quantization.tail"),
    ({"kv_residual_quantization.group_size": 32, "kv_residual_quantization.tail": 48}, "kv_residual_quantization.tail"),
    ({"kv_residual_quantization.group_size": 16, "kv_residual_quantization.tail": 64}, "kv_residual_quantization.tail"),
    ({"sparse_decode_attention.reference_loop": 3}, "sparse_decode_attention.reference_loop"),
    ({"sparse_decode_attention.reference_loop": 1}, "sparse_decode_attention.reference_loop"),
]


@pytest.mark.parametrize("options,key", INVALID, ids=[f"{i}-{k}" for i, (_, k) in enumerate(INVALID)])
def test_invalid_options_name_the_key(options, key):
    with pytest.raises(ConfigError) as info:
        FlashLoopConfig.from_dict(options)
    assert key in str(info.value)
    # Validation does not depend on the group being enabled: the same holds with it on.
    group = key.partition(".")[0]
    if group in GROUPS:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            FlashLoopConfig.from_dict({**options, f"{group}.enabled": True})


def test_reuse_selected_probabilities_needs_sparse_decode():
    on = FlashLoopConfig.from_dict(
        {"sparse_decode_attention.enabled": True, "sparse_decode_attention.reuse_selected_probabilities": True}
    )
    assert on.sparse_decode_attention.reuse_selected_probabilities
    assert not FlashLoopConfig.all_on().sparse_decode_attention.reuse_selected_probabilities  # off by default
    assert "reuse_selected_probabilities=True" in str(on)
    with pytest.raises(ConfigError) as info:
        FlashLoopConfig.from_dict({"sparse_decode_attention.reuse_selected_probabilities": True})
    msg = str(info.value)
    assert "sparse_decode_attention.reuse_selected_probabilities" in msg and "sparse decode is off" in msg
    assert "set sparse_decode_attention.enabled=true" in msg
    with pytest.raises(ConfigError, match="must be true or false"):
        FlashLoopConfig.from_dict(
            {"sparse_decode_attention.enabled": True, "sparse_decode_attention.reuse_selected_probabilities": "yes"}
        )


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_group_dataclasses_validate_directly():
    with pytest.raises(ConfigError, match="window"):
        TokenSparsePrefill(window=0)
    with pytest.raises(ConfigError, match="reference_loop"):
        SparseDecodeAttention(reference_loop=4)
    with pytest.raises(ConfigError, match="bits"):
        KVResidualQuantization(bits=3)


def test_valid_edge_values_accepted():
    # Boundaries that must stay legal.
    FlashLoopConfig.from_dict(
        {
            "token_sparse_prefill.window": 1,
            "token_sparse_prefill.retention": [1, 1, 1, 1e-6],
            "sparse_decode_attention.key_fraction": [1.0],
            "kv_residual_quantization.group_size": 128,
            "kv_residual_quantization.tail": 128,
        }
    )
    FlashLoopConfig.from_dict({"token_sparse_prefill.retention": [1, 1]})
    for g in (16, 32, 64, 128):
        FlashLoopConfig.from_dict({"kv_residual_quantization.group_size": g, "kv_residual_quantization.tail": g})


@pytest.mark.parametrize("g", [16, 32, 64, 128])
def test_tail_follows_group_size(g):
    # the packed cache's ring flushes whole groups and keeps g..2g-1 tokens: tail is the group size
    q = FlashLoopConfig.from_dict({"kv_residual_quantization.group_size": g}).kv_residual_quantization
    assert q.tail == g
    assert KVResidualQuantization(group_size=g) == KVResidualQuantization(group_size=g, tail=g)
    assert FlashLoopConfig.from_dict(FlashLoopConfig.from_dict({"kv_residual_quantization.group_size": g}).to_dict()).kv_residual_quantization.tail == g
    with pytest.raises(ConfigError, match=rf"tail must equal group_size={g}.*set tail={g} or leave it out"):
        KVResidualQuantization(group_size=g, tail=2 * g)


def test_default_hash_keeps_the_resolved_tail():
    # the default tail (None) resolves to the group size before hashing: the flat dict holds 64
    assert FlashLoopConfig().to_dict()["kv_residual_quantization.tail"] == 64
    assert FlashLoopConfig.from_dict({"kv_residual_quantization.tail": 64}).hash() == FlashLoopConfig().hash()


def test_resolve_checks_the_model_head_dim_against_the_group_size():
    on = FlashLoopConfig.from_switches(False, False, True)
    with pytest.raises(ConfigError, match=r"group_size=64 must divide the model's head_dim=48.*set kv_residual_quantization.group_size=16"):
        on.resolve(4, head_dim=48)
    with pytest.raises(ConfigError, match=r"group_size=32 must divide the model's head_dim=8.*no group size fits"):
        FlashLoopConfig.from_switches(False, False, True, **{"kv_residual_quantization.group_size": 32}).resolve(4, head_dim=8)
    for head_dim in (64, 128, 192):
        assert on.resolve(4, head_dim=head_dim) is on
    assert FlashLoopConfig().resolve(4, head_dim=48) is not None  # quantization off: any head_dim
    with pytest.raises(ConfigError, match="looped model.*turn kv_residual_quantization off"):
        on.resolve(1)


# --------------------------------------------------------------------------------------------
# resolve(num_loops)
# --------------------------------------------------------------------------------------------


def test_resolve_ok_returns_self():
    cfg = FlashLoopConfig.all_on()
    assert cfg.resolve(4) is cfg
    assert FlashLoopConfig().resolve(1) is not None  # all off: anything goes


def test_resolve_retention_length_mismatch():
    cfg = FlashLoopConfig.from_switches(True, False, False)
    for n in (3, 5):
        with pytest.raises(ConfigError, match=r"token_sparse_prefill\.retention") as info:
            cfg.resolve(n)
        assert str(n) in str(info.value)
    # Disabled: its retention is not checked.
    FlashLoopConfig.from_switches(False, True, True).resolve(5)


def test_resolve_too_few_loops_for_sparse_decode():
    cfg = FlashLoopConfig.from_switches(False, True, False)
    for n in (1, 2):
        with pytest.raises(ConfigError, match="sparse_decode_attention"):
            cfg.resolve(n)
    assert cfg.resolve(3) is cfg
    FlashLoopConfig.from_switches(False, False, True).resolve(2)


def test_resolve_key_fraction_length():
    def make(kf):
        return FlashLoopConfig.from_switches(False, True, False, **{"sparse_decode_attention.key_fraction": kf})

    make([0.1]).resolve(4)
    make([0.2, 0.1]).resolve(4)  # one per sparse loop 3..4
    for bad in ([0.3, 0.2, 0.1], [0.2, 0.1]):
        with pytest.raises(ConfigError, match=r"sparse_decode_attention\.key_fraction"):
            make(bad).resolve(3 if len(bad) == 2 else 4)
    cfg = make([0.3, 0.2, 0.1]).resolve(5)
    sda = cfg.sparse_decode_attention
    assert [sda.fraction_at(loop) for loop in (3, 4, 5)] == [0.3, 0.2, 0.1]
    assert make([0.25]).sparse_decode_attention.fraction_at(4) == 0.25


# --------------------------------------------------------------------------------------------
# ceil_fraction and budgets
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ratio,n,expected",
    [
        (0.1, 30, 3),
        (0.1, 31, 4),
        # Products that float arithmetic puts just above an integer: the decimal ratio wins.
        (0.07, 100, 7),  # 0.07 * 100 == 7.000000000000001
        (0.14, 50, 7),  # 7.000000000000001
        (0.28, 25, 7),  # 7.000000000000001
        (0.55, 100, 55),  # 55.00000000000001
        (0.56, 25, 14),  # 14.000000000000002
        (0.1, 10, 1),
        (0.1, 1, 1),
        (0.1, 5, 1),  # at least 1
        (0.001, 7, 1),
        (0.25, 8, 2),
        (0.25, 9, 3),
        (0.5, 7, 4),
        (0.7, 10, 7),
        (0.35, 20, 7),
        (1.0, 1, 1),
        (1.0, 13, 13),
        (1.0, 4096, 4096),
        (0.5, 0, 0),
    ],
)
def test_ceil_fraction(ratio, n, expected):
    assert ceil_fraction(ratio, n) == expected


@settings(max_examples=100, deadline=None, derandomize=True)
@given(k=st.integers(1, 1000), n=st.integers(1, 200_000))
def test_ceil_fraction_matches_decimal(k, n):
    # The ratio as the decimal the user wrote (k/1000), exact rational arithmetic.
    exact = max(1, math.ceil(Fraction(k, 1000) * n))
    assert ceil_fraction(k / 1000, n) == exact
    assert 1 <= ceil_fraction(k / 1000, n) <= n


def test_budgets():
    tsp = TokenSparsePrefill(enabled=True, retention=(1, 1, 0.5, 0.25))
    assert tsp.budgets(8) == (8, 8, 4, 2)
    assert tsp.budgets(3) == (3, 3, 2, 1)
    assert tsp.budgets(1) == (1, 1, 1, 1)
    assert TokenSparsePrefill().budgets(30) == (30, 30, 8, 3)
    assert TokenSparsePrefill().budgets(100) == (100, 100, 25, 10)


# --------------------------------------------------------------------------------------------
# coerce
# --------------------------------------------------------------------------------------------


def test_coerce():
    cfg = FlashLoopConfig.all_on()
    assert FlashLoopConfig.coerce(cfg) is cfg
    assert FlashLoopConfig.coerce(cfg.to_dict()) == cfg
    assert FlashLoopConfig.coerce(None) == FlashLoopConfig()
    assert FlashLoopConfig.coerce({}) == FlashLoopConfig()
    assert FlashLoopConfig.coerce({"kv_residual_quantization.enabled": True}).switches == (False, False, True)


@pytest.mark.parametrize("bad", ["token_sparse_prefill.enabled=1", ["token_sparse_prefill.enabled"], 1, True, 0.5])
def test_coerce_rejects_other_types(bad):
    with pytest.raises(ConfigError, match=type(bad).__name__):
        FlashLoopConfig.coerce(bad)


def test_coerce_unknown_key_still_errors():
    with pytest.raises(ConfigError, match="nope"):
        FlashLoopConfig.coerce({"nope": 1})


@pytest.mark.parametrize(
    "key, value",
    [
        ("token_sparse_prefill.enabled", "false"),
        ("sparse_decode_attention.enabled", 1),
        ("kv_residual_quantization.group_size", 64.0),
        ("kv_residual_quantization.bits", 4.0),
        ("sparse_decode_attention.reference_loop", 2.0),
        ("token_sparse_prefill.keep_last_token", "yes"),
    ],
)
def test_wrong_value_types_are_errors_naming_the_key(key, value):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        FlashLoopConfig.from_dict({key: value})
