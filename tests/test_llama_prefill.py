"""The chunked prefill (kernels/llama_prefill.cu, examples/llama/prefill.py).

Each kernel is held to float64 math written here (or to the float64 reference
of its one-token counterpart in kernels/llama_proj.py / llama_attn.py), on the
reference device here and on the H100 under scripts/gpu-check (``gpu`` tests,
at the Llama-3.2-1B shapes); the model's chunked generation to token-by-token
ingestion and to the float64 NumPy decoder.

Tolerances (GPU): the projections multiply bf16 weights with fp32 activations
split in two bf16 terms (hi + lo represents x to ~2^-17 relative) on the
tensor cores with fp32 accumulation: outputs within 2e-4 of the output's
largest magnitude (the decode kernels' fp32-dot bound at K = 8192, with room
for the split).  Cached K and V are bf16: one bf16 step (2^-8 relative) plus
that.  Attention (fp32, as attn_decode) within 1e-4 of the output's range.
"""
import dataclasses
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import deviceop as dop

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
from deviceop.kernels import llama_attn as la  # noqa: E402
from deviceop.kernels import llama_prefill as pf  # noqa: E402
from llama.config import LLAMA_3_2_1B, TINY, LlamaConfig  # noqa: E402
from llama.generate import Llama  # noqa: E402
from llama.model import Sampling  # noqa: E402
from llama.reference import ReferenceLlama  # noqa: E402
from llama.weights import random_weights  # noqa: E402

BF16 = ml_dtypes.bfloat16
EPS = 1e-5
LLAMA_1B = dict(d=2048, inter=8192, hq=32, hkv=8, hd=64, vocab=128256)
SMALL = dict(d=256, inter=512, hq=8, hkv=2, hd=64, vocab=1000)
LLAMA_8B = dict(d=4096, inter=14336, hq=32, hkv=8, hd=128, vocab=128256)
SMOLLM2 = dict(d=576, inter=1536, hq=9, hkv=3, hd=64, vocab=49152)   # K = 576: split 2 ways, not 4


def t(a, stream):
    return dop.from_numpy(np.ascontiguousarray(a), stream=stream)


def bf16(rng, *shape, scale=0.02):
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(BF16)


def rel(got, ref) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


def chunk_state(stream, p0, n):
    return t(np.array([p0, n, 1], np.int32), stream)


def rms_rows(x, g):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 * x64, axis=1, keepdims=True) + np.float32(EPS)) * g.astype(np.float64)


def rope_rows(heads, pos, inv_freq):
    """RoPE by complex rotation (x_i + i x_{i+hd/2}) e^{i angle}, the angle Hugging Face's fp32 product."""
    half = heads.shape[1] // 2
    ang = (np.float32(pos) * inv_freq.astype(np.float32)).astype(np.float64)
    z = (heads[:, :half] + 1j * heads[:, half:]) * np.exp(1j * ang)
    return np.concatenate([z.real, z.imag], axis=1)


# -- compiles and plans ------------------------------------------------------------------------------

