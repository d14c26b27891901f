"""The Llama projection kernels (kernels/llama_proj.cu, declared in kernels/llama_proj.py).

Device-agnostic tests run the NumPy references here and the CUDA kernels on the
H100 (under scripts/gpu-check): each output is held to float64 math written
independently below.  ``gpu``-marked tests run the Llama-3.2-1B shapes.

Tolerances: the weights are the same bf16 numbers on both sides, so only fp32
accumulation and fp32 activations differ from float64: an fp32 dot of K terms
is within ~K * 2^-24 of float64 relative to the sum of |terms| (<= 1.2e-4 for
K = 2048, typically ~1e-6), so fp32 outputs are compared at 1e-4 of the
output's largest magnitude (2e-4 for K = 8192).  The cache holds bf16: the
kernel rounds an fp32 value, the reference a float64 one, so they may differ
by one bf16 step (2^-8 relative) plus the fp32 error.
"""
import math
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import deviceop as dop
from deviceop import api

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from deviceop.kernels import llama_proj as lp  # noqa: E402

BF16 = ml_dtypes.bfloat16
EPS = 1e-5


def t(a, stream):
    return dop.from_numpy(a, stream=stream)


def bf16(rng, *shape, scale=0.02):
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(BF16)


def rel(got, ref) -> float:
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


def rms_normed(x, g):
    """x / rms(x) * g in float64 (x fp32, g bf16)."""
    x64 = x.astype(np.float64)
    return x64 * math.sqrt(x64.size) / np.linalg.norm(x64) * g.astype(np.float64)


def llama3_inv_freq(hd, theta=500000.0, factor=32.0, low=1.0, high=4.0, original=8192):
    """Llama 3's scaled inverse frequencies (float64), as transformers' _compute_llama3_parameters."""
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    wavelen = 2 * math.pi / inv
    low_wl, high_wl = original / low, original / high
    smooth = (original / wavelen - low) / (high - low)
    mid = (1 - smooth) * inv / factor + smooth * inv
    return np.where(wavelen > low_wl, inv / factor, np.where(wavelen < high_wl, inv, mid))


def rope_complex(heads, pos, inv_freq):
    """RoPE by complex rotation: (x_i + i x_{i+hd/2}) * e^{i angle_i}, angle from HF's fp32 product."""
    half = heads.shape[1] // 2
    ang = (np.float32(pos) * inv_freq.astype(np.float32)).astype(np.float64)
    z = (heads[:, :half] + 1j * heads[:, half:]) * np.exp(1j * ang)
    return np.concatenate([z.real, z.imag], axis=1)


# -- compiles --------------------------------------------------------------------------

LLAMA_1B = dict(d=2048, inter=8192, hq=32, hkv=8, hd=64, vocab=128256)
# The family's shapes beyond 1B: 8B's K = 14336 stages x in dynamic shared memory, SmolLM2's
# rows of 576 and 1536 end in a partial chunk.  Both compile in CPU CI; the others in the sweep.
LLAMA_8B = dict(d=4096, inter=14336, hq=32, hkv=8, hd=128, vocab=128256)
SMOLLM2 = dict(d=576, inter=1536, hq=9, hkv=3, hd=64, vocab=49152)
SHAPES = {"llama-3.2-1b": LLAMA_1B, "llama-3.1-8b": LLAMA_8B, "smollm2-135m": SMOLLM2,
          "tinyllama": dict(d=2048, inter=5632, hq=32, hkv=4, hd=64, vocab=32000),
          "llama-3.2-3b": dict(d=3072, inter=8192, hq=24, hkv=8, hd=128, vocab=128256),
          "llama-3.1-70b": dict(d=8192, inter=28672, hq=64, hkv=8, hd=128, vocab=128256)}
# CPU CI compiles every 1B kernel and the family's new code paths: 8B's projections with x in
# dynamic shared memory (down, K = 14336), SmolLM2's partial chunks (K = 576); the sweep the rest
CI = {"llama-3.2-1b": None, "llama-3.1-8b": ("matvec_residual",), "smollm2-135m": ("rms_qkv_rope", "matvec_residual")}


