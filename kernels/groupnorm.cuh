// GroupNorm pieces shared by the conv kernels (conv2d_gn.cu, CUTLASS 2.x;
// conv_wgmma.cu, Hopper WGMMA) and the apply kernel (gn_act.cu): the
// activations, the partial statistics of a tile, their merge per group.
#pragma once

#include <cuda_fp16.h>

// 8 consecutive floats -> 8 elements of an fp16 or fp32 tensor (16-byte stores)
__device__ __forceinline__ void store8(__half* p, const float* f) {
    uint4 v;
    __half2* h = reinterpret_cast<__half2*>(&v);
    #pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    *reinterpret_cast<uint4*>(p) = v;
}
__device__ __forceinline__ void store8(float* p, const float* f) {
    reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}


enum { ACT_IDENTITY = 0, ACT_SILU = 1, ACT_MISH = 2 };

template <int ACT>
__device__ __forceinline__ float activation(float v) {
    if (ACT == ACT_SILU) return __fdividef(v, 1.f + __expf(-v));   // v -> -inf: v / inf = 0, the limit
    if (ACT == ACT_MISH) {
        // mish(v) = v tanh(softplus(v)) = v n / (n + 2), n = e^v (e^v + 2): exact, one exp
        if (v > 20.f) return v;
        const float e = __expf(v), n = e * (e + 2.f);
        return v * __fdividef(n, n + 2.f);
    }
    return v;
}

// f = f * scale + shift for 8 consecutive channels (scale, shift 16-byte aligned).
// float4 loads: threads a vector of 8 channels apart reading scalars would hit the
// same shared-memory banks 8 ways.
__device__ __forceinline__ void affine8(float* f, const float* scale, const float* shift) {
    const float4 s0 = reinterpret_cast<const float4*>(scale)[0], s1 = reinterpret_cast<const float4*>(scale)[1];
    const float4 h0 = reinterpret_cast<const float4*>(shift)[0], h1 = reinterpret_cast<const float4*>(shift)[1];
    f[0] = f[0] * s0.x + h0.x; f[1] = f[1] * s0.y + h0.y; f[2] = f[2] * s0.z + h0.z; f[3] = f[3] * s0.w + h0.w;
    f[4] = f[4] * s1.x + h1.x; f[5] = f[5] * s1.y + h1.y; f[6] = f[6] * s1.z + h1.z; f[7] = f[7] * s1.w + h1.w;
}

// f = act(f * scale + shift) for 8 consecutive channels
template <int ACT>
__device__ __forceinline__ void normalize8(float* f, const float* scale, const float* shift) {
    affine8(f, scale, shift);
    #pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = activation<ACT>(f[k]);
}

// A tile is TM rows (output pixels) x TN channels; it holds rows of at most
// two images (H*W >= TM), so its rows split into two segments at the image
// boundary.  Each kernel first reduces its tile to per-channel (mean, M2) per
// segment in shared memory (`chan`, [2][TN][2] floats); this merges the
// channels of each group, in a fixed order (deterministic), into the CTA's
// slot of the partials: [2 segments][GS groups] of (mean, M2).  The counts
// follow from the geometry and are recomputed by merge_group (below).  The
// first `threads` threads of the CTA share the work.
__device__ __forceinline__ void channels_to_groups(const float* chan, float2* out, int TN, int n0, int K, int cpg,
                                                   int GS, int rows_seg0, int rows_seg1, int threads) {
    const int g0 = n0 / cpg;
    for (int e = threadIdx.x; e < 2 * GS; e += threads) {
        const int sg = e / GS, g = g0 + e % GS;
        const int rows = sg == 0 ? rows_seg0 : rows_seg1;
        const int ca = max(g * cpg, n0), cb = min(min((g + 1) * cpg, n0 + TN), K);
        float mean = 0.f, m2 = 0.f;
        if (rows > 0 && cb > ca) {
            // Every channel here has the same count (the segment's rows), so the
            // merge has a closed form: mean = the channels' mean of means, M2 =
            // sum of M2s + rows * sum of (channel mean - mean)^2.  Two short
            // passes in a fixed order, no division chain (Chan's pairwise merge
            // gives the same in exact arithmetic).
            const float* ch = chan + sg * TN * 2;   // this segment's channels, from n0
            float s = 0.f;
            for (int c = ca - n0; c < cb - n0; ++c) s += ch[c * 2];
            mean = s / (float)(cb - ca);
            float d2 = 0.f;
            for (int c = ca - n0; c < cb - n0; ++c) {
                const float d = ch[c * 2] - mean;
                d2 += d * d;
                m2 += ch[c * 2 + 1];
            }
            m2 += (float)rows * d2;
        }
        out[e] = make_float2(mean, m2);
    }
}

