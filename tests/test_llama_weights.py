"""The Llama example's config and checkpoint handling (examples/llama): a
config.json read and refused as the kernels require, a safetensors checkpoint
written and read back bit for bit, and weights that do not fit refused by name."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import deviceop as dop  # noqa: E402
from llama.config import LLAMA_3_1_8B, LLAMA_3_2_1B, SMOLLM2_135M, TINY, LlamaConfig  # noqa: E402
from llama.weights import BF16, check_weights, load_checkpoint, random_weights, save_checkpoint  # noqa: E402


def test_the_1b_config_reads_back_from_its_hugging_face_fields():
    cfg = LlamaConfig.from_dict(json.loads(json.dumps(LLAMA_3_2_1B.to_dict())))
    assert cfg == LLAMA_3_2_1B and cfg.group == 4 and cfg.eos_token_id == (128001, 128008, 128009)
    # every weight once, the tied head counted as the head: the 2.47 GB
    assert abs(cfg.weight_bytes() / 1e9 - 2.4716) < 1e-3


def test_llama3_rope_frequencies_follow_the_three_bands():
    inv = LLAMA_3_2_1B.inv_freq()
    plain = 1.0 / 500000.0 ** (np.arange(0, 64, 2) / 64)
    wavelen = 2 * np.pi / plain
    high, low = wavelen < 8192 / 4, wavelen > 8192 / 1
    assert np.allclose(inv[high], plain[high], rtol=1e-6)        # short wavelengths kept
    assert np.allclose(inv[low], plain[low] / 32, rtol=1e-6)     # long ones divided by the factor
    mid = ~high & ~low
    assert mid.any() and np.all((inv[mid] < plain[mid]) & (inv[mid] > plain[mid] / 32))


@pytest.mark.parametrize("change,message", [
    ({"head_dim": 80}, "head_dim 80 is not supported"),
    ({"num_key_value_heads": 3}, "not a multiple of 3 KV heads"),
    ({"hidden_size": 1001, "head_dim": 64}, "hidden_size=1001 must be a positive multiple of 8"),
    ({"intermediate_size": 65536}, "intermediate_size \\(down\\): matvec_residual: K=65536 needs .* bytes of "
                                   "shared memory"),
    ({"vocab_size": 2**20 + 1}, "a vocabulary of 1048577 is not served"),
    ({"num_attention_heads": 32, "num_key_value_heads": 2}, "a group of 16 query heads"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
])
def test_a_config_the_kernels_cannot_serve_is_refused_naming_the_limit(change, message):
    with pytest.raises(dop.ShapeError, match=message):
        LlamaConfig.from_dict({**TINY.to_dict(), **change})


@pytest.mark.parametrize("cfg", [LLAMA_3_2_1B, LLAMA_3_1_8B, SMOLLM2_135M], ids=["1b", "8b", "smollm2"])
def test_the_family_configs_are_served(cfg):
    assert LlamaConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


def test_a_config_without_the_llama_fields_is_refused():
    with pytest.raises(dop.ShapeError, match="missing intermediate_size"):
        LlamaConfig.from_dict({"hidden_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "vocab_size": 10})


@pytest.mark.parametrize("shard_bytes", [None, 150_000], ids=["one file", "sharded"])
def test_a_checkpoint_round_trips_through_safetensors(tmp_path, shard_bytes):
    weights = random_weights(TINY, seed=3)
    save_checkpoint(TINY, weights, tmp_path, shard_bytes=shard_bytes)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_bytes is not None)
    back = load_checkpoint(tmp_path, progress=False)
    assert LlamaConfig.from_json(tmp_path) == TINY
    assert sorted(back) == sorted(weights)
    for name, w in weights.items():
        assert back[name].dtype == BF16 and np.array_equal(back[name].view(np.uint16), w.view(np.uint16)), name
    check_weights(TINY, back)


def test_weights_of_the_wrong_shape_or_dtype_are_refused_by_name():
    weights = random_weights(TINY, seed=1)
    bad = dict(weights, **{"model.layers.1.mlp.up_proj.weight": weights["model.layers.1.mlp.up_proj.weight"][:-1]})
    with pytest.raises(dop.ShapeError, match=r"model.layers.1.mlp.up_proj.weight has shape \(511, 256\)"):
        check_weights(TINY, bad)
    bad = dict(weights, **{"model.norm.weight": weights["model.norm.weight"].astype(np.float32)})
    with pytest.raises(dop.DTypeError, match="model.norm.weight is float32"):
        check_weights(TINY, bad)
    del weights["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(dop.ShapeError, match="lacks model.layers.0.self_attn.k_proj.weight"):
        check_weights(TINY, weights)


def test_a_directory_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(dop.StateError, match="holds no model.safetensors"):
        load_checkpoint(tmp_path)
