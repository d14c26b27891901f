"""Tensor-parallel Llama decode (examples/llama/tp.py) on the reference backend: N thread-ranks
(``dist.run_reference``) each run their Megatron share of a tiny model, with the all-reduces
and the vocabulary-shard argmax inside the one-launch generation, and generate what TP=1 does."""
import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import deviceop as dop  # noqa: E402
import deviceop.distributed as dist  # noqa: E402
from deviceop.kernels.llama_tp import PAIRS, argmax_key, tp_argmax_pair, tp_argmax_pick, tp_place  # noqa: E402
from llama.generate import Llama  # noqa: E402
from llama.model import Sampling  # noqa: E402
from llama.plans import decode_kernels  # noqa: E402
from llama.tp import TINY_TP, shard_weights, Shard  # noqa: E402
from llama.weights import layer_names, random_weights  # noqa: E402

CAP = 16
NEW = 6
CFG = TINY_TP
# ~18 NVRTC compiles (each TP size has its own shard shapes): conftest compiles them in a background
# process while the other modules run, and runs this module after them
PRECOMPILE = list({(k.name, tuple(g)): (k, g) for n in (1, 2, 4) for k, g in decode_kernels(CFG, CAP, Shard(CFG, 0, n))}
                  .values())


@pytest.fixture(scope="module")
def model():
    """Weights (seeded from fresh entropy: every run another model), a prompt, and TP=1's answers."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"model seed {seed}")
    rng = np.random.default_rng(seed)
    weights = random_weights(CFG, seed=seed, std=0.1)
    prompt = rng.integers(3, CFG.vocab_size, 4)
    llama = Llama(CFG, weights, capacity=CAP)
    sampling = Sampling(temperature=0.8, top_k=40, top_p=0.9, seed=seed)
    return {"weights": weights, "prompt": prompt, "greedy": llama.generate(prompt, NEW),
            "sampled": llama.generate(prompt, NEW, sampling), "sampling": sampling,
            "logits": llama.logits_along(prompt)}


@pytest.mark.parametrize("tp,allreduce", [(2, "auto"), (4, "auto"), (2, "oneshot"), (2, "nccl")])
def test_tensor_parallel_greedy_tokens_are_tp1s_in_one_launch_and_eagerly(model, tp, allreduce):
    """"auto": the O and down projections all-reduce in their epilogue (matvec_allreduce), the
    head's exchanges are the one-shot kernel; "oneshot": that kernel after every projection;
    "nccl": collectives."""
    def rank(group):
        llama = Llama(CFG, model["weights"], capacity=CAP, group=group, allreduce=allreduce)
        assert (llama.decoder.fused is not None) == (allreduce == "auto")
        return llama.generate(model["prompt"], NEW), llama.generate(model["prompt"], NEW, graph=False)
    for in_graph, eager in dist.run_reference(tp, rank):
        assert in_graph == model["greedy"] and eager == model["greedy"]


@pytest.mark.parametrize("allreduce", ["auto", "nccl"])
def test_tensor_parallel_sampling_and_teacher_forced_logits_are_tp1s(model, allreduce):
    """The logits gathered whole: a sum of zero-padded shards by the one-shot ("auto") or an all-gather."""
    def rank(group):
        llama = Llama(CFG, model["weights"], capacity=CAP, group=group, allreduce=allreduce)
        return llama.generate(model["prompt"], NEW, model["sampling"]), llama.logits_along(model["prompt"])
    for sampled, logits in dist.run_reference(2, rank):
        assert sampled == model["sampled"]
        # the all-reduce adds float32 partial sums where TP=1 adds in one dot product: a last-bit
        # difference that rounds a K or V entry to the neighbouring bf16 (2^-8 apart) moves the later
        # logits by ~2^-8 of their scale (seen on an H200: 1.4e-3 of it), so compare at that resolution
        assert np.max(np.abs(logits - model["logits"])) <= 2.0 ** -7 * np.max(np.abs(model["logits"]))


def test_the_shards_of_every_rank_put_back_together_are_the_model(model):
    w = model["weights"]
    parts = [shard_weights(CFG, w, Shard(CFG, r, 4), layer_names) for r in range(4)]
    n = layer_names(1)
    cat = np.concatenate
    assert np.array_equal(cat([p["layers"][1]["k"] for p in parts]), w[n["k"]])
    assert np.array_equal(cat([p["layers"][1]["o"] for p in parts], axis=1), w[n["o"]])
    assert np.array_equal(cat([p["layers"][1]["down"] for p in parts], axis=1), w[n["down"]])
    assert np.array_equal(cat([p["head"] for p in parts]), w["model.embed_tokens.weight"])  # tied: the embedding
    assert all(p["embed"] is w["model.embed_tokens.weight"] for p in parts)                 # whole on every rank


def test_the_vocabulary_shards_argmax_keeps_tp1s_tie_rule(stream, rng):
    """Ranks' picks, summed as the all-reduce sums them, combine to the first largest logit of
    the whole vocabulary: a tie goes to the lower global index (rank 0's), NaN beats every number."""
    best = float(rng.standard_normal())
    logits = [np.float32(rng.standard_normal(16) - 10) for _ in range(3)]
    local = [int(rng.integers(16)) for _ in range(3)]
    for shard, i in zip(logits[:2], local):
        shard[i] = best

    def pick(values, tokens):
        total = np.zeros(PAIRS, np.float32)
        for r, (v, t) in enumerate(zip(values, tokens)):
            pairs = dop.empty([PAIRS], stream=stream)
            tp_argmax_pair(pairs.partition([PAIRS]), dop.from_numpy(v, stream=stream),
                           dop.from_numpy(np.array([t], np.int32), stream=stream), PAIRS, r, 16 * r).sync_on(stream)
            mine = pairs.numpy(stream=stream)
            assert np.count_nonzero(np.delete(mine, [2 * r, 2 * r + 1])) == 0 and mine[2 * r + 1] == 16 * r + t
            total += mine
        out = dop.from_numpy(np.zeros(1, np.int32), stream=stream)
        tp_argmax_pick(out.partition([1]), dop.from_numpy(total, stream=stream), len(values)).sync_on(stream)
        return int(out.numpy(stream=stream)[0])

    assert pick(logits, local) == local[0] == int(np.argmax(np.concatenate(logits)))
    logits[2][3] = np.nan
    assert pick(logits, [local[0], local[1], 3]) == 32 + 3 == int(np.argmax(np.concatenate(logits)))
    assert argmax_key(-0.0, 1) == argmax_key(0.0, 1)  # -0 and +0 tie, as the kernel's key has them


def test_the_vocabulary_kernels_refuse_wrong_shapes_through_their_declarations(stream, rng):
    """pairs [n_pairs] partitioned whole, token int32 [1], src [n], out's tile [B]: said by the
    shapes (no hand-written check), each refusal naming the parameter, the values and the fix."""
    logits = dop.from_numpy(rng.standard_normal(16).astype(np.float32), stream=stream)
    i32 = lambda n: dop.from_numpy(np.zeros(n, np.int32), stream=stream)  # noqa: E731
    pairs = dop.empty([PAIRS], stream=stream)
    for launch, match in (
            (lambda: tp_argmax_pair(pairs.partition([PAIRS]), logits, i32(1), PAIRS // 2, 0, 0),
             rf"tp_argmax_pair<n_pairs={PAIRS // 2}>: argument pairs has shape \[{PAIRS}\], but its axis 0 is "
             rf"n_pairs: {PAIRS // 2} from the scalar argument n_pairs, {PAIRS} here; pass n_pairs={PAIRS} "
             r"\(pairs\.shape\[0\]\)"),
            (lambda: tp_argmax_pair(pairs.partition([PAIRS // 2]), logits, i32(1), PAIRS, 0, 0),
             rf"partition pairs with \[{PAIRS}\], not \[{PAIRS // 2}\]"),
            (lambda: tp_argmax_pair(pairs.partition([PAIRS]), logits, i32(2), PAIRS, 0, 0),
             r"argument token has shape \[2\], but its axis 0 must be 1; pass a token of shape \[1\]"),
            (lambda: tp_argmax_pick(i32(2).partition([1]), pairs, 2),
             r"tp_argmax_pick: argument token has shape \[2\], but its axis 0 must be 1"),
            (lambda: tp_place(dop.empty([2048], stream=stream).partition([1024]), logits, 0, 15),
             r"tp_place<n=15>: argument src has shape \[16\], but its axis 0 is n: 15 from the scalar argument n, "
             r"16 here; pass n=16 \(src\.shape\[0\]\)"),
            (lambda: tp_place(dop.empty([2048], stream=stream).partition([512]), logits, 0, 16).generics([1024]),
             r"tp_place<B=1024>: partition out with \[1024\], not \[512\]")):
        with pytest.raises(dop.ShapeError, match=match):
            launch().sync_on(stream)
    out = dop.empty([2048], stream=stream)
    tp_place(out.partition([1024]), logits, 100, 16).sync_on(stream)  # B inferred from out's tile
    expect = np.zeros(2048, np.float32)
    expect[100:116] = logits.numpy(stream=stream)
    np.testing.assert_array_equal(out.numpy(stream=stream), expect)


@pytest.mark.parametrize("changes,tp,message", [
    ({}, 3, "the 4 KV heads do not split evenly"),
    ({"vocab_size": 1001}, 2, "the vocabulary of 1001 does not split evenly"),
    ({"intermediate_size": 512}, 4, "the intermediate size 512 must split into multiples of 256"),
    ({}, 0, "the tensor-parallel size is a positive int"),
])
def test_a_split_the_kernels_cannot_serve_is_refused_before_any_process_group(model, changes, tp, message):
    from dataclasses import replace
    with pytest.raises(dop.ShapeError, match=message):
        Llama(replace(CFG, **changes), model["weights"], capacity=CAP, tp=tp)


def test_a_shard_s_rank_is_an_int_of_the_group_and_numpy_integers_are_ints():
    for bad in (1.0, None, True, "1", 2, -1):  # 1.0 cut float rows (a raw TypeError at slicing), None raised one
        with pytest.raises(dop.ShapeError, match=f"rank {bad!r} is outside a tensor-parallel group of 2: pass an int"):
            Shard(CFG, bad, 2)
    shard = Shard(CFG, np.int64(1), np.int32(2))
    assert (shard.rank, shard.size, shard.rows(8)) == (1, 2, (4, 8))
    assert all(type(v) is int for v in (shard.rank, shard.size, *shard.rows(8)))


def test_ranks_that_ask_for_different_generations_all_refuse_before_launching(model):
    def rank(group):
        llama = Llama(CFG, model["weights"], capacity=CAP, group=group)
        with pytest.raises(dop.StateError, match="the ranks disagree on the request"):
            llama.generate(model["prompt"], 4 + group.rank)
        return int(llama.decoder.state.numpy(stream=llama.cuda_stream)[3])  # nothing generated
    assert dist.run_reference(2, rank) == [0, 0]


def test_the_tp_kernels_compile_for_sm90():
    for k in (tp_argmax_pair, tp_argmax_pick):
        program, _ = k.compile((), arch="sm_90")
        assert program.cubin[:4] == b"\x7fELF"


def test_closing_a_tensor_parallel_model_frees_its_private_buffers_and_refuses_later_calls(model):
    def rank(group):
        with Llama(CFG, model["weights"], capacity=CAP, group=group) as llama:
            fused = llama.decoder.fused
            assert llama.generate(model["prompt"], NEW) == model["greedy"]
        assert fused._closed  # the projections' peer buffers, closed on every rank
        with pytest.raises(dop.StateError, match="closed"):
            llama.generate(model["prompt"], NEW)
        llama.close()  # idempotent
        return True
    assert dist.run_reference(2, rank) == [True, True]