def shipped(s):
    return [(lp.embed_gather, lp.embed_plan(s["d"])[1]),
            (lp.rms_qkv_rope, lp.qkv_plan(s["d"], s["hq"], s["hkv"], s["hd"])[1]),
            (lp.matvec_residual, lp.matvec_residual_plan(s["d"], s["hq"] * s["hd"])[1]),
            (lp.rms_gate_up_silu, lp.gate_up_plan(s["d"], s["inter"])[1]),
            (lp.matvec_residual, lp.matvec_residual_plan(s["d"], s["inter"])[1]),
            (lp.rms_lm_head_argmax, lp.lm_head_plan(s["d"], s["vocab"])[2])]


COMPILED = [(name, k, g) for name, s in SHAPES.items() for k, g in shipped(s)]


@pytest.mark.parametrize("shape,kernel,generics",   # Llama-3.2-1B's by default, the other shapes in the full sweep
                         [pytest.param(*c, marks=[] if c[0] in CI and (CI[c[0]] is None or c[1].name in CI[c[0]])
                                       else [pytest.mark.full_sweep])
                          for c in COMPILED],
                         ids=[f"{n}-{k.name}-{'-'.join(map(str, g))}" for n, k, g in COMPILED])
def test_every_shipped_generics_set_compiles_to_an_sm90_cubin(shape, kernel, generics):
    program, expr = kernel.compile(kernel.check_generics(generics), arch="sm_90")
    assert program.cubin[:4] == b"\x7fELF" and program.symbol(expr).startswith("_Z")


def test_plans_serve_rows_of_any_multiple_of_8_and_refuse_the_rest():
    assert lp.qkv_plan(576, 9, 3, 64, tuned=False)[1][5] == 1  # SmolLM2-135M by the rules: a partial last chunk, CH = 1
    assert lp.matvec_residual_plan(4096, 14336, tuned=False)[1][5] == 4  # 8B down by the rules: 4 slices of 3584
    with pytest.raises(dop.ShapeError, match="K=572 must be a positive multiple of 8"):
        lp.qkv_plan(572, 9, 3, 64)
    with pytest.raises(dop.ShapeError, match="multiple of 8"):
        lp.embed_plan(2047)


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_family_shapes_pass_the_decode_limits(name):
    s = SHAPES[name]
    lp.check_decode_shapes(s["d"], s["inter"], s["hq"], s["hkv"], s["hd"], s["vocab"])


def test_a_k_past_the_shared_memory_a_cta_may_have_is_refused_naming_the_field():
    lp.check_decode_shapes(4096, 57344, 32, 8, 128, 1000)       # x of the down projection: 224 KB, served
    with pytest.raises(dop.ShapeError, match="intermediate_size \\(down\\): matvec_residual: K=65536 needs "
                                             "262.* bytes of shared memory.*227 KB.*largest K served is 5"):
        lp.check_decode_shapes(4096, 65536, 32, 8, 128, 1000)


def test_lm_head_plan_pads_the_vocabulary_to_equal_ctas():
    rpc, rows, gen = lp.lm_head_plan(2048, 128256)
    assert rows % rpc == 0 and 0 <= rows - 128256 < rpc and rows // rpc == lp.H100_SMS
    assert gen[-1] == rpc


# -- embed_gather --------------------------------------------------------------------------

def test_embed_gather_copies_the_row_and_flags_a_bad_token(stream, rng):
    vocab, d = 50, 512
    embed = bf16(rng, vocab, d, scale=1.0)
    tile, gen = lp.embed_plan(d)
    hidden, error = t(np.full(d, 7.5, np.float32), stream), t(np.zeros(1, np.int32), stream)
    for token in (0, 31, vocab - 1):
        tok = t(np.array([token], np.int32), stream)
        lp.embed_gather(hidden.partition([tile]), t(embed, stream), tok, error, vocab).generics(gen).pdl() \
            .sync_on(stream)
        np.testing.assert_array_equal(hidden.numpy(stream=stream), embed[token].astype(np.float32))
    assert error.numpy(stream=stream)[0] == 0
    before = hidden.numpy(stream=stream)
    for bad in (vocab, -1, 1 << 30):
        tok = t(np.array([bad], np.int32), stream)
        lp.embed_gather(hidden.partition([tile]), t(embed, stream), tok, error, vocab).generics(gen).sync_on(stream)
        np.testing.assert_array_equal(hidden.numpy(stream=stream), before)   # nothing written
        assert error.numpy(stream=stream)[0] == lp.ERR_TOKEN


# -- rms_qkv_rope -----------------------------------------------------------------------------

