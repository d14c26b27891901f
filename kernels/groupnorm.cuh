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
// follow from the geometry and are recomputed by GroupPartials (below).  The
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

// Sum of x over the 8 lanes of a group (lane & 7) in a fixed xor tree: float addition
// commutes, so every lane gets the same bits, run after run.  The whole warp calls it.
__device__ __forceinline__ float sum8(float x) {
    #pragma unroll
    for (int o = 1; o < 8; o <<= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// The partial statistics of group g of image n (stats: per conv CTA (mt, nt, ks) a
// [2 segments][GS] block of float2 (mean, M2); only ks = KS - 1 is read), shared by
// the group's 8 lanes (sub = lane & 7): lane sub owns entries sub, sub + 8, ...
//
// Built before the conv's results may be read: where each entry lies and how many
// values it summarizes follow from the geometry alone, so that integer arithmetic
// overlaps the conv.  load() then issues the lane's first kOwn loads at once, and
// merge() pools them with their counts known: for entries i of counts n_i,
// mean = sum(n_i mean_i) / n and M2 = sum(M2_i + n_i (mean_i - mean)^2) -- Chan's
// parallel-variance merge in its pooled form, a sum of non-negative terms (no
// cancellation).  A lane pools its entries kOwn at a time (a chunk's loads all in
// flight; chunks merge pairwise, Chan), then the 8 lanes pool their results in
// sum8's fixed tree, so the result is deterministic and every lane of the group
// holds it.  Measured on the H100 against a lane-by-lane Chan merge whose addresses
// were worked out after the wait: see docs/conv.md.  The whole warp calls load()
// and merge(); lanes of a group with valid == false contribute nothing.
struct GroupPartials {
    static constexpr int kOwn = 2;   // entries a lane loads at once (and keeps addressed before the wait)
    const float2* st;
    int n, g, hw, cpg, tm, tn, ntiles, ks, gs, sub;
    int t_first, j_first, parts, entries;
    float inv_count;                 // 1 / the group's count (H*W * cpg)
    int at[kOwn];                    // offsets from st
    float cnt[kOwn];                 // 0 where the lane has no such entry
    float2 v[kOwn];

    __device__ __forceinline__ GroupPartials(const float2* st_, int n_, int g_, bool valid, int HW, int cpg_, int TM,
                                             int TN, int NTILES, int KS, int GS, int sub_)
        : st(st_), n(n_), g(g_), hw(HW), cpg(cpg_), tm(TM), tn(TN), ntiles(NTILES), ks(KS), gs(GS), sub(sub_) {
        t_first = (n * hw) / tm;
        j_first = (g * cpg) / tn;
        parts = ((g + 1) * cpg - 1) / tn - j_first + 1;
        entries = valid ? ((n * hw + hw - 1) / tm - t_first + 1) * parts : 0;
        inv_count = 1.f / ((float)hw * (float)cpg);
        address(sub, at, cnt);
    }
    // entries e0, e0 + 8, ... (kOwn of them): where they lie and how many values each
    // summarizes (its rows x the group's channels in its n-tile); count 0 past the end
    __device__ __forceinline__ void address(int e0, int* p, float* c) const {
        #pragma unroll
        for (int i = 0; i < kOwn; ++i) {
            const int e = e0 + 8 * i;
            p[i] = 0;
            c[i] = 0.f;
            if (e < entries) {
                const int t = t_first + e / parts, j = j_first + e % parts;
                const int rows = min((t + 1) * tm, (n + 1) * hw) - max(t * tm, n * hw);
                const int sg = (n * hw > t * tm) ? 1 : 0;   // image n starts inside tile t: the tile's 2nd segment
                const int chans = min((g + 1) * cpg, (j + 1) * tn) - max(g * cpg, j * tn);
                p[i] = ((t * ntiles + j) * ks + (ks - 1)) * 2 * gs + sg * gs + (g - (j * tn) / cpg);
                c[i] = (float)rows * (float)chans;
            }
        }
    }
    __device__ __forceinline__ void fetch(const int* p, const float* c, float2* u) const {   // L2 only: the conv's
        #pragma unroll
        for (int i = 0; i < kOwn; ++i) u[i] = c[i] > 0.f ? __ldcg(st + p[i]) : make_float2(0.f, 0.f);
    }
    __device__ __forceinline__ void load() { fetch(at, cnt, v); }   // after the conv
    // kOwn entries pooled: (count, mean, M2)
    __device__ __forceinline__ static void pool(const float2* u, const float* c, float& cn, float& mean, float& m2) {
        float s = 0.f;
        cn = 0.f;
        #pragma unroll
        for (int i = 0; i < kOwn; ++i) { cn += c[i]; s += c[i] * u[i].x; }
        mean = cn > 0.f ? __fdividef(s, cn) : 0.f;
        m2 = 0.f;
        #pragma unroll
        for (int i = 0; i < kOwn; ++i) { const float d = u[i].x - mean; m2 += u[i].y + c[i] * d * d; }
    }
    __device__ __forceinline__ void merge(float& mean, float& m2) const {
        float cl, ml, m2l;   // this lane's entries
        pool(v, cnt, cl, ml, m2l);
        for (int e0 = sub + 8 * kOwn; e0 < entries; e0 += 8 * kOwn) {   // lanes of more than kOwn entries
            int p[kOwn]; float c[kOwn]; float2 u[kOwn];
            address(e0, p, c);
            fetch(p, c, u);
            float cb, mb, m2b;
            pool(u, c, cb, mb, m2b);
            chan_merge(cl, ml, m2l, cb, mb, m2b);
        }
        mean = sum8(cl * ml) * inv_count;   // the group's count is known: H*W * cpg
        const float d = ml - mean;
        m2 = sum8(m2l + cl * d * d);
    }
};
