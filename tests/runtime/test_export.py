"""Compiled-model export (flashloop_compile.export / load_exported) on CPU, tiny preset.

A package is loaded in a fresh interpreter that never imports flashloop_compile.models; its
generations (ragged batch, greedy and seeded sampling) and prefill logits equal those of an engine
running the same rewritten graphs (the backend's passes, without Inductor) within LOGITS_TOL. Every
refusal says what to change.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import flashloop_compile
from flashloop_compile import ExportError, FlashLoopConfig, load_exported
from flashloop_compile.backend import make_backend
from flashloop_compile.runtime.engine import Engine, Sampling
from passes.conftest import SMALL, small

ROOT = Path(__file__).resolve().parents[2]
MAX_BATCH, MAX_SEQ, BUCKETS, NEW = 2, 64, (2,), 6
PROMPTS = [list(range(3, 31)), list(range(50, 63))]  # ragged: 28 and 13 tokens
SAMPLING = {"temperature": 1.0, "top_p": 0.9, "seed": 3}
# AOTInductor compiles the rewritten graphs the backend hands Inductor; the engine they are
# compared with runs those graphs eagerly (make_backend(inner="eager"): the Inductor engine equals
# the eager rewrite in tests/test_backend.py and tests/passes/test_outline.py, so its compile is
# not repeated here). AOTInductor's kernel choices: the logits agree to float32 rounding, the
# tokens exactly
LOGITS_TOL = dict(atol=1e-4, rtol=1e-4)

CONFIGS = {
    "off": (FlashLoopConfig(), {}),
    # token-sparse selection sizes change form below 11 tokens: one prefill program from there
    "all_on": (FlashLoopConfig.all_on(**SMALL), {"min_prompt": 11}),
}


@pytest.fixture(scope="module")
def tiny_model():
    """passes.conftest.small: AOTInductor compiles each program in about half the time."""
    return small()


LOADER = """
import json, sys
import torch
from flashloop_compile import load_exported
from flashloop_compile.runtime.engine import Sampling
model = load_exported(sys.argv[1])
prompts, sampling = json.loads(sys.argv[2]), Sampling(**json.loads(sys.argv[3]))
greedy = model.generate(prompts, int(sys.argv[4])).tokens
sampled = model.generate(prompts, int(sys.argv[4]), sampling).tokens
model.reset()
logits = model.prefill(prompts).tolist()
print(json.dumps({"greedy": greedy, "sampled": sampled, "logits": logits, "form": model.form,
                  "models": sorted(m for m in sys.modules if m.startswith("flashloop_compile.models"))}))