class Qkv:
    """Random inputs of rms_qkv_rope with a poisoned cache; ``run`` launches it, ``expect`` is float64 math."""

    def __init__(self, rng, stream, d=256, hq=4, hkv=2, hd=32, cap=8, ctas=None, **plan):
        self.d, self.hq, self.hkv, self.hd, self.cap, self.stream = d, hq, hkv, hd, cap, stream
        self.hidden = rng.standard_normal(d, dtype=np.float32)
        self.norm_w = (1 + 0.1 * rng.standard_normal(d)).astype(BF16)
        self.w = bf16(rng, (hq + 2 * hkv) * hd, d)
        self.inv_freq = llama3_inv_freq(hd).astype(np.float32)
        self.k0 = bf16(rng, hkv, cap, hd, scale=1.0)   # what was in the cache before
        self.v0 = bf16(rng, hkv, cap, hd, scale=1.0)
        self.tile, self.gen = lp.qkv_plan(d, hq, hkv, hd, ctas=ctas, **plan)

    def run(self, pos, layers=2, layer=1):
        s = self.stream
        kc = t(np.stack([self.k0] * layers), s)   # [L, Hkv, cap, hd]; the kernel gets one layer's slice
        vc = t(np.stack([self.v0] * layers), s)
        q, error = dop.empty([self.hq * self.hd], stream=s), t(np.zeros(1, np.int32), s)
        lp.rms_qkv_rope(q.partition([self.tile]), t(self.hidden, s), t(self.norm_w, s), t(self.w, s),
                        t(self.inv_freq, s), t(np.array([pos], np.int32), s), kc[layer], vc[layer], error, EPS,
                        self.cap).generics(self.gen).pdl().sync_on(s)
        return q.numpy(stream=s), kc.numpy(stream=s), vc.numpy(stream=s), int(error.numpy(stream=s)[0])

    def expect(self, pos):
        hq, hkv, hd = self.hq, self.hkv, self.hd
        y = self.w.astype(np.float64) @ rms_normed(self.hidden, self.norm_w)
        q = rope_complex(y[: hq * hd].reshape(hq, hd), pos, self.inv_freq).reshape(-1)
        k = rope_complex(y[hq * hd: (hq + hkv) * hd].reshape(hkv, hd), pos, self.inv_freq)
        return q, k, y[(hq + hkv) * hd:].reshape(hkv, hd)

    def check(self, pos, layers=1, layer=0):
        """``run`` at ``pos``: q, and k and v appended at ``pos``, against float64; the caches it returns."""
        q, kc, vc, error = self.run(pos, layers=layers, layer=layer)
        q_ref, k_ref, v_ref = self.expect(pos)
        assert rel(q, q_ref) < 1e-4 and error == 0
        assert_bf16_close(kc[layer][:, pos], k_ref)
        assert_bf16_close(vc[layer][:, pos], v_ref)
        return kc, vc


def assert_bf16_close(got, ref):
    got = got.astype(np.float64)
    assert np.all(np.abs(got - ref) <= 2.0 ** -8 * np.abs(ref) + 1e-4 * np.max(np.abs(ref)))


@pytest.mark.parametrize("ctas,plan", [(None, {}), (8, {}), (4, dict(warps=3, nb=3))],
                         ids=["plan", "8-ctas", "warps-take-several-pairs"])
def test_qkv_rope_appends_k_and_v_at_pos_and_only_there(stream, rng, ctas, plan):
    case = Qkv(rng, stream, ctas=ctas, **plan)
    pos = int(rng.integers(1, case.cap - 1))
    kc, vc = case.check(pos, layers=2, layer=1)
    others = [r for r in range(case.cap) if r != pos]
    np.testing.assert_array_equal(kc[1][:, others], case.k0[:, others])   # the other rows untouched
    np.testing.assert_array_equal(vc[1][:, others], case.v0[:, others])
    np.testing.assert_array_equal(kc[0], case.k0)                        # the other layer untouched
    np.testing.assert_array_equal(vc[0], case.v0)


@pytest.mark.parametrize("where", ["cap", "negative"])
def test_qkv_rope_never_writes_past_the_cache(stream, rng, where):
    case = Qkv(rng, stream)
    pos = case.cap if where == "cap" else -1
    q, kc, vc, error = case.run(pos)
    np.testing.assert_array_equal(kc, np.stack([case.k0] * 2))
    np.testing.assert_array_equal(vc, np.stack([case.v0] * 2))
    assert error == lp.ERR_POS
    assert rel(q, case.expect(pos)[0]) < 1e-4   # q is still computed


