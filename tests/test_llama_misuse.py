"""The Llama example used as a demanding user would (issues 32 and 34): two threads on one
model, a stream interrupted or abandoned, repeated teacher-forcing positions, arguments of
the wrong kind.  Each refusal is a deviceop error naming the fix, raised before anything
launches, and the model stays usable after it."""
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import deviceop as dop  # noqa: E402
from llama.config import TINY  # noqa: E402
from llama.generate import Llama  # noqa: E402
from llama.weights import random_weights  # noqa: E402

CAP = 64


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY, seed=5, std=0.1)


@pytest.fixture
def llama(weights):
    with Llama(TINY, weights, capacity=CAP) as model:
        yield model


def prompts(rng, n=2, length=4):
    return [rng.integers(0, TINY.vocab_size, size=length).tolist() for _ in range(n)]


def test_two_threads_generating_on_one_model_each_get_their_own_answer(llama, rng):
    """The KV cache and decode state are the model's: concurrent requests run one after the
    other (they interleaved, and most answers were another prompt's or garbage)."""
    a, b = prompts(rng)
    want = {0: llama.generate(a, 10, graph=False), 1: llama.generate(b, 10, graph=False)}
    got, errors = {0: [], 1: []}, []

    def work(i, prompt):
        try:
            for graph in (True, False, True):
                got[i].append(llama.generate(prompt, 10, graph=graph))
        except Exception as exc:  # noqa: BLE001 (reported below, with the thread's prompt)
            errors.append(exc)
    threads = [threading.Thread(target=work, args=(i, p)) for i, p in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert got == {i: [want[i]] * 3 for i in (0, 1)}


def test_a_stream_interrupted_by_another_request_refuses_to_go_on(llama, rng):
    """It went on from the other request's state and yielded garbage (one token too many)."""
    a, b = prompts(rng)
    whole = llama.generate(a, 6)
    stream = llama.stream(a, 6)
    assert next(stream) == whole[0]
    other = llama.generate(b, 6)
    with pytest.raises(dop.StateError, match="this stream was interrupted: another generate"):
        next(stream)
    assert llama.generate(b, 6) == other and list(llama.stream(a, 6)) == whole  # the model is still whole


def test_an_abandoned_stream_leaves_the_model_clean_and_a_closed_one_refuses(llama, rng):
    a, b = prompts(rng)
    whole = llama.generate(a, 5)
    partial = llama.stream(b, 5)
    next(partial)
    del partial
    assert llama.generate(a, 5) == whole
    live = llama.stream(a, 5)
    next(live)
    llama.close()
    with pytest.raises(dop.StateError, match="this Llama was closed"):
        next(live)
    with pytest.raises(dop.StateError, match="this Llama was closed"):
        llama.__enter__()


def test_a_position_asked_for_twice_gets_its_logits_twice(llama, rng):
    """Only the last row asked for a position was written; the other stayed uninitialised and
    the call raised that the logits went non-finite (or returned garbage)."""
    tokens = rng.integers(0, TINY.vocab_size, size=5).tolist()
    once = llama.logits_along(tokens, [1, 3])
    twice = llama.logits_along(tokens, [3, 1, 3, 1])
    np.testing.assert_array_equal(twice, once[[1, 0, 1, 0]])


@pytest.mark.parametrize("call,message", [
    (lambda m, p: m.logits_along(p, 2), "positions=2 must be a sequence of token positions"),
    (lambda m, p: m.logits_along(p, "01"), "positions='01' must be a sequence"),
    (lambda m, p: m.logits_along(p * CAP, [0]), f"teacher forcing {3 * CAP} tokens takes {3 * CAP + 1} KV entries"),
    (lambda m, p: m.generate(p, 3, {"temperature": 1.0}), "sampling=.* is not a Sampling: pass Sampling"),
    (lambda m, p: m.generate(p, 3, (1.0, 0, 1.0, 0)), "is not a Sampling"),
    (lambda m, p: m.stream(p, 3, {"temperature": 1.0}), "is not a Sampling"),
    (lambda m, p: m.generate([[1, 2], [3]], 3), "a prompt is a non-empty 1-D sequence of token ids, got list"),
    (lambda m, p: m.generate(p, 3, graph="no"), "graph='no': pass True"),
    (lambda m, p: m.stream([], 3), "a prompt is a non-empty 1-D sequence"),  # at the call, not at the first next
    (lambda m, p: m.time_generation(p, 3, reps=0), "reps=0: time at least one replay"),
    (lambda m, p: m.time_generation(p, 3, reps="5"), "reps='5'"),
])
def test_arguments_of_the_wrong_kind_are_refused_before_launching_and_the_model_stays_usable(llama, rng, call,
                                                                                           message):
    """Each raised a raw AttributeError, TypeError, ValueError or StatisticsError (or, for a
    stream, nothing until its first token was asked for)."""
    prompt = rng.integers(0, TINY.vocab_size, size=3).tolist()
    want = llama.generate(prompt, 4)
    before = dop.op.stats["launches"]
    with pytest.raises(dop.ShapeError, match=message):
        call(llama, prompt)
    assert dop.op.stats["launches"] == before
    assert llama.generate(prompt, 4) == want


# -- the model and its arguments ----------------------------------------------------------------

@pytest.fixture
def allocations(monkeypatch):
    calls = []
    original = type(dop.Device(0)).alloc
    monkeypatch.setattr(type(dop.Device(0)), "alloc", lambda self, *a, **k: calls.append(a) or original(self, *a, **k))
    return calls


@pytest.mark.parametrize("change,error,message", [
    (lambda cfg, w: dict(cfg=cfg.to_dict()), dop.DTypeError, "the config is a dict, not a LlamaConfig"),
    (lambda cfg, w: dict(weights=list(w.values())), dop.DTypeError, "the weights are a list, not a mapping"),
    (lambda cfg, w: dict(weights=None), dop.DTypeError, "the weights are a NoneType"),
    (lambda cfg, w: dict(weights={**w, "model.norm.weight": [1.0] * cfg.hidden_size}), dop.DTypeError,
     "model.norm.weight is a list, not an array"),
    (lambda cfg, w: dict(stream=5), dop.DTypeError, "stream=5 is not a deviceop stream"),
    (lambda cfg, w: dict(pdl="no"), dop.DTypeError, "pdl='no': pass True"),
    (lambda cfg, w: dict(prefill_chunk=3), dop.ShapeError, "a chunk of T=3 tokens is not supported"),
    (lambda cfg, w: dict(prefill_chunk=8.0), dop.ShapeError, "a prefill chunk must be an int"),
    (lambda cfg, w: dict(weights={**w, "model.layers.0.self_attn.q_proj.bias": w["model.norm.weight"]}),
     dop.ShapeError, "holds model.layers.0.self_attn.q_proj.bias, a bias a Llama decoder does not add"),
])
def test_model_arguments_of_the_wrong_kind_are_refused_before_anything_is_allocated(weights, allocations, change,
                                                                                  error, message):
    """A DTypeError for an argument of the wrong kind, a ShapeError for a chunk or a bias.  Each
    was a raw AttributeError/TypeError, accepted as truthy (pdl='no'), refused only at the
    first generate (a chunk), or accepted and decoded without its biases (Qwen2-style)."""
    args = {"cfg": TINY, "weights": weights, "capacity": CAP, **change(TINY, weights)}
    with pytest.raises(error, match=message):
        Llama(args.pop("cfg"), args.pop("weights"), **args)
    assert allocations == []


@pytest.mark.parametrize("fields,message", [
    ({"model_type": "qwen2"}, "model_type='qwen2': this decoder reads Llama-family configs"),
    ({"model_type": "gemma"}, "model_type='gemma'"),
    ({"model_type": "mistral", "sliding_window": 4096}, "sliding_window=4096: the kernels attend to the whole cache"),
])
def test_a_config_of_another_architecture_is_refused_naming_it(fields, message):
    """A Qwen2 config (SiLU, no bias fields) or a windowed Mistral one read as a Llama config."""
    from llama.config import LlamaConfig
    with pytest.raises(dop.ShapeError, match=message):
        LlamaConfig.from_dict({**TINY.to_dict(), **fields})
    assert LlamaConfig.from_dict({**TINY.to_dict(), "model_type": "mistral", "sliding_window": None}) == TINY


@pytest.mark.parametrize("kernels", ["no", 0, None])
def test_from_dict_takes_only_a_bool_for_kernels(kernels):
    """``kernels="no"`` is truthy: it applied the kernels' limits the caller meant to skip."""
    from llama.config import LlamaConfig
    with pytest.raises(dop.DTypeError, match=r"kernels=.*pass True .* or False"):
        LlamaConfig.from_dict(TINY.to_dict(), kernels=kernels)
    assert LlamaConfig.from_dict(TINY.to_dict(), kernels=False) == TINY


def test_a_server_of_fresh_seeds_keeps_a_bounded_number_of_graphs(llama, rng):
    """Each seed (prompt length, budget) captures a graph of its own: 40 requests kept 40 whole
    generations and 40 steps captured, for the Llama's lifetime.  The most recently used
    MAX_GRAPHS stay; an evicted request captures again and draws the same tokens."""
    import gc

    from llama.generate import MAX_GRAPHS
    from llama.model import Sampling
    prompt = rng.integers(0, TINY.vocab_size, size=3).tolist()
    first = [llama.generate(prompt, 3, Sampling(0.8, 20, 0.9, seed)) for seed in range(MAX_GRAPHS + 8)]
    for seed in range(MAX_GRAPHS + 8):
        list(llama.stream(prompt, 3, Sampling(0.8, 20, 0.9, seed)))
    gc.collect()
    live = [o for o in gc.get_objects() if type(o).__name__ == "CudaGraph" and "closed" not in repr(o)]
    assert len(live) <= 2 * MAX_GRAPHS
    assert llama.generate(prompt, 3, Sampling(0.8, 20, 0.9, 0)) == first[0]   # evicted, captured again


def test_a_numpy_integer_chunk_is_the_int_it_holds(weights, rng):
    """capacity and max_new_tokens took np.int64(8); prefill_chunk refused it as "not an int"."""
    prompt = rng.integers(0, TINY.vocab_size, size=11).tolist()
    with Llama(TINY, weights, capacity=CAP, prefill_chunk=np.int64(8)) as chunked, \
            Llama(TINY, weights, capacity=CAP) as plain:
        want = plain.generate(prompt, 4)
        assert chunked.generate(prompt, 4) == want
        assert plain.generate(prompt, 4, prefill_chunk=np.int32(16)) == want


@pytest.mark.parametrize("call", [
    lambda: __import__("llama.weights").weights.load_checkpoint(None),
    lambda: __import__("llama.weights").weights.save_checkpoint(TINY, {}, 5),
    lambda: __import__("llama.config").config.LlamaConfig.from_json(None),
    lambda: __import__("llama.gguf_model").gguf_model.open_gguf(None),
    lambda: __import__("llama.tokenizer").tokenizer.Tokenizer.from_directory(b"/tmp"),
])
def test_a_location_that_is_not_a_path_is_refused_naming_it(call):
    """None, an int or bytes where a file or directory goes raised pathlib's raw TypeError."""
    with pytest.raises(dop.DTypeError, match=r"is a path \(a str or pathlib.Path\), not (NoneType|int|bytes)"):
        call()


@pytest.mark.parametrize("args,error,message", [
    (dict(cfg=TINY.to_dict()), dop.DTypeError, "the config is a dict, not a LlamaConfig"),
    (dict(seed=-1), dop.ShapeError, r"seed=-1 must be an integer >= 0"),     # numpy's raw ValueError
    (dict(seed=1.5), dop.ShapeError, r"seed=1.5 must be an integer"),
    (dict(std=float("nan")), dop.ShapeError, r"std=nan must be a finite number >= 0"),  # NaN weights, silently
    (dict(std=-0.1), dop.ShapeError, r"std=-0.1 must be a finite number >= 0"),
])
def test_random_weights_refuses_what_it_cannot_mean(args, error, message):
    """A ShapeError for a seed or std out of range, a DTypeError for a config that is not one (a
    raw AttributeError)."""
    from llama.weights import random_weights
    with pytest.raises(error, match=message):
        random_weights(**{"cfg": TINY, **args})


def test_deviceop_tensors_are_weights_as_torch_ones_are(weights, rng):
    """A bf16 dop.Tensor was refused as "dop.bfloat16, the kernels read bfloat16 weights"."""
    prompt = rng.integers(0, TINY.vocab_size, size=4).tolist()
    name = "model.layers.1.self_attn.q_proj.weight"
    with Llama(TINY, weights, capacity=CAP) as plain, \
            Llama(TINY, {**weights, name: dop.from_numpy(weights[name])}, capacity=CAP) as mixed:
        assert mixed.generate(prompt, 5) == plain.generate(prompt, 5)
    as_float = dop.from_numpy(weights[name].astype(np.float32))
    with pytest.raises(dop.DTypeError, match=f"{name} is dop.float32, the kernels read bfloat16"):
        Llama(TINY, {**weights, name: as_float}, capacity=CAP)
