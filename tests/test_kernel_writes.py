"""The kernel library declares every buffer its CUDA writes (issue 33): the device's error word,
attention's workspace and counters, the sampler's token and state, the LM head's token and
workspace, the decode state, the conv's output, workspace and counters are ``InOut``, not ``In``.
So the checks that guard a write see them: a read-only import or a shared handle someone else
holds is refused, a buffer written by two parameters (or written and read) is an aliasing
error, a loop body may not write its index through them, and a parallel capture orders two
launches that write the same word.  Each test here passes nothing wrong to the GPU: every
refusal comes before a launch.

Unmarked tests run on ``dop.Device()`` (the reference device here, the H100 under scripts/gpu-check);
the read-only import is host memory, so that test takes the reference device explicitly.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import deviceop as dop
from deviceop import zip_
from deviceop.kernels.llama_attn import attn_decode, attn_plan, attn_ws_size, sample, sample_rows, sample_candidates
from deviceop.kernels.llama_proj import embed_gather, embed_plan
from deviceop.kernels.llama_step import llama_step
from deviceop.testing import ForeignArray

D, VOCAB, CAP = 64, 64, 16       # hidden size, vocabulary, KV capacity: small, every kernel serves them
HKV, G, HD = 1, 2, 64            # one KV head of two query heads


def words(n=1):
    return np.zeros(n, np.int32)


class Case:
    """Fresh random arguments for the kernels under test, on ``device``'s ``stream``."""

    def __init__(self, rng, stream, device=None):
        self.s, self.rng = stream, rng
        self.t = lambda a: dop.from_numpy(a, device=device, stream=stream)  # noqa: E731
        self.embed = self.t(rng.standard_normal((VOCAB, D)).astype(ml_dtypes.bfloat16))
        self.token = self.t(np.array([rng.integers(0, VOCAB)], np.int32))
        self.hidden = dop.empty([D], device=device, stream=stream)
        self.q = self.t(rng.standard_normal(HKV * G * HD).astype(np.float32))
        self.k, self.v = (self.t(rng.standard_normal((HKV, CAP, HD)).astype(ml_dtypes.bfloat16)) for _ in range(2))
        self.pos = self.t(np.array([rng.integers(0, CAP)], np.int32))
        self.attn_tile, self.attn_gen = attn_plan(CAP, HD, G, splits=2)
        self.ws = self.t(np.zeros(attn_ws_size(HKV, HD, G, self.attn_gen[2]), np.float32))
        self.logits = self.t(rng.standard_normal(VOCAB).astype(np.float32))
        self.c = sample_candidates(VOCAB)
        self.part = dop.empty([sample_rows(VOCAB), 2 * self.c + 4], device=device, stream=stream)

    def embed_gather(self, error, token=None, hidden=None):
        tile, gen = embed_plan(D)
        hidden, token = self.hidden if hidden is None else hidden, self.token if token is None else token
        return embed_gather(hidden.partition([tile]), self.embed, token, error, VOCAB).generics(gen)

    def attn(self, counters, ws=None, out=None):
        out = out if out is not None else dop.empty([HKV * G * HD], stream=self.s, device=self.q.device)
        return attn_decode(out.partition([self.attn_tile]), self.q, self.k, self.v, self.pos,
                           self.ws if ws is None else ws, counters, CAP).generics(self.attn_gen)

    def sample(self, token, state):
        step = self.t(words())
        return sample(self.part.partition([1, self.part.shape[1]]), self.logits, token, state, step, VOCAB, 0.7, 0,
                      1.0, int(self.rng.integers(0, 2**32))).generics([self.c])

    def llama_step(self, state, tokens=None):
        tokens = tokens if tokens is not None else self.t(words(CAP))
        return llama_step(tokens.partition([CAP]), state, self.token, self.t(words()), 1, 1, 4, CAP)


# What each kernel writes besides its first output, and a launch that passes ``word`` there.
WRITTEN_WORDS = {
    "embed_gather's error word": (lambda c, word: c.embed_gather(word), "embed_gather writes error", 1),
    "attn_decode's counters": (lambda c, word: c.attn(word), "attn_decode writes counters", HKV),
    "sample's state": (lambda c, word: c.sample(c.t(words()), word), "sample writes state", 1),
    "sample's token": (lambda c, word: c.sample(word, c.t(words())), "sample writes token", 1),
    "llama_step's state": (lambda c, word: c.llama_step(word), "llama_step writes state", 4),
}


@pytest.mark.parametrize("which", WRITTEN_WORDS)
def test_a_read_only_import_is_refused_where_a_kernel_writes(rng, which):
    """Declared ``In``, the word was accepted and the kernel wrote another framework's read-only memory."""
    device = dop.ReferenceDevice(0)
    case = Case(rng, device.new_stream(), device)
    make, what, n = WRITTEN_WORDS[which]
    host = rng.integers(0, 8, n).astype(np.int32)
    frozen = host.copy()
    frozen.flags.writeable = False
    word = dop.from_dlpack(ForeignArray(frozen), device=device)
    with pytest.raises(dop.OwnershipError, match=rf"{what}.*read-only.*api\.dup"):
        make(case, word)
    np.testing.assert_array_equal(frozen, host)
    make(case, dop.api.dup(word).sync_on(case.s)).sync_on(case.s)  # the fix the error names: a copy of our own