// Merge (cb, mb, m2b) into (cnt, mean, m2): Chan et al.
__device__ __forceinline__ void chan_merge(float& cnt, float& mean, float& m2, float cb, float mb, float m2b) {
    const float nn = cnt + cb;
    if (nn > 0.f) {
        const float d = mb - mean, r = __fdividef(cb, nn);
        mean += d * r;
        m2 += m2b + d * d * (cnt * r);
    }
    cnt = nn;
}

// Group g of image n over every conv tile's partials (stats: per conv CTA (mt, nt,
// ks) a [2 segments][GS] block of float2 (mean, M2); only ks = KS - 1 is read):
// (count, mean, M2).  8 lanes (sub = lane & 7) share the entries, then merge in a
// fixed xor tree, so the result is deterministic and every one of the 8 lanes
// holds it.  The whole warp must call it (the shuffles use every lane); lanes of
// a group with valid == false contribute nothing.
__device__ __forceinline__ void merge_group(const float2* st, int n, int g, bool valid, int HW, int cpg, int TM,
                                            int TN, int NTILES, int KS, int GS, int sub, float& cnt, float& mean,
                                            float& m2) {
    cnt = 0.f; mean = 0.f; m2 = 0.f;
    if (valid) {
        const int t_first = (n * HW) / TM, t_last = (n * HW + HW - 1) / TM;
        const int j_first = (g * cpg) / TN, j_last = ((g + 1) * cpg - 1) / TN;
        const int parts = j_last - j_first + 1, entries = (t_last - t_first + 1) * parts;
        #pragma unroll 4
        for (int e = sub; e < entries; e += 8) {
            const int t = t_first + e / parts, j = j_first + e % parts;
            const int rows = min((t + 1) * TM, (n + 1) * HW) - max(t * TM, n * HW);
            const int sg = (n * HW > t * TM) ? 1 : 0;   // image n starts inside tile t: the tile's 2nd segment
            const int chans = min((g + 1) * cpg, (j + 1) * TN) - max(g * cpg, j * TN);
            const float2 v = __ldcg(st + (((size_t)t * NTILES + j) * KS + (KS - 1)) * 2 * GS + sg * GS + (g - (j * TN) / cpg));
            chan_merge(cnt, mean, m2, (float)rows * (float)chans, v.x, v.y);
        }
    }
    #pragma unroll
    for (int o = 1; o < 8; o <<= 1) {    // a fixed tree within the 8 lanes; the lower lane's side is "a"
        const float cb = __shfl_xor_sync(0xffffffffu, cnt, o);
        const float mb = __shfl_xor_sync(0xffffffffu, mean, o);
        const float m2b = __shfl_xor_sync(0xffffffffu, m2, o);
        if (sub & o) {
            float c2 = cb, me2 = mb, mm2 = m2b;
            chan_merge(c2, me2, mm2, cnt, mean, m2);
            cnt = c2; mean = me2; m2 = mm2;
        } else {
            chan_merge(cnt, mean, m2, cb, mb, m2b);
        }
    }
}
