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


# barrier_loop: the test captures a device loop around the Llama kernels; racecheck and synccheck
# cannot run those (docs/robustness.md, "Sanitizers"): under them the loop-free tests below run
# the same kernels.
@pytest.mark.barrier_loop
def test_one_launch_generates_what_the_float64_decoder_picks(llama, weights):
    prompt = [5, 17, 923, 4, 4, 61]
    got = llama.generate(prompt, max_new_tokens=10)
    assert len(got) == 10 or got[-1] in TINY.eos_token_id
    assert len(set(got)) > 3  # a generation that moves, not one repeated token
    assert_greedy_under_the_reference(weights, prompt, got)


def test_the_eager_ops_and_the_stream_pick_what_the_float64_decoder_picks(llama, weights):
    """No device loop: every kernel of a step, launched eagerly and as one graph a token."""
    prompt = [3, 1, 4, 1, 5]
    eager = llama.generate(prompt, max_new_tokens=8, graph=False)
    assert list(llama.stream(prompt, max_new_tokens=8)) == eager
    assert_greedy_under_the_reference(weights, prompt, eager)


@pytest.mark.barrier_loop
def test_the_graph_the_eager_ops_and_the_stream_agree(llama):
    prompt = [3, 1, 4, 1, 5]
    in_graph = llama.generate(prompt, max_new_tokens=8)
    assert llama.generate(prompt, max_new_tokens=8, graph=False) == in_graph
    assert list(llama.stream(prompt, max_new_tokens=8)) == in_graph
    assert llama.generate(prompt, max_new_tokens=8) == in_graph  # the cached graph, replayed again


@pytest.mark.barrier_loop
def test_sampling_is_reproducible_for_a_seed(llama):
    prompt = [9, 8, 7]
    s = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    first = llama.generate(prompt, max_new_tokens=12, sampling=s)
    assert llama.generate(prompt, max_new_tokens=12, sampling=s) == first
    assert all(0 <= t < TINY.vocab_size for t in first)


def test_sampling_eagerly_and_a_graph_a_token_draw_the_same_tokens(llama):
    """No device loop: the sampler, launched eagerly and as one graph a token, for one seed."""
    prompt = [9, 8, 7]
    s = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=4321)
    eager = llama.generate(prompt, max_new_tokens=6, sampling=s, graph=False)
    assert list(llama.stream(prompt, max_new_tokens=6, sampling=s)) == eager
    assert len(eager) == 6 or eager[-1] in TINY.eos_token_id
    assert all(0 <= t < TINY.vocab_size for t in eager)


@pytest.mark.parametrize("prompt,max_new,message", [
    ([], 4, "non-empty 1-D sequence"),
    ([1, 2, TINY.vocab_size], 4, f"token id {TINY.vocab_size} is outside the vocabulary"),
    ([1, -3], 4, "token id -3 is outside"),
    ([1] * 60, 5, "need 65 KV entries; the cache holds 64"),
    ([1, 2], 0, "ask for at least one token"),
    ([1, True, 3], 4, "holds a bool"),          # NumPy alone would read it as id 1
    ((np.int64(5), np.bool_(False)), 4, "holds a bool"),
])
def test_a_request_the_cache_or_vocabulary_cannot_serve_is_refused_before_launching(llama, prompt, max_new,
                                                                                   message):
    before = dop.op.stats["launches"]
    with pytest.raises(dop.ShapeError, match=message):
        llama.generate(prompt, max_new_tokens=max_new)
    assert dop.op.stats["launches"] == before


@pytest.mark.barrier_loop
@pytest.mark.parametrize("poison", ["overflow"])  # a NaN weight is refused at load (test_llama_weights)
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


# -- requests and sampling checked when made (issue 32 items 4 and 16) ------------------------------

@pytest.mark.parametrize("kwargs,message", [
    ({"top_p": 7, "top_k": -3}, "top_p=7 must be a number in \\[0.0, 1.0\\]"),
    ({"top_k": -3}, "top_k=-3 must be an integer in \\[0, "),
    ({"top_k": 2.5}, "top_k=2.5 must be an integer"),
    ({"temperature": float("nan")}, "temperature=nan must be a number"),
    ({"temperature": -1.0}, "temperature=-1.0 must be a number"),
    ({"seed": -1}, "seed=-1 must be an integer in \\[0, 18446744073709551615\\]"),
    ({"seed": "7"}, "seed='7' must be an integer"),
])
def test_sampling_refuses_what_it_cannot_mean_even_when_greedy(kwargs, message):
    with pytest.raises(dop.ShapeError, match=message):
        Sampling(**kwargs)


def test_a_token_budget_that_is_not_an_integer_is_refused_before_launching(llama):
    before = dop.op.stats["launches"]
    for bad in (None, 2.5, True, "4"):
        with pytest.raises(dop.ShapeError, match=f"max_new_tokens={bad!r} must be an integer"):
            llama.generate([1, 2], max_new_tokens=bad)
        with pytest.raises(dop.ShapeError, match=f"max_new_tokens={bad!r} must be an integer"):
            next(llama.stream([1, 2], max_new_tokens=bad))
    assert dop.op.stats["launches"] == before


@pytest.mark.parametrize("capacity", [2.5, "64", True, 1, 2 ** 31])
def test_a_capacity_that_is_not_a_count_is_refused_before_anything_is_allocated(weights, capacity, monkeypatch):
    allocated = []
    monkeypatch.setattr(type(dop.Device(0)), "alloc", lambda self, *a, **k: allocated.append(a))
    with pytest.raises(dop.ShapeError, match=f"a KV capacity of {capacity!r} is not served: give an integer in \\[2, "):
        Llama(TINY, weights, capacity=capacity)
    assert allocated == []


def test_a_cache_larger_than_the_memory_is_refused_before_anything_is_allocated(weights, monkeypatch):
    allocated = []
    monkeypatch.setattr(type(dop.Device(0)), "alloc", lambda self, *a, **k: allocated.append(a))
    with pytest.raises(dop.OutOfMemoryError, match="a KV cache of 2000000000 entries need .* GiB"):
        Llama(TINY, weights, capacity=2_000_000_000)   # 2 TB of K and V
    assert allocated == []


@pytest.mark.barrier_loop
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the overflow is the point
def test_logits_that_go_non_finite_make_the_generation_raise(weights, rng):
    """Finite weights whose activations overflow (a final norm of 1e38): every mode raises
    instead of returning the argmax of garbage (it returned [0, 0, 0, ...])."""
    huge = dict(weights)
    huge["model.norm.weight"] = np.full(TINY.hidden_size, 1e38, np.float32).astype(huge["model.norm.weight"].dtype)
    llama = Llama(TINY, huge, capacity=CAP)
    prompt = rng.integers(0, TINY.vocab_size, size=4)
    for run in (lambda: llama.generate(prompt, 4), lambda: llama.generate(prompt, 4, graph=False),
                lambda: list(llama.stream(prompt, 4)), lambda: llama.logits_along(prompt)):
        with pytest.raises(dop.StateError, match="the logits went non-finite"):
            run()