def test_qkv_rope_refuses_bad_shapes_and_dtypes(stream, rng):
    case = Qkv(rng, stream)
    s = stream
    q = dop.empty([case.hq * case.hd], stream=s)
    kc, vc = t(case.k0, s), t(case.v0, s)
    pos, err = t(np.zeros(1, np.int32), s), t(np.zeros(1, np.int32), s)
    args = [t(case.hidden, s), t(case.norm_w, s), t(case.w, s), t(case.inv_freq, s), pos, kc, vc, err, EPS, case.cap]

    def launch(*a, tile=case.tile, gen=case.gen):
        return lp.rms_qkv_rope(q.partition([tile]), *a).generics(gen).sync_on(s)

    with pytest.raises(dop.ShapeError, match=r"rms_qkv_rope<cap=9>: argument k_cache has shape \[\d+, 8, \d+\], but "
                                             r"its axis 1 is cap: 9 from the scalar argument cap, 8 here; pass cap=8 "
                                             r"\(k_cache\.shape\[1\]\)"):
        launch(*args[:-1], 9)
    with pytest.raises(dop.ShapeError, match=r"argument w_qkv has shape \[\d+, \d+\], but its axis 0 is "
                                             r"\(HQ\+2\*HKV\)\*HD = \(\d+\+2\*\d+\)\*\d+ = \d+ \(HQ, HKV, HD from "
                                             r"\.generics\(\)\), \d+ here; pass a w_qkv of shape"):
        launch(*args[:2], t(case.w[:-2], s), *args[3:])
    odd = Qkv(rng, stream, hq=4, hkv=1)                  # 96 pairs, q of 128
    with pytest.raises(dop.ShapeError, match="128 CTAs, which must divide the 96 RoPE pairs"):
        lp.rms_qkv_rope(q.partition([1]), t(odd.hidden, s), t(odd.norm_w, s), t(odd.w, s), t(odd.inv_freq, s), pos,
                        t(odd.k0, s), t(odd.v0, s), err, EPS, odd.cap).generics(odd.gen).sync_on(s)
    with pytest.raises(dop.DTypeError, match="bfloat16"):
        lp.rms_qkv_rope(q.partition([case.tile]), args[0], t(case.norm_w.astype(np.float32), s), *args[2:])
    with pytest.raises(dop.AliasingError, match="overlap"):
        launch(*args[:5], kc, kc, *args[7:])


# -- matvec_residual ------------------------------------------------------------------------------

