// GroupNorm partial statistics of one conv output tile: the step both conv
// kernels share (conv2d_gn.cu, CUTLASS 2.x; conv_wgmma.cu, Hopper WGMMA).
//
// A tile is TM rows (output pixels) x TN channels; it holds rows of at most
// two images (H*W >= TM), so its rows split into two segments at the image
// boundary.  Each kernel first reduces its tile to per-channel (mean, M2) per
// segment in shared memory (`chan`, [2][TN][2] floats); this merges the
// channels of each group, in a fixed order (deterministic), into the CTA's
// slot of the partials: [2 segments][GS groups] of (mean, M2).  The counts
// follow from the geometry and are recomputed by the apply kernel (gn_act.cu).
#pragma once

__device__ __forceinline__ void channels_to_groups(const float* chan, float2* out, int TN, int n0, int K, int cpg,
                                                   int GS, int rows_seg0, int rows_seg1) {
    const int g0 = n0 / cpg;
    for (int e = threadIdx.x; e < 2 * GS; e += blockDim.x) {
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