@pytest.mark.parametrize("which", WRITTEN_WORDS)
def test_a_shared_word_someone_else_still_holds_is_not_written(stream, rng, which):
    case = Case(rng, stream)
    make, what, n = WRITTEN_WORDS[which]
    word = dop.from_numpy(words(n), stream=stream).into_shared()
    other = word.clone()
    with pytest.raises(dop.OwnershipError, match=rf"{what}.*1 other live SharedTensor"):
        make(case, word)
    other.release()
    make(case, word).sync_on(stream)  # held alone: written


def test_a_buffer_written_twice_or_written_and_read_is_an_aliasing_error(stream, rng):
    case = Case(rng, stream)
    one = dop.from_numpy(words(), stream=stream)
    with pytest.raises(dop.AliasingError, match=r"sample<\d+> writes token and state, which overlap"):
        case.sample(one, one).sync_on(stream)
    tokens = dop.from_numpy(words(CAP), stream=stream)
    with pytest.raises(dop.AliasingError, match="llama_step writes tokens and state, which overlap"):
        case.llama_step(tokens[:4], tokens).sync_on(stream)
    big = dop.empty([case.ws.shape[0]], stream=stream)  # attention's output inside its own workspace
    with pytest.raises(dop.AliasingError, match=r"attn_decode<.*> writes out and ws, which overlap"):
        case.attn(dop.from_numpy(words(HKV), stream=stream), ws=big, out=big[:HKV * G * HD]).sync_on(stream)
    with pytest.raises(dop.AliasingError, match=r"embed_gather<\d+> writes error and reads token from overlapping"):
        case.embed_gather(one, token=one).sync_on(stream)  # the error word is the token it reads


def test_a_loop_body_may_not_write_the_loop_index_through_an_in_out_word(stream, rng):
    case = Case(rng, stream)
    index = dop.from_numpy(words(), stream=stream)
    with pytest.raises(dop.OwnershipError, match=r"loop\(2\)'s body writes its index \(embed_gather"):
        dop.loop(2, index, lambda i: case.embed_gather(i)).sync_on(stream)
    error = dop.from_numpy(words(), stream=stream)
    dop.loop(2, index, lambda i: case.embed_gather(error)).sync_on(stream)  # its own word: fine
    assert int(index.numpy(stream=stream)[0]) == 2


@pytest.mark.parametrize("shared", ["attention's ws and counters", "the error word"])
def test_a_parallel_capture_orders_launches_that_write_the_same_word(stream, rng, shared):
    """Declared ``In``, two launches sharing only these words shared no written buffer: the
    parallel capture made them parallel branches, racing on the words."""
    case = Case(rng, stream)
    if shared == "the error word":
        error = dop.from_numpy(words(), stream=stream)
        hidden = [dop.empty([D], stream=stream) for _ in range(2)]
        ops = lambda: zip_(*[case.embed_gather(error, hidden=h) for h in hidden])  # noqa: E731
    else:
        counters = dop.from_numpy(words(HKV), stream=stream)
        outs = [dop.empty([HKV * G * HD], stream=stream) for _ in range(2)]
        ops = lambda: zip_(*[case.attn(counters, out=o) for o in outs])  # noqa: E731
    graph = ops().graph_on(stream, parallel=True)
    assert [n["type"] for n in graph.nodes()] == ["KERNEL"] * 2
    assert graph.edges() == [(0, 1)]  # the second follows the first: they write the same words
    graph.replay()
    stream.synchronize()


def test_a_parallel_capture_orders_one_shot_all_reduces_over_the_same_peer_buffers(rng):
    """The one-shot all-reduce advances its buffers' epochs and error word (``state``, InOut):
    two all-reduces of independent tensors over one PeerBuffers are ordered, as its protocol
    needs (declared ``In``, they were parallel branches sharing the receive slots)."""
    import deviceop.distributed as dist
    from deviceop.distributed.peer import PeerBuffers
    n = 256
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]

    def rank(group):
        s = group.stream
        with PeerBuffers(group, max_bytes=2048) as bufs:
            ins = [dop.from_numpy(x, stream=s) for x in xs]
            outs = [dop.empty(n, stream=s) for _ in xs]
            graph = zip_(*[bufs.all_reduce(x, o) for x, o in zip(ins, outs)]).graph_on(s, parallel=True)
            graph.replay(s)
            bufs.check()
            return graph.edges(), [o.numpy(stream=s) for o in outs]

    (edges, got), = dist.run_reference(1, rank)
    assert edges == [(0, 1)]
    for g, x in zip(got, xs):
        np.testing.assert_array_equal(g, x)  # one rank: the sum is its own vector
