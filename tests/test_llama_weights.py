"""The Llama example's config and checkpoint handling (examples/llama): a
config.json read and refused as the kernels require, a safetensors checkpoint
written and read back bit for bit, and weights that do not fit refused by name."""
import json
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import deviceop as dop  # noqa: E402
from llama.config import LLAMA_3_1_8B, LLAMA_3_2_1B, SMOLLM2_135M, TINY, LlamaConfig, kernel_limits  # noqa: E402
from llama.weights import (BF16, check_weights, load_checkpoint, random_weights, save_checkpoint,  # noqa: E402
                           weight_count)


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


# -- every field's type and range, named (issue 32 items 4, 5, 14) ----------------------------------

LLAMA3 = dict(TINY.rope_scaling)


@pytest.mark.parametrize("change,message", [
    ({"hidden_size": 256.9}, "hidden_size=256.9 must be an integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers=True must be an integer"),
    ({"num_key_value_heads": 0}, "num_key_value_heads=0 is outside"),
    ({"intermediate_size": "abc"}, "intermediate_size='abc' must be an integer"),
    ({"vocab_size": None}, "vocab_size=None must be an integer"),
    ({"num_attention_heads": 0}, "num_attention_heads=0 is outside"),
    ({"head_dim": -64}, "head_dim=-64 is outside"),
    ({"rope_scaling": "llama3"}, "rope_scaling='llama3' must be a dict"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 lacks low_freq_factor"),
    ({"rope_scaling": {**LLAMA3, "factor": 0}}, "rope_scaling.factor=0.0 must be a finite positive number"),
    ({"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}}, "high_freq_factor=1.0 must exceed low_freq_factor"),
    ({"eos_token_id": 2 ** 40}, f"eos_token_id={2 ** 40} is outside \\[0, 999\\]"),
    ({"eos_token_id": [2, "x"]}, "eos_token_id='x' must be an integer"),
    ({"bos_token_id": -1}, "bos_token_id=-1 is outside"),
    ({"rope_theta": 0}, "rope_theta=0.0 must be a finite positive number"),
    ({"rope_theta": float("nan")}, "rope_theta=nan must be a finite positive number"),
    ({"rope_theta": 1e39}, "rope_theta=1e\\+39 must be a finite positive number \\(in float32 too\\)"),
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps=inf must be a finite positive number"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps='1e-5' must be a finite positive number"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings=1 must be true or false"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu': the kernels compute SiLU"),
    ({"attention_bias": True}, "attention_bias=True: the kernels add no biases"),
])
def test_every_config_field_is_checked_for_type_and_range_naming_it(change, message):
    with pytest.raises(dop.ShapeError, match=message):
        LlamaConfig.from_dict({**TINY.to_dict(), **change})


def test_a_config_made_directly_is_checked_as_one_read_from_json():
    with pytest.raises(dop.ShapeError, match="rope_theta=0.0 must be a finite positive number"):
        LlamaConfig(**{**TINY.__dict__, "rope_theta": 0.0})


def test_a_missing_kv_head_count_means_full_attention_as_in_hugging_face():
    d = {k: v for k, v in TINY.to_dict().items() if k != "num_key_value_heads"}
    assert LlamaConfig.from_dict(d).num_key_value_heads == TINY.num_attention_heads


def test_transformers_5s_rope_parameters_are_read():
    d = {k: v for k, v in TINY.to_dict().items() if k not in ("rope_theta", "rope_scaling")}
    d["rope_parameters"] = {"rope_theta": TINY.rope_theta, **TINY.rope_scaling}
    cfg = LlamaConfig.from_dict(d)
    assert cfg == TINY and np.array_equal(cfg.inv_freq(), TINY.inv_freq())


@pytest.mark.parametrize("text,message", [("{not json", "is not valid JSON"), ("[1, 2]", "a JSON object of fields"),
                                          (b"\xff\xfe", "is not valid JSON")])
def test_a_malformed_config_json_is_refused_naming_the_file(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(dop.DeviceOpError, match=message):
        LlamaConfig.from_json(tmp_path)


def test_the_kernels_limits_are_one_named_check_a_config_can_skip():
    """kernel_limits is the one place the kernels' shape limits are written on the model's side:
    a config only read (the NumPy decoder, Hugging Face) skips it, a served one is checked."""
    d = {**TINY.to_dict(), "hidden_size": 580, "num_attention_heads": 9, "num_key_value_heads": 3}
    cfg = LlamaConfig.from_dict(d, kernels=False)
    assert cfg.hidden_size == 580
    with pytest.raises(dop.ShapeError, match="hidden_size=580 must be a positive multiple of"):
        kernel_limits(cfg)


def test_a_huge_layer_count_is_checked_cheaply_and_its_weights_counted_before_they_are_named():
    """10^8 layers: the config is made at once, and weights that cannot be its checkpoint are
    refused from their count (building the 9 * 10^8 names took minutes and gigabytes)."""
    start = time.perf_counter()
    cfg = LlamaConfig.from_dict({**TINY.to_dict(), "num_hidden_layers": 10 ** 8})
    with pytest.raises(dop.ShapeError, match=f"holds {weight_count(TINY)} tensors and the config needs "
                                             f"{2 + 9 * 10 ** 8}: it lacks model.layers.2.input_layernorm"):
        check_weights(cfg, random_weights(TINY, seed=1))
    with pytest.raises(dop.ShapeError, match="random weights of this config take .* GB and this machine has"):
        random_weights(cfg)
    assert time.perf_counter() - start < 5


def test_a_non_finite_weight_is_refused_at_load_naming_it(rng):
    weights = random_weights(TINY, seed=int(rng.integers(1 << 30)))
    name = "model.layers.1.mlp.up_proj.weight"
    row, col = int(rng.integers(0, 512)), int(rng.integers(0, 256))
    weights[name][row, col] = rng.choice([np.nan, np.inf, -np.inf])
    with pytest.raises(dop.StateError, match=f"{name} holds a non-finite value .* at flat index {row * 256 + col}"):
        check_weights(TINY, weights)


# -- load_checkpoint's file errors (issue 32 item 15) ---------------------------------------------

def test_a_truncated_or_unreadable_safetensors_file_is_a_state_error_naming_it(tmp_path):
    save_checkpoint(TINY, random_weights(TINY, seed=2), tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    for cut in (len(data) - 1000, 40, 3):
        (tmp_path / "model.safetensors").write_bytes(data[:cut])
        with pytest.raises(dop.StateError, match="cannot read .*model.safetensors: .*is the checkpoint complete"):
            load_checkpoint(tmp_path, progress=False)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors").mkdir()   # a directory where the file should be
    with pytest.raises(dop.StateError, match="cannot read .*model.safetensors"):
        load_checkpoint(tmp_path, progress=False)
    with pytest.raises(dop.StateError, match="is not a directory"):
        load_checkpoint(tmp_path / "config.json", progress=False)


def sharded(tmp_path):
    save_checkpoint(TINY, random_weights(TINY, seed=4), tmp_path, shard_bytes=150_000)
    index = tmp_path / "model.safetensors.index.json"
    return index, json.loads(index.read_text())


def test_an_index_that_is_not_json_or_names_a_missing_shard_is_refused(tmp_path):
    index, content = sharded(tmp_path)
    index.write_text("{")
    with pytest.raises(dop.StateError, match="is not a safetensors index"):
        load_checkpoint(tmp_path, progress=False)
    index.write_text(json.dumps({"weight_map": {**content["weight_map"], "extra.weight": "gone.safetensors"}}))
    with pytest.raises(dop.StateError, match="names the shard gone.safetensors, which is not in"):
        load_checkpoint(tmp_path, progress=False)
    index.write_text(json.dumps({"weight_map": {**content["weight_map"], "extra.weight": "../x.safetensors"}}))
    with pytest.raises(dop.StateError, match="not a file of this directory"):
        load_checkpoint(tmp_path, progress=False)


def test_a_tensor_stored_in_two_shards_is_refused_and_the_index_is_followed(tmp_path):
    from safetensors.numpy import load_file, save_file
    index, content = sharded(tmp_path)
    shards = sorted(set(content["weight_map"].values()))
    first, last = tmp_path / shards[0], tmp_path / shards[-1]
    name = next(n for n, f in content["weight_map"].items() if f == shards[0])
    tensors = load_file(last)
    tensors[name] = np.zeros_like(load_file(first)[name])   # a stale copy in another shard
    save_file(tensors, last)
    with pytest.raises(dop.StateError, match=f"{name} is stored in two shards, {shards[0]} and {shards[-1]}"):
        load_checkpoint(tmp_path, progress=False)
    del tensors[name]                                          # and a tensor the index puts elsewhere, missing
    save_file(tensors, last)
    moved = {**content["weight_map"], name: shards[-1]}
    index.write_text(json.dumps({"weight_map": moved}))
    with pytest.raises(dop.StateError, match=f"puts {name} in {shards[-1]}, which lacks it"):
        load_checkpoint(tmp_path, progress=False)