def shipped(s, chunk):
    return [(pf.pf_embed, pf.embed_plan(s["d"], chunk)[1]),
            (pf.pf_qkv_rope, pf.qkv_plan(s["d"], s["hq"], s["hkv"], s["hd"], chunk)[1]),
            (pf.pf_attn, pf.attn_plan(s["hd"], s["hq"] // s["hkv"], chunk)[1]),
            (pf.pf_matmul_residual, pf.matmul_residual_plan(s["d"], s["hq"] * s["hd"], chunk)[1]),
            (pf.pf_gate_up_silu, pf.gate_up_plan(s["d"], s["inter"], chunk)[1]),
            (pf.pf_matmul_residual, pf.matmul_residual_plan(s["d"], s["inter"], chunk)[1]),
            (pf.prefill_finish, [chunk]), (pf.prefill_start, []), (pf.prefill_step, [])]


# CPU CI compiles the 1B and tiny sets and, of SmolLM2's at T = 64, the projections whose plans a
# K of 576 changes (split 2 ways, more row warps); the full sweep compiles the rest (8B at T = 8...)
CHUNKED = (("llama-3.2-1b", LLAMA_1B, 16, True), ("tiny", SMALL, 16, True), ("tiny", SMALL, 32, True),
           ("llama-3.1-8b", LLAMA_8B, 8, False), ("smollm2", SMOLLM2, 16, False), ("smollm2", SMOLLM2, 64, None))
NEW_PLANS = ("pf_embed", "pf_qkv_rope", "pf_matmul_residual", "pf_gate_up_silu")
COMPILED = [(n, k, g, ci if ci is not None else k.name in NEW_PLANS) for n, s, c, ci in CHUNKED
            for k, g in shipped(s, c)]


@pytest.mark.parametrize("shape,kernel,generics",
                         [pytest.param(n, k, g, marks=[] if ci else [pytest.mark.full_sweep]) for n, k, g, ci in COMPILED],
                         ids=[f"{n}-{k.name}-{'-'.join(map(str, g))}" for n, k, g, _ in COMPILED])
def test_every_shipped_generics_set_compiles_to_an_sm90_cubin(shape, kernel, generics):
    kernel.check_compiled("sm_90", kernel.check_generics(generics))


@pytest.mark.parametrize("chunk,match", [(12, r"T=12 tokens is not supported; T must be one of \(8, 16, 32, 64\)"),
                                         (32, r"pf_qkv_rope: T=32 tokens of KC=2048 columns need \d+ bytes of shared memory, more than the 232448"),
                                         (True, "must be an int")])
def test_a_chunk_the_kernels_cannot_serve_at_the_1b_shape_is_refused(chunk, match):
    s = LLAMA_1B
    with pytest.raises(dop.ShapeError, match=match):
        pf.check_chunk(s["d"], s["inter"], s["hq"], s["hkv"], s["hd"], chunk)
    pf.check_chunk(s["d"], s["inter"], s["hq"], s["hkv"], s["hd"], 16)  # the shipped chunk passes


def test_the_family_shapes_prefill_in_the_chunks_that_fit_and_refuse_the_others():
    for t in pf.CHUNKS:
        pf.check_chunk(SMOLLM2["d"], SMOLLM2["inter"], SMOLLM2["hq"], SMOLLM2["hkv"], SMOLLM2["hd"], t)
    s = LLAMA_8B
    pf.check_chunk(s["d"], s["inter"], s["hq"], s["hkv"], s["hd"], 8)
    with pytest.raises(dop.ShapeError, match=r"pf_qkv_rope: T=16 tokens of KC=4096 columns need \d+ bytes"):
        pf.check_chunk(s["d"], s["inter"], s["hq"], s["hkv"], s["hd"], 16)
    with pytest.raises(dop.ShapeError, match="pf_embed: D=544 must be a positive multiple of 64"):
        pf.check_chunk(544, 1536, 9, 3, 64, 16)


# -- the kernels, one by one -------------------------------------------------------------------------

def test_embed_gathers_the_chunk_zeroes_the_tail_and_flags_a_bad_token(stream, rng):
    vocab, d, T = 50, 256, 8
    embed = bf16(rng, vocab, d, scale=1.0)
    tokens = rng.integers(0, vocab, 20).astype(np.int32)
    tokens[13] = vocab  # outside the vocabulary
    tile, gen = pf.embed_plan(d, T)
    hidden, error = t(np.full((T, d), 7.5, np.float32), stream), t(np.zeros(1, np.int32), stream)

    def run(p0, n):
        pf.pf_embed(hidden.partition(tile), t(embed, stream), t(tokens, stream), chunk_state(stream, p0, n), error,
                    vocab, tokens.size).generics(gen).pdl().sync_on(stream)
        return hidden.numpy(stream=stream), int(error.numpy(stream=stream)[0])

    got, err = run(2, 5)
    np.testing.assert_array_equal(got[:5], embed[tokens[2:7]].astype(np.float32))
    np.testing.assert_array_equal(got[5:], 0.0)
    assert err == 0
    got, err = run(12, 3)  # rows of positions 12, 13 (bad), 14
    assert err == pf.ERR_TOKEN
    np.testing.assert_array_equal(got[[0, 2]], embed[tokens[[12, 14]]].astype(np.float32))
    np.testing.assert_array_equal(got[1], embed[tokens[3]].astype(np.float32))  # the bad row left as it was


class Qkv:
    """Random inputs of pf_qkv_rope with a poisoned two-layer cache; expect() is float64 math."""

    def __init__(self, rng, stream, s=SMALL, T=16, cap=40):
        self.s, self.T, self.cap, self.stream = s, T, cap, stream
        d, hq, hkv, hd = s["d"], s["hq"], s["hkv"], s["hd"]
        self.hidden = rng.standard_normal((T, d), dtype=np.float32)
        self.norm_w = (1 + 0.1 * rng.standard_normal(d)).astype(BF16)
        self.w = bf16(rng, (hq + 2 * hkv) * hd, d)
        self.inv_freq = TINY.inv_freq()
        self.k0, self.v0 = bf16(rng, hkv, cap, hd, scale=1.0), bf16(rng, hkv, cap, hd, scale=1.0)
        self.tile, self.gen = pf.qkv_plan(d, hq, hkv, hd, T)

    def run(self, p0, n):
        s, sh = self.stream, self.s
        kc, vc = t(np.stack([self.k0] * 2), s), t(np.stack([self.v0] * 2), s)
        qkv = dop.empty([self.T, pf.qkv_width(sh["hq"], sh["hkv"], sh["hd"])], stream=s)
        error = t(np.zeros(1, np.int32), s)
        pf.pf_qkv_rope(qkv.partition(self.tile), t(self.hidden, s), t(self.norm_w, s), t(self.w, s),
                       t(self.inv_freq, s), chunk_state(s, p0, n), kc[1], vc[1], error, EPS, self.cap) \
            .generics(self.gen).pdl().sync_on(s)
        return qkv.numpy(stream=s), kc.numpy(stream=s), vc.numpy(stream=s), int(error.numpy(stream=s)[0])

    def expect(self, p0):
        hq, hkv, hd = self.s["hq"], self.s["hkv"], self.s["hd"]
        y = rms_rows(self.hidden, self.norm_w) @ self.w.astype(np.float64).T
        rows = []
        for r in range(self.T):
            q = rope_rows(y[r, : hq * hd].reshape(hq, hd), p0 + r, self.inv_freq)
            k = rope_rows(y[r, hq * hd: (hq + hkv) * hd].reshape(hkv, hd), p0 + r, self.inv_freq)
            rows.append(np.concatenate([q.reshape(-1), k.reshape(-1), y[r, (hq + hkv) * hd:]]))
        return np.stack(rows)


def assert_bf16_close(got, ref):
    got = got.astype(np.float64)
    assert np.all(np.abs(got - ref) <= 2.0 ** -8 * np.abs(ref) + 2e-4 * np.max(np.abs(ref)))


def check_qkv(case, p0, n, layer_rows=None):
    qkv, kc, vc, error = case.run(p0, n)
    ref = case.expect(p0)
    hq, hkv, hd = case.s["hq"], case.s["hkv"], case.s["hd"]
    assert rel(qkv, ref) < 2e-4 and error == 0
    k_ref = ref[:, hq * hd: (hq + hkv) * hd].reshape(case.T, hkv, hd)
    v_ref = ref[:, (hq + hkv) * hd:].reshape(case.T, hkv, hd)
    for r in range(n):
        assert_bf16_close(kc[1][:, p0 + r], k_ref[r])
        assert_bf16_close(vc[1][:, p0 + r], v_ref[r])
    others = [p for p in range(case.cap) if not p0 <= p < p0 + n]
    np.testing.assert_array_equal(kc[1][:, others], case.k0[:, others])  # rows of the chunk's tail untouched
    np.testing.assert_array_equal(vc[1][:, others], case.v0[:, others])
    np.testing.assert_array_equal(kc[0], case.k0)                       # the other layer untouched


@pytest.mark.parametrize("p0,n", [(0, 16), (17, 16), (24, 9), (39, 1)], ids=["first", "full", "partial", "one"])
def test_qkv_rope_appends_the_valid_rows_at_their_positions_and_only_there(stream, rng, p0, n):
    check_qkv(Qkv(rng, stream), p0, n)


def test_qkv_rope_never_writes_past_the_cache(stream, rng):
    case = Qkv(rng, stream)
    qkv, kc, vc, error = case.run(case.cap - 3, 5)  # positions cap-3 .. cap+1
    assert error == pf.ERR_POS
    assert rel(qkv, case.expect(case.cap - 3)) < 2e-4  # every row still computed
    np.testing.assert_array_equal(kc[:, :, : case.cap - 3], np.stack([case.k0] * 2)[:, :, : case.cap - 3])


def test_qkv_rope_refuses_a_chunk_of_the_wrong_size_or_tile(stream, rng):
    case = Qkv(rng, stream, T=8)
    s, sh = stream, case.s
    kc, vc = t(np.stack([case.k0] * 2), s), t(np.stack([case.v0] * 2), s)

    def launch(qkv, tile, gen):
        pf.pf_qkv_rope(qkv.partition(tile), t(case.hidden, s), t(case.norm_w, s), t(case.w, s),
                       t(case.inv_freq, s), chunk_state(s, 0, 8), kc[1], vc[1], t(np.zeros(1, np.int32), s), EPS,
                       case.cap).generics(gen).sync_on(s)

    width = pf.qkv_width(sh["hq"], sh["hkv"], sh["hd"])
    with pytest.raises(dop.ShapeError, match="T=12 tokens is not supported"):
        launch(dop.empty([12, width], stream=s), [12, 32], [*case.gen[:4], 12, *case.gen[5:]])
    with pytest.raises(dop.ShapeError, match=r"partition qkv with \[8, 32\]"):
        launch(dop.empty([8, width], stream=s), [8, 64], case.gen)
    with pytest.raises(dop.ShapeError, match="WR=3 must divide the RT=2 row tiles"):
        launch(dop.empty([8, width], stream=s), case.tile, [*case.gen[:6], 3, *case.gen[7:]])


class Attn:
    def __init__(self, rng, stream, hkv=2, g=4, hd=64, T=16, cap=48):
        self.hkv, self.g, self.hd, self.T, self.cap, self.stream = hkv, g, hd, T, cap, stream
        self.qkv = rng.standard_normal((T, (hkv * g + 2 * hkv) * hd), dtype=np.float32)
        self.k, self.v = bf16(rng, hkv, cap, hd, scale=1.0), bf16(rng, hkv, cap, hd, scale=1.0)
        self.tile, self.gen = pf.attn_plan(hd, g, T)

    def run(self, p0, n):
        s = self.stream
        out = t(np.full((self.T, self.hkv * self.g * self.hd), 3.0, np.float32), s)
        pf.pf_attn(out.partition(self.tile), t(self.qkv, s), t(self.k, s), t(self.v, s), chunk_state(s, p0, n),
                   self.cap).generics(self.gen).pdl().sync_on(s)
        return out.numpy(stream=s)

    def expect(self, r, pos):
        return la.attn_reference(self.qkv[r, : self.hkv * self.g * self.hd], self.k, self.v, pos)


@pytest.mark.parametrize("p0,n", [(0, 16), (20, 11), (47, 1)], ids=["first", "partial", "last-entry"])
def test_attn_query_t_attends_entries_up_to_p0_plus_t(stream, rng, p0, n):
    case = Attn(rng, stream)
    out = case.run(p0, n)
    for r in range(n):
        ref = case.expect(r, p0 + r)
        assert np.max(np.abs(out[r] - ref)) <= 1e-4 * np.max(np.abs(ref))
    np.testing.assert_array_equal(out[n:], 0.0)


def test_attn_position_outside_the_cache_gives_nan(stream, rng):
    case = Attn(rng, stream, T=8)
    out = case.run(case.cap - 2, 4)   # positions cap-2, cap-1 valid; cap, cap+1 not
    assert np.all(np.isfinite(out[:2])) and np.all(np.isnan(out[2:4]))


@pytest.mark.parametrize("n,k", [(256, 512), (512, 256)], ids=["o", "down"])
def test_matmul_residual_vs_float64(stream, rng, n, k):
    T = 16
    x, w, res = rng.standard_normal((T, k), dtype=np.float32), bf16(rng, n, k), rng.standard_normal((T, n),
                                                                                                    dtype=np.float32)
    tile, gen = pf.matmul_residual_plan(n, k, T, kc=256)
    out = dop.empty([T, n], stream=stream)
    pf.pf_matmul_residual(out.partition(tile), t(x, stream), t(w, stream), t(res, stream)).generics(gen).pdl() \
        .sync_on(stream)
    ref = res.astype(np.float64) + x.astype(np.float64) @ w.astype(np.float64).T
    assert rel(out.numpy(stream=stream), ref) < 2e-4


def test_gate_up_silu_vs_float64(stream, rng):
    T, d, inter = 16, 256, 512
    x, g = rng.standard_normal((T, d), dtype=np.float32), (1 + 0.1 * rng.standard_normal(d)).astype(BF16)
    w = bf16(rng, 2 * inter, d)
    tile, gen = pf.gate_up_plan(d, inter, T)
    act = dop.empty([T, inter], stream=stream)
    pf.pf_gate_up_silu(act.partition(tile), t(x, stream), t(g, stream), t(w, stream), EPS).generics(gen).pdl() \
        .sync_on(stream)
    y = rms_rows(x, g) @ w.astype(np.float64).T
    ref = y[:, :inter] / (1.0 + np.exp(-y[:, :inter])) * y[:, inter:]
    assert rel(act.numpy(stream=stream), ref) < 2e-4


def test_matmul_refuses_a_weight_of_the_wrong_width(stream, rng):
    T = 8
    tile, gen = pf.matmul_residual_plan(256, 512, T)
    with pytest.raises(dop.ShapeError, match=r"pf_matmul_residual<K=512>: argument w has shape \[256, 256\], but its axis 1 is K: "
                                             r"512 from \.generics\(\), 256 here; pass a w of shape \[256, 512\]"):
        pf.pf_matmul_residual(dop.empty([T, 256], stream=stream).partition(tile), dop.empty([T, 512], stream=stream),
                              t(bf16(rng, 256, 256), stream), dop.empty([T, 256], stream=stream)) \
            .generics(gen).sync_on(stream)


def test_the_control_walks_the_chunks_and_keeps_the_last(stream):
    chunk = t(np.zeros(3, np.int32), stream)
    pf.prefill_start(chunk.partition([3]), 37, 16).sync_on(stream)
    seen = [tuple(chunk.numpy(stream=stream))]
    while seen[-1][2]:
        pf.prefill_step(chunk.partition([3]), 37, 16).sync_on(stream)
        seen.append(tuple(chunk.numpy(stream=stream)))
    assert seen == [(0, 16, 1), (16, 16, 1), (32, 5, 1), (32, 5, 0)]


# -- the model: chunked prefill against token-by-token ingestion and the float64 decoder -------------

CAP = 64


@pytest.fixture(scope="module")
def weights():
    return random_weights(TINY, seed=11, std=0.1)


@pytest.fixture(scope="module")
def llama(weights):
    return Llama(TINY, weights, capacity=CAP)


def assert_greedy_under_the_reference(weights, prompt, got):
    """Each generated token is the float64 decoder's argmax along the history, or within what
    bf16 resolves of it (2^-7 of the top logit: issue 27's tie criterion; the device caches
    K and V in bf16, the float64 decoder does not)."""
    ref = ReferenceLlama(TINY, weights, CAP)
    history = list(prompt) + list(got)
    for pos in range(len(history) - 1):
        logits = ref.step(history[pos], pos)
        if pos + 1 >= len(prompt):
            assert logits[history[pos + 1]] >= logits.max() - 2.0 ** -7 * abs(logits.max()), pos


@pytest.mark.barrier_loop
@pytest.mark.parametrize("length,chunk", [(37, 16), (16, 16), (1, 16), (20, 8), (9, 32)],
                         ids=["partial-last-chunk", "exactly-one-chunk", "one-token", "chunk-8", "chunk-32"])
def test_chunked_prefill_generates_what_token_by_token_ingestion_does(llama, weights, rng, length, chunk):
    prompt = [int(x) for x in rng.integers(0, TINY.vocab_size, length)]
    by_token = llama.generate(prompt, max_new_tokens=6)
    chunked = llama.generate(prompt, max_new_tokens=6, prefill_chunk=chunk)
    assert chunked == by_token
    assert llama.generate(prompt, max_new_tokens=6, prefill_chunk=chunk, graph=False) == chunked
    assert_greedy_under_the_reference(weights, prompt, chunked)


def test_an_eager_chunked_prefill_generates_and_samples_as_eager_token_by_token(llama, weights, rng):
    """No device loop (racecheck and synccheck run this one: docs/robustness.md, "Sanitizers"):
    the prefill kernels launched eagerly, greedy and sampled."""
    prompt = [int(x) for x in rng.integers(0, TINY.vocab_size, 21)]
    chunked = llama.generate(prompt, max_new_tokens=4, prefill_chunk=16, graph=False)
    assert chunked == llama.generate(prompt, max_new_tokens=4, graph=False)
    assert_greedy_under_the_reference(weights, prompt, chunked)
    s = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=77)
    assert llama.generate(prompt, 4, s, prefill_chunk=8, graph=False) == llama.generate(prompt, 4, s, graph=False)


@pytest.mark.barrier_loop
def test_chunked_prefill_fills_the_cache_and_the_logits_as_token_by_token(llama, rng):
    """Equal up to bf16: where the two paths round a cached entry to neighbouring bf16 values
    (2^-8 apart), the later layers' entries and the logits move by ~2^-8 of their scale."""
    prompt = [int(x) for x in rng.integers(0, TINY.vocab_size, 21)]
    dec = llama.decoder
    llama.generate(prompt, max_new_tokens=1)
    k1, v1, logits1 = (x.numpy(stream=llama.cuda_stream) for x in (dec.k_cache, dec.v_cache, dec.logits))
    llama.generate(prompt, max_new_tokens=1, prefill_chunk=8)
    k2, v2, logits2 = (x.numpy(stream=llama.cuda_stream) for x in (dec.k_cache, dec.v_cache, dec.logits))
    for a, b in ((k1, k2), (v1, v2)):
        a, b = a[:, :, : len(prompt)].astype(np.float64), b[:, :, : len(prompt)].astype(np.float64)
        assert np.all(np.abs(a - b) <= 2.0 ** -7 * np.abs(a) + 2.0 ** -8 * np.max(np.abs(a)))
    assert np.max(np.abs(logits1 - logits2)) <= 2.0 ** -8 * np.max(np.abs(logits1))


@pytest.mark.barrier_loop
def test_sampling_after_a_chunked_prefill_draws_what_token_by_token_does(llama, rng):
    prompt = [int(x) for x in rng.integers(0, TINY.vocab_size, 19)]
    s = Sampling(temperature=0.8, top_k=50, top_p=0.9, seed=77)
    assert llama.generate(prompt, 10, s, prefill_chunk=16) == llama.generate(prompt, 10, s)


@pytest.mark.barrier_loop
def test_the_constructor_setting_is_the_default(weights, rng):
    prompt = [int(x) for x in rng.integers(0, TINY.vocab_size, 11)]
    chunked = Llama(TINY, weights, capacity=CAP, prefill_chunk=8)
    assert chunked.generate(prompt, 5) == chunked.generate(prompt, 5, prefill_chunk=0)  # 0: token by token
    assert (*chunked._key(len(prompt), 5, Sampling()), 8) in chunked._loops


@pytest.mark.parametrize("prompt,chunk,message", [
    ([1, 2, 3], 12, "T=12 tokens is not supported"),
    ([1, 2, 3], 4, "T=4 tokens is not supported"),
    ([1] * 60, 16, "need 65 KV entries; the cache holds 64"),
    ([1, TINY.vocab_size], 16, "outside the vocabulary"),
])
def test_a_request_the_prefill_cannot_serve_is_refused_before_launching(llama, prompt, chunk, message):
    before = dop.op.stats["launches"]
    with pytest.raises(dop.ShapeError, match=message):
        llama.generate(prompt, max_new_tokens=5, prefill_chunk=chunk)
    assert dop.op.stats["launches"] == before


# Rows of 192 and 320 (multiples of 64, not of 128 or 256: SmolLM2's kind), groups of 3: the decode
# kernels end their rows in a partial chunk, the prefill splits K 2 ways.
NARROW = LlamaConfig(hidden_size=192, intermediate_size=320, num_hidden_layers=2, num_attention_heads=3,
                     num_key_value_heads=1, vocab_size=500, head_dim=64, rope_theta=100000.0,
                     tie_word_embeddings=True, bos_token_id=1, eos_token_id=(2,))


@pytest.mark.barrier_loop
@pytest.mark.parametrize("chunk", [pytest.param(16, marks=pytest.mark.full_sweep), 64])
def test_a_narrow_model_prefills_and_decodes_as_the_float64_decoder(rng, chunk):
    weights = random_weights(NARROW, seed=int(rng.integers(1 << 30)), std=0.1)
    llama = Llama(NARROW, weights, capacity=CAP)
    prompt = [int(x) for x in rng.integers(3, NARROW.vocab_size, 17)]
    by_token = llama.generate(prompt, max_new_tokens=4)
    assert llama.generate(prompt, max_new_tokens=4, prefill_chunk=chunk) == by_token
    ref = ReferenceLlama(NARROW, weights, CAP)
    history = prompt + by_token
    for pos in range(len(history) - 1):
        logits = ref.step(history[pos], pos)
        if pos + 1 >= len(prompt):
            assert logits[history[pos + 1]] >= logits.max() - 2.0 ** -7 * abs(logits.max()), pos


# -- the Llama-3.2-1B shapes on the GPU ----------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("p0,n", [(0, 16), (4085, 11)], ids=["first", "partial-at-the-cache-end"])
def test_llama_1b_qkv_rope(stream, rng, p0, n):
    check_qkv(Qkv(rng, stream, s=LLAMA_1B, cap=4096), p0, n)


@pytest.mark.gpu
@pytest.mark.parametrize("p0,n", [(0, 16), (1000, 16), (4090, 6)])
def test_llama_1b_attn(stream, rng, p0, n):
    case = Attn(rng, stream, hkv=8, g=4, hd=64, cap=4096)
    out = case.run(p0, n)
    for r in range(n):
        ref = case.expect(r, p0 + r)
        assert np.max(np.abs(out[r] - ref)) <= 1e-4 * np.max(np.abs(ref))
    np.testing.assert_array_equal(out[n:], 0.0)


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2048, 8192], ids=["o_proj", "down_proj"])
def test_llama_1b_matmul_residual(stream, rng, k):
    T, n = 16, LLAMA_1B["d"]
    x, w = rng.standard_normal((T, k), dtype=np.float32), bf16(rng, n, k)
    res = rng.standard_normal((T, n), dtype=np.float32)
    tile, gen = pf.matmul_residual_plan(n, k, T)
    out = dop.empty([T, n], stream=stream)
    pf.pf_matmul_residual(out.partition(tile), t(x, stream), t(w, stream), t(res, stream)).generics(gen).pdl() \
        .sync_on(stream)
    ref = res.astype(np.float64) + x.astype(np.float64) @ w.astype(np.float64).T
    assert rel(out.numpy(stream=stream), ref) < 2e-4