def check_matvec_residual(stream, rng, n, k, gen=None, tol=1e-4, **plan):
    """out = residual + w @ x of random bf16 w [n, k] against float64, launched with ``gen``
    (else the plan ``matvec_residual_plan(n, k, **plan)`` makes)."""
    w, x, res = bf16(rng, n, k), rng.standard_normal(k, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    gen = gen or lp.matvec_residual_plan(n, k, **plan)[1]
    out = dop.empty([n], stream=stream)
    lp.matvec_residual(out.partition([gen[4]]), t(x, stream), t(w, stream), t(res, stream)).generics(gen).pdl() \
        .sync_on(stream)   # (gen[4]: the rows a CTA writes)
    ref = res.astype(np.float64) + w.astype(np.float64) @ x.astype(np.float64)
    assert rel(out.numpy(stream=stream), ref) < tol, (n, k)


@pytest.mark.parametrize("n,k,gen", [(64, 512, None), (96, 1024, [1024, 2, 1, 5, 48, 1, 2]),
                                     (32, 2048, [2048, 1, 4, 3, 16, 1, 2]),
                                     (48, 2048, [2048, 2, 2, 6, 24, 2, 3]),   # K in 2 slices, 3 buffers
                                     (32, 4096, [4096, 1, 4, 8, 16, 4, 1]),   # 4 slices, 1 buffer
                                     (40, 1024, [1024, 1, 1, 4, 8, 1, 8]),    # 8 buffers: rows pass the buffers
                                     (64, 576, None),                          # SmolLM2: 72 vectors, CH=1
                                     (24, 520, [520, 2, 1, 4, 12, 1, 2]),      # 65 vectors: one lane in the tail
                                     (16, 1536, [1536, 2, 4, 4, 8, 2, 2]),     # slices of 96 vectors, CH=4
                                     (16, 14336, None),                        # x in 56 KB of dynamic shared memory
                                     (8, 28672, None)],                        # Llama-3.1-70B's down: 112 KB
                         ids=["plan", "nr2-w5", "w3", "ks2-nb3", "ks4-nb1", "nb8", "tail-576", "tail-520",
                              "tail-ks2-ch4", "dynamic-14336", "dynamic-28672"])
def test_matvec_residual_vs_float64(stream, rng, n, k, gen):
    check_matvec_residual(stream, rng, n, k, gen=gen, ctas=4)


def test_matvec_residual_refuses_what_it_cannot_do(stream, rng):
    n, k = 64, 512
    out, x, w = dop.empty([n], stream=stream), dop.empty([k], stream=stream), t(bf16(rng, n, k), stream)
    res = dop.empty([n], stream=stream)
    odd = dop.empty([516], stream=stream)
    with pytest.raises(dop.ShapeError, match="K=516 must be a positive multiple of 8\\*KS=8"):
        lp.matvec_residual(out.partition([8]), odd, t(bf16(rng, n, 516), stream), res) \
            .generics([516, 2, 1, 4, 8, 1, 2]).sync_on(stream)
    with pytest.raises(dop.ShapeError, match="partition out with \\[16\\]"):
        lp.matvec_residual(out.partition([8]), x, w, res).generics([k, 2, 2, 4, 16, 1, 2]).sync_on(stream)
    with pytest.raises(dop.ShapeError, match="K=520 must be a positive multiple of 8\\*KS=16"):
        lp.matvec_residual(out.partition([8]), dop.empty([520], stream=stream), t(bf16(rng, n, 520), stream), res) \
            .generics([520, 1, 2, 4, 8, 2, 2]).sync_on(stream)
    with pytest.raises(dop.ShapeError, match="KS=2 slices must divide the W=3 warps"):
        lp.matvec_residual(out.partition([8]), x, w, res).generics([k, 1, 1, 3, 8, 2, 2]).sync_on(stream)
    with pytest.raises(dop.ShapeError, match="NB\\*NR\\*CH=64"):
        lp.matvec_residual(out.partition([8]), x, w, res).generics([k, 4, 2, 4, 8, 1, 8]).sync_on(stream)
    with pytest.raises(dop.DTypeError, match="bfloat16"):
        lp.matvec_residual(out.partition([8]), x, dop.empty([n, k], stream=stream), res)
    with pytest.raises(dop.AliasingError):
        lp.matvec_residual(out.partition([8]), x, w, out).generics([k, 2, 2, 4, 8, 1, 2]).sync_on(stream)
    with pytest.raises(dop.ShapeError, match="K=65536 needs .* bytes of shared memory.*more than the 227 KB"):
        big = dop.empty([65536], stream=stream)
        lp.matvec_residual(out.partition([8]), big, dop.empty([n, 65536], dop.bfloat16, stream=stream), res) \
            .generics([65536, 2, 4, 4, 8, 1, 2]).sync_on(stream)


# -- rms_gate_up_silu --------------------------------------------------------------------------------

def check_gate_up_silu(stream, rng, d, inter, **plan):
    """act = silu(gate) * up of rms-normed random x against float64 (``gate_up_plan(d, inter, **plan)``)."""
    x, g = rng.standard_normal(d, dtype=np.float32), (1 + 0.1 * rng.standard_normal(d)).astype(BF16)
    w = bf16(rng, 2 * inter, d)
    tile, gen = lp.gate_up_plan(d, inter, **plan)
    act = dop.empty([inter], stream=stream)
    lp.rms_gate_up_silu(act.partition([tile]), t(x, stream), t(g, stream), t(w, stream), EPS).generics(gen).pdl() \
        .sync_on(stream)
    y = w.astype(np.float64) @ rms_normed(x, g)
    gate, up = y[:inter], y[inter:]
    assert rel(act.numpy(stream=stream), gate / (1.0 + np.exp(-gate)) * up) < 1e-4


@pytest.mark.parametrize("inter,d,ctas", [(128, 512, 8), (96, 1024, 3), (96, 576, 4), (24, 12288, 3)],
                         ids=["512", "1024", "tail-576", "dynamic-12288"])
def test_gate_up_silu_vs_float64(stream, rng, inter, d, ctas):
    check_gate_up_silu(stream, rng, d, inter, ctas=ctas)


def test_gate_up_silu_refuses_a_weight_of_the_wrong_height(stream, rng):
    act, x = dop.empty([64], stream=stream), dop.empty([512], stream=stream)
    g, w = t(np.ones(512, BF16), stream), t(bf16(rng, 64, 512), stream)
    with pytest.raises(dop.ShapeError, match=r"rms_gate_up_silu<I=64>: argument w_gate_up has shape \[64, 512\], "
                                             r"but its axis 0 is 2\*I = 2\*64 = 128 \(I from act's shape\), 64 here; "
                                             r"pass a w_gate_up of shape \[128, 512\]"):
        lp.rms_gate_up_silu(act.partition([8]), x, g, w, EPS).generics([512, 2, 8, 8]).sync_on(stream)


# -- rms_lm_head_argmax -----------------------------------------------------------------------------------

class LmHead:
    def __init__(self, rng, stream, d=256, vocab=1000, ctas_per_sm=2, sms=7):
        self.d, self.vocab, self.stream = d, vocab, stream
        self.hidden = rng.standard_normal(d, dtype=np.float32)
        self.norm_w = (1 + 0.1 * rng.standard_normal(d)).astype(BF16)
        self.w = bf16(rng, vocab, d)
        self.tile, self.rows, self.gen = lp.lm_head_plan(d, vocab, sms=sms, ctas_per_sm=ctas_per_sm)
        s = stream
        self.logits = dop.empty([self.rows], stream=s)
        self.token = t(np.full(1, -7, np.int32), s)
        self.work = t(np.zeros(2, np.uint64), s)
        self.error = t(np.zeros(1, np.int32), s)
        self.x = t(self.hidden, s)

    def op(self):
        s = self.stream
        return lp.rms_lm_head_argmax(self.logits.partition([self.tile]), self.x, t(self.norm_w, s), t(self.w, s),
                                     self.token, self.work, self.error, EPS, self.vocab).generics(self.gen).pdl()

    def expect(self, hidden=None):
        return self.w.astype(np.float64) @ rms_normed(self.hidden if hidden is None else hidden, self.norm_w)

    def check(self, hidden=None):
        """After a launch on ``hidden`` (default: the case's): the logits against float64, the
        padded tail -inf, the token their argmax (float64's where its top two are apart), no error."""
        s, ref = self.stream, self.expect(hidden)
        logits = self.logits.numpy(stream=s)
        assert rel(logits[: self.vocab], ref) < 1e-4
        assert np.all(logits[self.vocab:] == -np.inf)
        tok = int(self.token.numpy(stream=s)[0])
        assert tok == int(np.argmax(logits[: self.vocab]))
        top2 = np.sort(ref)[-2:]
        if top2[1] - top2[0] > 1e-4 * np.max(np.abs(ref)):
            assert tok == int(np.argmax(ref))
        np.testing.assert_array_equal(self.work.numpy(stream=s), [0, 0])  # left clean for the next launch
        assert self.error.numpy(stream=s)[0] == 0


def test_lm_head_logits_and_argmax_vs_float64(stream, rng):
    case = LmHead(rng, stream)
    case.op().sync_on(stream)
    assert case.rows > case.vocab   # a padded tail
    case.check()


@pytest.mark.parametrize("d", [256, 576], ids=["256", "tail-576"])
@pytest.mark.parametrize("poison", ["nan-weight", "inf-weight", "nan-hidden"])
def test_lm_head_flags_a_non_finite_logit_in_the_error_word(stream, rng, d, poison):
    case = LmHead(rng, stream, d=d)
    row, col = int(rng.integers(0, case.vocab)), int(rng.integers(0, d))
    if poison == "nan-hidden":
        case.hidden[col] = np.nan
        case.x = t(case.hidden, stream)
    else:
        case.w[row, col] = np.nan if poison == "nan-weight" else np.inf
    case.op().sync_on(stream)
    assert case.error.numpy(stream=stream)[0] == lp.ERR_LOGITS
    logits = case.logits.numpy(stream=stream)[: case.vocab]
    assert not np.isfinite(logits[row]) and 0 <= int(case.token.numpy(stream=stream)[0]) < case.vocab


def test_lm_head_argmax_ties_pick_the_lowest_index(stream, rng):
    case = LmHead(rng, stream)
    xn = rms_normed(case.hidden, case.norm_w)
    strong = (np.sign(xn) * 0.05).astype(BF16)          # a row whose logit beats every random row
    first, same_cta, other_cta = 37, 38, case.vocab - 5  # ties inside one CTA and across CTAs
    for r in (other_cta, same_cta, first):
        case.w[r] = strong
    case.op().sync_on(stream)
    logits = case.logits.numpy(stream=stream)
    assert logits[first] == logits[same_cta] == logits[other_cta] == np.max(logits)
    assert int(case.token.numpy(stream=stream)[0]) == first


def test_lm_head_argmax_graph_replays_reset_the_counter(stream, rng):
    case = LmHead(rng, stream)
    graph = case.op().graph_on(stream)
    hiddens = [rng.standard_normal(case.d, dtype=np.float32) for _ in range(3)]
    hiddens.append(hiddens[0])
    for h in hiddens:                                  # twice in a row, and back to the first input
        graph.update(api.memcpy(case.x, t(h, stream)))
        graph.launch().sync_on(stream)
        case.check(h)


def test_lm_head_refuses_unpadded_or_mismatched_buffers(stream, rng):
    case = LmHead(rng, stream)
    s = stream
    # logits is vocab rows padded to whole tiles: a whole CTA of padding more, or one less, is refused by
    # the declaration's shape (vocab+RPC-1)//RPC*RPC, naming the length that fits
    for rows in (case.rows + case.tile, case.rows - case.tile):
        wrong = dop.empty([rows], stream=s)
        with pytest.raises(dop.ShapeError, match=rf"argument logits has shape \[{rows}\], but its axis 0 is "
                                                 rf"\(vocab\+RPC-1\)//RPC\*RPC = \(1000\+{case.tile}-1\)//"
                                                 rf"{case.tile}\*{case.tile} = {case.rows} .*; pass a logits of "
                                                 rf"shape \[{case.rows}\]"):
            lp.rms_lm_head_argmax(wrong.partition([case.tile]), case.x, t(case.norm_w, s), t(case.w, s),
                                  case.token, case.work, case.error, EPS, case.vocab).generics(case.gen).sync_on(s)
    with pytest.raises(dop.ShapeError, match=r"argument w has shape \[1000, \d+\], but its axis 0 is vocab: 999 "
                                             r"from the scalar argument vocab, 1000 here; pass vocab=1000 \(w\.shape\[0\]\)"):
        lp.rms_lm_head_argmax(case.logits.partition([case.tile]), case.x, t(case.norm_w, s), t(case.w, s),
                              case.token, case.work, case.error, EPS, 999).generics(case.gen).sync_on(s)
    with pytest.raises(dop.DTypeError, match="uint64"):
        lp.rms_lm_head_argmax(case.logits.partition([case.tile]), case.x, t(case.norm_w, s), t(case.w, s),
                              case.token, t(np.zeros(2, np.int64), s), case.error, EPS, case.vocab)
    # token, work and error are InOut: the launch's own aliasing check refuses an overlap of two of them
    with pytest.raises(dop.AliasingError, match=r"rms_lm_head_argmax<.*> writes token and error, which overlap"):
        lp.rms_lm_head_argmax(case.logits.partition([case.tile]), case.x, t(case.norm_w, s), t(case.w, s),
                              case.token, case.work, case.token, EPS, case.vocab).generics(case.gen).sync_on(s)


# -- the Llama-3.2-1B shapes on the GPU ------------------------------------------------------------------------

@pytest.mark.gpu
def test_llama_1b_qkv_rope_at_a_late_position(stream, rng):
    s = LLAMA_1B
    case = Qkv(rng, stream, d=s["d"], hq=s["hq"], hkv=s["hkv"], hd=s["hd"], cap=4096)
    pos = 4000 + int(rng.integers(0, 96))
    kc, vc = case.check(pos)
    others = np.ones(case.cap, bool)
    others[pos] = False
    np.testing.assert_array_equal(kc[0][:, others], case.k0[:, others])


@pytest.mark.gpu
@pytest.mark.parametrize("k", [2048, 8192], ids=["o_proj", "down_proj"])
def test_llama_1b_matvec_residual(stream, rng, k):
    check_matvec_residual(stream, rng, LLAMA_1B["d"], k, tol=1e-4 if k == 2048 else 2e-4)


# The grid, buffer and K-split variants bench/llama_kernels_proj.py times, at the 1B shapes.
MATVEC_VARIANTS = {"o-256-w8": (2048, dict(ctas=256, nr=1, ks=1, warps=8)),
                   "o-128-nr2-w8": (2048, dict(ctas=128, nr=2, ks=1, warps=8)),
                   "o-128-ks2-w16": (2048, dict(ctas=128, nr=1, ks=2, warps=16)),
                   "o-128-w16-nb3": (2048, dict(ctas=128, nr=1, ks=1, warps=16, nb=3)),
                   "down-256-w8": (8192, dict(ctas=256, nr=1, ks=1, warps=8)),
                   "down-256-ks2-nr2-w8": (8192, dict(ctas=256, ks=2, nr=2, warps=8)),
                   "down-128-ks2-nr2-w16": (8192, dict(ctas=128, ks=2, nr=2, warps=16)),
                   "down-128-ks2-nr1-w16-nb3": (8192, dict(ctas=128, ks=2, nr=1, warps=16, nb=3)),
                   "down-128-ks2-nr2-w16-nb3": (8192, dict(ctas=128, ks=2, nr=2, warps=16, nb=3))}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(MATVEC_VARIANTS))
