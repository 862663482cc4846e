"""The committed trained checkpoint (skipped until it exists): it beats the unigram baseline by far,
and the evaluation runs on it — a small slice on CPU, the default table on GPU (``pytest -m gpu``).

Path: ``checkpoints/ouro-python-6x256`` or ``$FLASHLOOP_QUALITY_CHECKPOINT``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from flashloop_compile.models.ouro import OuroForCausalLM
from flashloop_compile.quality.corpus import ByteTokenizer, Corpus, unigram_bits_per_byte
from flashloop_compile.quality.evaluate import EvalSettings, parse_configs, quality_table

CHECKPOINT = Path(os.environ.get("FLASHLOOP_QUALITY_CHECKPOINT", Path(__file__).resolve().parents[2] / "checkpoints" / "ouro-python-6x256"))

pytestmark = pytest.mark.skipif(not (CHECKPOINT / "config.json").is_file(), reason=f"no trained checkpoint at {CHECKPOINT}")


@pytest.fixture(scope="module")
def trained():
    return OuroForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32).eval()


@torch.no_grad()
def test_checkpoint_beats_the_unigram_baseline(trained):
    corpus = Corpus()
    seqs = corpus.sequences("heldout", 2, 512, ByteTokenizer(trained.config.vocab_size))
    nll = n = 0.0
    for s in seqs:
        logits = trained(s[None])[0].float()
        nll += float(F.cross_entropy(logits[:-1], s[1:], reduction="sum"))
        n += s.numel() - 1
    bits = nll / n / math.log(2)
    unigram = unigram_bits_per_byte(corpus.documents("train")[:200], corpus.documents("heldout"))
    assert bits < 2.5 and bits < unigram - 2.0, (bits, unigram)


def test_checkpoint_quality_table_small_slice(trained):
    settings = EvalSettings(docs=2, contexts=(256,), continuation=16, retrieval_context=256, depths=(0.5,),
                            retrieval_trials=2, n_boot=200)
    report = quality_table(trained, parse_configs(["all-on"]), settings, corpus=Corpus(), model_name=str(CHECKPOINT))
    for row in report.rows:
        st = row["cont@256"]
        assert all(math.isfinite(v) for v in st.values()) and st["ppl"] < 8.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_checkpoint_default_table_on_gpu():
    model = OuroForCausalLM.from_pretrained(CHECKPOINT, dtype=torch.float32, device="cuda").eval()
    settings = EvalSettings(docs=4, contexts=(1024,), continuation=32, retrieval_context=1024, depths=(0.1, 0.9),
                            retrieval_trials=2, n_boot=200)
    report = quality_table(model, parse_configs(["default"]), settings, corpus=Corpus(), model_name=str(CHECKPOINT))
    assert [r["config"] for r in report.rows][:2] == ["dense", "all-on"]
    for row in report.rows:
        assert all(math.isfinite(v) for v in row["cont@1024"].values())
