"""The Hugging Face Ouro as users have it (masks from the masking utilities, a concat cache):
``OuroForCausalLM.from_hf`` converts it exactly, and compiling it with a feature on is an error
that names that conversion.

Tolerance: the weights are compared exactly, and so are the logits where both models attend with
SDPA (FP32); the HF model's eager attention (matmul, softmax, matmul) is another computation of the
same function, compared at ATOL = RTOL = 1e-5 as in test_hf_style_ouro.py.
"""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.backend import make_backend
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.models.ouro import PRESETS, ModelConfigError, OuroForCausalLM
from flashloop_compile.passes import RecognitionError
from flashloop_compile.reference import ReferenceFlashLoop

from .hf_style_ouro import LoopedDynamicCache
from .hf_style_ouro import OuroForCausalLM as HFOuro

ATOL = RTOL = 1e-5


def hf_model(**overrides) -> HFOuro:
    """An HF-layout Ouro with its own (HF default) initialization, as a user holds it in memory."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        return HFOuro(PRESETS["tiny"], mask_implementation="masking_utils", **overrides).eval()


def greedy_hf(model: HFOuro, prompt: torch.Tensor, steps: int) -> list[int]:
    cache = LoopedDynamicCache()
    tokens, ids = [], prompt[None]
    with torch.no_grad():
        for _ in range(steps):
            ids = model(ids, past_key_values=cache).logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(int(ids))
    return tokens


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_from_hf_of_an_in_memory_model_is_exact(impl):
    hf = hf_model(attn_implementation=impl)
    ours = OuroForCausalLM.from_hf(hf)
    assert not ours.training
    hf_state, our_state = hf.state_dict(), ours.state_dict()
    assert hf_state.keys() == our_state.keys()
    assert all(torch.equal(hf_state[k], our_state[k]) for k in hf_state)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    tol = 0.0 if impl == "sdpa" else ATOL
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=tol, rtol=tol)
    prompt = ids[0]
    assert ReferenceFlashLoop(ours).greedy(prompt, 8).tolist() == greedy_hf(hf, prompt, 8)


def test_from_hf_of_a_checkpoint_directory_and_in_another_dtype(tmp_path):
    hf = hf_model()
    OuroForCausalLM.from_hf(hf).save_pretrained(tmp_path)
    loaded = OuroForCausalLM.from_hf(tmp_path)
    converted = OuroForCausalLM.from_hf(hf, dtype=torch.bfloat16)
    for k, v in hf.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v)
        assert torch.equal(converted.state_dict()[k], v.to(torch.bfloat16))


def test_from_hf_refuses_what_is_not_an_hf_ouro():
    with pytest.raises(TypeError, match="a Hugging Face Ouro model"):
        OuroForCausalLM.from_hf({"model.norm.weight": torch.ones(4)})
    hf = hf_model()
    hf.extra = torch.nn.Linear(2, 2)
    with pytest.raises(ModelConfigError, match=r"unexpected \['extra.bias', 'extra.weight'\]"):
        OuroForCausalLM.from_hf(hf)


def _compile_error(model, config, *args, **kwargs) -> BaseException:
    torch._dynamo.reset()
    with pytest.raises(Exception) as info, torch.no_grad():
        torch.compile(model, backend=make_backend(config, inner="eager"), fullgraph=True)(*args, **kwargs)
    torch._dynamo.reset()
    return getattr(info.value, "inner_exception", info.value)


def test_compiling_the_hf_model_with_a_feature_on_names_the_conversion():
    hf = hf_model(attn_implementation="sdpa")
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    err = _compile_error(hf, FlashLoopConfig.from_switches(True, False, False), ids)
    assert isinstance(err, RecognitionError)
    assert "token_sparse_prefill needs a KV cache written in place" in str(err)
    assert "OuroForCausalLM.from_hf(hf_model_or_path)" in str(err) and "setup_caches" in str(err)
    cache = LoopedDynamicCache()
    with torch.no_grad():
        hf(ids, past_key_values=cache)
    err = _compile_error(hf, FlashLoopConfig.from_switches(False, False, True), ids[:, :1], past_key_values=cache)
    assert isinstance(err, RecognitionError)
    assert "reads a 'concat' cache" in str(err) and "OuroForCausalLM.from_hf(hf_model_or_path)" in str(err)


def test_the_converted_model_compiles_with_the_feature_on():
    # what the error says to do: convert, allocate the in-place cache, compile
    config = FlashLoopConfig.from_switches(True, False, False, **{"token_sparse_prefill.window": 8})
    model = OuroForCausalLM.from_hf(hf_model(attn_implementation="sdpa"))
    model.setup_caches(1, 32)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(16)[None]
    torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.mark_dynamic(pos, 1)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend=make_backend(config, inner="eager"), fullgraph=True)(ids, pos)[0, -1]
    torch._dynamo.reset()
    expected = ReferenceFlashLoop(model, config).request().prefill(ids[0]).logits[-1]
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)