def test_llama_1b_matvec_residual_variants(stream, rng, variant):
    k, plan = MATVEC_VARIANTS[variant]
    check_matvec_residual(stream, rng, LLAMA_1B["d"], k, tol=1e-4 if k == 2048 else 2e-4, **plan)


@pytest.mark.gpu
@pytest.mark.parametrize("plan", [dict(ctas=128), dict(ctas=256, warps=3)], ids=["128", "256-w3"])
def test_llama_1b_qkv_rope_variants(stream, rng, plan):
    s = LLAMA_1B
    Qkv(rng, stream, d=s["d"], hq=s["hq"], hkv=s["hkv"], hd=s["hd"], cap=64, **plan).check(int(rng.integers(0, 64)))


@pytest.mark.gpu
def test_llama_1b_gate_up_silu(stream, rng):
    check_gate_up_silu(stream, rng, LLAMA_1B["d"], LLAMA_1B["inter"])


@pytest.mark.gpu
def test_llama_1b_lm_head_and_argmax_twice_in_a_graph(stream, rng):
    s = LLAMA_1B
    case = LmHead(rng, stream, d=s["d"], vocab=s["vocab"], sms=lp.H100_SMS)
    graph = case.op().graph_on(stream)
    for _ in range(2):
        h = rng.standard_normal(case.d, dtype=np.float32)
        graph.update(api.memcpy(case.x, t(h, stream)))
        graph.launch().sync_on(stream)
        case.check(h)


