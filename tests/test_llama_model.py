"""The Llama example end to end (examples/llama) on a tiny config: a whole
generation in one graph launch, eager and per-token modes, checked against
the float64 NumPy decoder; bad requests refused before anything launches."""
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import deviceop as dop  # noqa: E402
from llama.config import TINY  # noqa: E402
from llama.generate import Llama  # noqa: E402
from llama.model import Sampling  # noqa: E402
from llama.reference import ReferenceLlama  # noqa: E402
from llama.weights import random_weights  # noqa: E402

CAP = 64


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY, seed=11, std=0.1)  # 0.02 (HF init) makes a tiny model repeat one token


@pytest.fixture(scope="module")
def llama(weights):
    return Llama(TINY, weights, capacity=CAP)


def assert_greedy_under_the_reference(weights, prompt, got, atol=2e-3):
    """Each generated token is the reference's argmax along the generated history, up to
    ``atol`` (bf16 KV entries move logits by ~1e-3: a closer call is a tie)."""
    ref = ReferenceLlama(TINY, weights, CAP)
    history = list(prompt) + list(got)
    for pos in range(len(history) - 1):
        logits = ref.step(history[pos], pos)
        if pos + 1 >= len(prompt):
            chosen = history[pos + 1]
            assert logits[chosen] >= logits.max() - atol, (pos, chosen, int(np.argmax(logits)))


def test_one_launch_generates_what_the_float64_decoder_picks(llama, weights):
    prompt = [5, 17, 923, 4, 4, 61]
    got = llama.generate(prompt, max_new_tokens=10)
    assert len(got) == 10 or got[-1] in TINY.eos_token_id
    assert len(set(got)) > 3  # a generation that moves, not one repeated token
    assert_greedy_under_the_reference(weights, prompt, got)


def test_the_graph_the_eager_ops_and_the_stream_agree(llama):
    prompt = [3, 1, 4, 1, 5]
    in_graph = llama.generate(prompt, max_new_tokens=8)
    assert llama.generate(prompt, max_new_tokens=8, graph=False) == in_graph
    assert list(llama.stream(prompt, max_new_tokens=8)) == in_graph
    assert llama.generate(prompt, max_new_tokens=8) == in_graph  # the cached graph, replayed again


def test_sampling_is_reproducible_for_a_seed(llama):
    prompt = [9, 8, 7]
    s = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    first = llama.generate(prompt, max_new_tokens=12, sampling=s)
    assert llama.generate(prompt, max_new_tokens=12, sampling=s) == first
    assert all(0 <= t < TINY.vocab_size for t in first)


@pytest.mark.parametrize("prompt,max_new,message", [
    ([], 4, "non-empty 1-D sequence"),
    ([1, 2, TINY.vocab_size], 4, f"token id {TINY.vocab_size} is outside the vocabulary"),
    ([1, -3], 4, "token id -3 is outside"),
    ([1] * 60, 5, "need 65 KV entries; the cache holds 64"),
    ([1, 2], 0, "ask for at least one token"),
])
def test_a_request_the_cache_or_vocabulary_cannot_serve_is_refused_before_launching(llama, prompt, max_new,
                                                                                   message):
    before = dop.op.stats["launches"]
    with pytest.raises(dop.ShapeError, match=message):
        llama.generate(prompt, max_new_tokens=max_new)
    assert dop.op.stats["launches"] == before


@pytest.mark.parametrize("poison", ["overflow", "nan"])
def test_logits_that_go_non_finite_make_generate_raise_instead_of_returning_tokens(weights, poison):
    """A down projection whose row overflows float32 (finite bf16 weights near its maximum) or
    holds a NaN: the logits turn NaN, the LM head sets the device error word, and generate
    raises, as for a position outside the cache (issue 32, item 4)."""
    name = "model.layers.1.mlp.down_proj.weight"
    w = weights[name].copy()
    if poison == "overflow":
        w[7] = np.float32(3.0e38)
    else:
        w[7, 100] = np.nan
    llama = Llama(TINY, {**weights, name: w}, capacity=CAP)
    for graph in (True, False):
        with pytest.raises(dop.StateError, match="4: a NaN or infinite logit"):
            llama.generate([5, 17, 4], max_new_tokens=4, graph=graph)
    with pytest.raises(dop.StateError, match="error word 4"):
        list(llama.stream([5, 17, 4], max_new_tokens=2))