@pytest.mark.gpu
def test_llama_1b_gate_up_silu(stream, rng):
    T, d, inter = 16, LLAMA_1B["d"], LLAMA_1B["inter"]
    x, g = rng.standard_normal((T, d), dtype=np.float32), (1 + 0.1 * rng.standard_normal(d)).astype(BF16)
    w = bf16(rng, 2 * inter, d)
    tile, gen = pf.gate_up_plan(d, inter, T)
    act = dop.empty([T, inter], stream=stream)
    pf.pf_gate_up_silu(act.partition(tile), t(x, stream), t(g, stream), t(w, stream), EPS).generics(gen).pdl() \
        .sync_on(stream)
    y = rms_rows(x, g) @ w.astype(np.float64).T
    ref = y[:, :inter] / (1.0 + np.exp(-y[:, :inter])) * y[:, inter:]
    assert rel(act.numpy(stream=stream), ref) < 2e-4


@pytest.mark.gpu
def test_llama_1b_embed(stream, rng):
    s, T = LLAMA_1B, 16
    embed = bf16(rng, s["vocab"], s["d"], scale=1.0)
    tokens = rng.integers(0, s["vocab"], 64).astype(np.int32)
    tile, gen = pf.embed_plan(s["d"], T)
    hidden, error = dop.empty([T, s["d"]], stream=stream), t(np.zeros(1, np.int32), stream)
    pf.pf_embed(hidden.partition(tile), t(embed, stream), t(tokens, stream), chunk_state(stream, 40, 13), error,
                s["vocab"], tokens.size).generics(gen).pdl().sync_on(stream)
    got = hidden.numpy(stream=stream)
    np.testing.assert_array_equal(got[:13], embed[tokens[40:53]].astype(np.float32))
    np.testing.assert_array_equal(got[13:], 0.0)
    assert error.numpy(stream=stream)[0] == 0