@pytest.mark.gpu
def test_llama_1b_embed_gather(stream, rng):
    s = LLAMA_1B
    embed = bf16(rng, s["vocab"], s["d"], scale=1.0)
    tile, gen = lp.embed_plan(s["d"])
    hidden, error = dop.empty([s["d"]], stream=stream), t(np.zeros(1, np.int32), stream)
    token = s["vocab"] - 1 - int(rng.integers(0, 1000))
    lp.embed_gather(hidden.partition([tile]), t(embed, stream), t(np.array([token], np.int32), stream), error,
                    s["vocab"]).generics(gen).pdl().sync_on(stream)
    np.testing.assert_array_equal(hidden.numpy(stream=stream), embed[token].astype(np.float32))
    assert error.numpy(stream=stream)[0] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["llama-3.1-8b", "smollm2-135m"])
def test_the_family_shapes_projections_on_the_gpu(stream, rng, name):
    """The shipped plans of 8B (dynamic shared memory for K = 14336, head_dim 128) and SmolLM2
    (rows of 576 and 1536: partial chunks, groups of 3) against float64."""
    s = SHAPES[name]
    d, inter, nq = s["d"], s["inter"], s["hq"] * s["hd"]
    Qkv(rng, stream, d=d, hq=s["hq"], hkv=s["hkv"], hd=s["hd"], cap=64).check(int(rng.integers(0, 64)))
    for k in (nq, inter):              # O and down
        check_matvec_residual(stream, rng, d, k, tol=2e-4)
    check_gate_up_silu(stream, rng, d, inter)
    head = LmHead(rng, stream, d=d, vocab=5003, sms=lp.H100_SMS)
    head.op().sync_on(stream)
    head.check()