"""


def _engine_run(model, config) -> dict:
    torch._dynamo.reset()
    engine = Engine(model, config, max_batch=MAX_BATCH, max_seq=MAX_SEQ, batch_buckets=BUCKETS, progress=False,
                    backend=make_backend(config, inner="eager"))
    greedy = engine.generate(PROMPTS, NEW).tokens
    sampled = engine.generate(PROMPTS, NEW, Sampling(**SAMPLING)).tokens
    if engine.packed is not None:
        engine.packed.reset()
    logits = engine.prefill([torch.tensor(p) for p in PROMPTS])
    return {"greedy": greedy, "sampled": sampled, "logits": logits.tolist()}


@pytest.fixture(scope="module")
def packages(tiny_model, tmp_path_factory):
    """name -> package path, each exported once per module on first use."""
    root, made = tmp_path_factory.mktemp("export"), {}

    def get(name: str) -> Path:
        if name not in made:
            config, options = CONFIGS[name]
            made[name] = root / f"tiny_{name}.pt2"
            flashloop_compile.export(tiny_model, config, made[name], max_batch=MAX_BATCH, max_seq=MAX_SEQ,
                                     batch_buckets=BUCKETS, **options)
        return made[name]

    return get


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def exported(request, packages):
    return request.param, packages(request.param), CONFIGS[request.param][0]


@pytest.fixture(scope="module")
def off_package(packages):
    return packages("off")


def _load_in_fresh_process(path: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-c", LOADER, str(path), json.dumps(PROMPTS), json.dumps(SAMPLING), str(NEW)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_loaded_package_generates_the_compiled_engines_tokens_without_the_model_code(exported, tiny_model):
    name, path, config = exported
    loaded = _load_in_fresh_process(path)
    assert loaded["models"] == []  # flashloop_compile.models never imported
    assert loaded["form"] == "aoti"
    engine = _engine_run(tiny_model, config)
    assert loaded["greedy"] == engine["greedy"]
    assert loaded["sampled"] == engine["sampled"]
    torch.testing.assert_close(torch.tensor(loaded["logits"]), torch.tensor(engine["logits"]), **LOGITS_TOL)


# -- refusals ---------------------------------------------------------------------------------------

def _with_metadata(path: Path, out: Path, **changes) -> Path:
    """A copy of the package whose description has ``changes`` (``cache_layout__version``: nested)."""
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            data = src.read(item.filename)
            if item.filename.endswith("/flashloop.json"):
                meta = json.loads(data)
                for key, value in changes.items():
                    *outer, last = key.split("__")
                    d = meta
                    for k in outer:
                        d = d[k]
                    d[last] = value
                data = json.dumps(meta).encode()
            dst.writestr(item, data)
    return out


@pytest.mark.slow
def test_a_package_loads_only_for_its_config_device_dtype_torch_and_layout(off_package, tmp_path):
    model = load_exported(off_package, config=FlashLoopConfig(), device="cpu", dtype=torch.float32)
    assert model.form == "aoti" and model.buckets == BUCKETS and model.prompt_bounds == (2, MAX_SEQ)
    with pytest.raises(ExportError, match=r"exported for FlashLoop config \w+ .*you asked for \w+ .*export the model with this config"):
        load_exported(off_package, config=CONFIGS["all_on"][0])
    with pytest.raises(ExportError, match="exported for cpu, you asked for cuda: export the model on a cuda device"):
        load_exported(off_package, device="cuda")
    with pytest.raises(ExportError, match=r"exported in float32, you asked for bfloat16: export the model in that dtype"):
        load_exported(off_package, dtype=torch.bfloat16)
    old_torch = _with_metadata(off_package, tmp_path / "torch.pt2", torch_version="2.0.0")
    with pytest.raises(ExportError, match=rf"exported with torch 2\.0\.0, this process runs torch {re.escape(torch.__version__)}.*export again"):
        load_exported(old_torch)
    layout = _with_metadata(off_package, tmp_path / "layout.pt2", cache_layout__version=99)
    with pytest.raises(ExportError, match="dense cache layout version 99, this flashloop_compile allocates version 1: export the model again"):
        load_exported(layout)
    hashed = _with_metadata(off_package, tmp_path / "hash.pt2", config_hash="0123456789abcdef")
    with pytest.raises(ExportError, match="its config hashes to .* the package records 0123456789abcdef"):
        load_exported(hashed)
    if not torch.cuda.is_available():
        cuda = _with_metadata(off_package, tmp_path / "cuda.pt2", device="cuda")
        with pytest.raises(ExportError, match="exported for cuda and this process has no CUDA device: load it on a GPU machine"):
            load_exported(cuda)
    with pytest.raises(ExportError, match="not written by flashloop_compile.export"):
        with zipfile.ZipFile(tmp_path / "plain.pt2", "w") as z:
            z.writestr("plain/archive_format", "pt2")
        load_exported(tmp_path / "plain.pt2")


@pytest.mark.slow
def test_prompts_and_batches_past_the_exported_bounds_are_refused(off_package):
    model = load_exported(off_package)
    with pytest.raises(ExportError, match=rf"a prompt of {MAX_SEQ + 1} tokens is beyond the exported prefill bound of {MAX_SEQ} "
                                          "tokens \\(max_seq\\): shorten the prompt or export with a larger max_seq"):
        model.prefill([[1] * (MAX_SEQ + 1)])
    with pytest.raises(ExportError, match=rf"a prompt of 60 tokens \+ max_new_tokens=8 is beyond the exported bound max_seq={MAX_SEQ}"):
        model.generate([[1] * 60], 8)
    with pytest.raises(ExportError, match="prefill of 3 prompts: the package was exported with max_batch=2; give at most 2"):
        model.prefill([[1, 2]] * 3)
    with pytest.raises(ExportError, match=r"decode batch 3 is beyond the largest exported batch bucket 2 \(buckets \(2,\)\): "
                                          "decode at most 2 rows at once or export with a larger max_batch"):
        model.decode(torch.zeros(3, dtype=torch.long), torch.full((3,), 5))
    # more prompts than max_batch: generate runs them in waves, as the engine does
    assert len(model.generate([[1, 2, 3]] * 3, 2).tokens) == 3


@pytest.mark.slow
def test_a_prompt_below_the_exported_prefill_range_is_refused(exported):
    name, path, _ = exported
    if name != "all_on":
        pytest.skip("features off: one prefill program from 2 tokens")
    model = load_exported(path)
    assert model.prompt_bounds == (11, MAX_SEQ)
    with pytest.raises(ExportError, match="the longest prompt has 5 tokens, below the exported prefill bound of 11 tokens "
                                          r"\(min_prompt\): give a prompt of at least 11 tokens or export with min_prompt <= 5"):
        model.prefill([[1] * 5, [2] * 3])


def test_export_refuses_a_path_that_is_not_a_pt2_package(tiny_model, tmp_path):
    with pytest.raises(ExportError, match=r"the package path must end in \.pt2, got '.*model\.zip'"):
        flashloop_compile.export(tiny_model, None, tmp_path / "model.zip", max_batch=1, max_seq=64)
    with pytest.raises(ExportError, match=r"min_prompt=1 must be in \[2, max_seq=64\]"):
        flashloop_compile.export(tiny_model, None, tmp_path / "model.pt2", max_batch=1, max_seq=64, min_prompt=1)