@pytest.mark.barrier_loop
@pytest.mark.gpu
def test_llama_1b_chunked_generation_matches_token_by_token(rng):
    """The 1B shapes (4 layers, to keep the random checkpoint quick): the first token's logits
    within bf16 tolerance (the two paths may round a cached K/V entry to neighbouring bf16
    values), and greedy tokens equal up to the first step where token-by-token's own top two
    logits are closer than that tolerance."""
    cfg = dataclasses.replace(LLAMA_3_2_1B, num_hidden_layers=4)
    llama = Llama(cfg, random_weights(cfg, seed=3), capacity=512)
    prompt = [int(x) for x in rng.integers(0, cfg.vocab_size, 181)]
    by_token = llama.generate(prompt, 24)
    llama.generate(prompt, 1, prefill_chunk=16)
    first = llama.decoder.logits.numpy(stream=llama.cuda_stream)[: cfg.vocab_size]
    along = llama.logits_along(prompt + by_token, list(range(len(prompt) - 1, len(prompt) + len(by_token) - 1)))
    tol = 1e-2 * float(np.max(np.abs(along[0])))
    assert np.max(np.abs(first - along[0])) <= tol
    chunked = llama.generate(prompt, 24, prefill_chunk=16)
    for i, (a, b) in enumerate(zip(chunked, by_token)):
        if a != b:
            top2 = np.sort(along[i])[-2:]
            assert top2[1] - top2[0] <= tol, (i, a, b)
            break
