"""The NumPy oracle of the Llama example (examples/llama/reference.py) computes
what Hugging Face's LlamaForCausalLM computes, on the same random bf16 weights:
teacher-forced logits at every position of a prompt, GQA and llama3 RoPE
included.  Needs torch and transformers: they are on the GPU machine, so this
runs under scripts/gpu-check."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from llama.config import TINY  # noqa: E402
from llama.reference import ReferenceLlama  # noqa: E402
from llama.weights import random_weights  # noqa: E402


def hf_model(cfg, weights, dtype):
    import torch
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM
    model = LlamaForCausalLM(HFConfig(**cfg.to_dict())).eval()
    state = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.to(device="cuda", dtype=dtype)


@pytest.mark.gpu
def test_the_numpy_oracle_matches_hugging_face_float32(rng):
    import torch
    weights = random_weights(TINY, seed=int(rng.integers(1 << 30)))
    prompt = rng.integers(0, TINY.vocab_size, size=12)
    with torch.no_grad():
        hf = hf_model(TINY, weights, torch.float32)(torch.tensor(prompt[None], device="cuda")).logits[0]
    hf = hf.double().cpu().numpy()
    ref = ReferenceLlama(TINY, weights, capacity=16)
    ours = np.stack([ref.step(int(t), pos) for pos, t in enumerate(prompt)])
    scale = np.abs(hf).max()
    assert np.abs(ours - hf).max() <= 1e-4 * scale, np.abs(ours - hf).max() / scale
