// Decode attention with grouped query heads over a bf16 KV cache, split over the
// sequence (flash-decoding), the length read from device memory.
//
// attn_decode<HD, G, S, MINL>(out, q, k, v, pos, ws, counters, cap)
//   out       fp32 [Hq*HD]          written; partitioned in tiles of G*HD/S, so the grid is Hkv*S
//                                   CTAs: CTA (h, s) = blockIdx (h*S + s) handles chunk s of KV head h
//   q         fp32 [Hq*HD]          RoPE'd queries, head j at j*HD; query head j uses KV head j / G
//   k, v      bf16 [Hkv, cap, HD]   the layer's cache slice; entries 0..pos are attended
//   pos       int32 [1]             0-based position of the token being decoded
//   ws        fp32 [>= Hkv*S*G*(HD+2)]   scratch (written): per chunk unnormalised acc [G][HD],
//                                   then the max m (log2 units) and the sum l of every (head, chunk, g)
//   counters  int32 [>= Hkv]        zero before the first launch; each head's combining CTA resets its
//                                   counter to zero, so the buffer stays zero between launches (graph
//                                   replays, every layer sharing it) -- not for concurrent launches
//   cap       int32                 the cache capacity (k.shape[1])
//   out[j*HD + d] = sum_{t<=pos} softmax_t(q_j . k[j/G, t] / sqrt(HD)) * v[j/G, t, d], fp32 math.
//
// pos < 0 or pos >= cap reads nothing and writes NaN to the whole output (the host can test it):
// refusing is safer than clamping, which would silently attend to a wrong window.
//
// Sequence split.  The grid is fixed (a graph is captured once and replayed at every position), so
// the chunk length adapts to the device-side length n = pos+1: L = max(MINL, ceil(n/S) rounded up to
// 16), nch = ceil(n/L) chunks are active; CTAs with s >= nch exit at once.  Each active CTA loads its
// K/V chunk once for all G query heads of its group (the GQA saving), keeps a per-lane online softmax,
// merges its warps, and either writes the output directly (nch == 1: no combine at short context) or
// writes its partial (m, l, acc) to ws; the last CTA of each head to finish (an atomic counter per head)
// combines the nch partials and resets the counter.
//
// Lane layout: LP = HD/8 lanes share a cache row (16 bytes = 8 bf16 each), so a warp covers 32/LP rows
// per step and a CTA of 4 warps 128/LP rows; ITER such steps (64 rows at HD=64) form a tile, whose K and
// V loads are all issued before any is used, and the next tile's are issued before this one is computed.
//
// PDL.  Everything this kernel reads may come from a kernel still running when it starts: q and cache
// entry pos from the immediately preceding QKV kernel, and pos itself from an earlier kernel (the one
// that advances the position).  With PDL every kernel may trigger its dependents at its start, so a
// chain of several kernels can be in flight together: before griddepcontrol.wait, nothing but the
// previous kernel's *start* is known, not even the completion of the kernel that wrote pos.  So the
// length is unknown before the wait, and with it which chunk to prefetch: all reads follow the wait.
// After it every earlier kernel has completed (each one's completion implies its own wait returned).
// Loads go through L2 (ld.cg): the cache entries were written by other kernels, maybe on other SMs.
//
// Measured (H100, bench/llama_kernels_attn.py: a graph of the 16 layers' launches, us per layer, PDL;
// 1B shapes, S=32, MINL=64): pos 32 3.3, pos 160 7.3, pos 1024 8.4, pos 4095 11.3 (741 GB/s, 4.1x the
// KV bytes at the copy rate).  Without PDL 4.3 / 7.9 / 8.9 / 11.7.  MINL 16 or 32 (more CTAs at short
// context) cost 7+ us at pos 32; S=16 is ~equal, S=64 slower (19.4 at 4095).  Before the combine loaded
// all chunks at once, 4095 took 14.1.  What is left is latency, not bandwidth: every CTA waits for q and
// pos, then for its loads, then the combining CTA for the partials (three dependent memory round trips).
#include <cuda_bf16.h>

namespace llama_attn {

// NVRTC has no <cmath>: infinity from its bits
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// exp2(m - m_new), or 0 when m is -inf (nothing seen yet): never -inf - -inf = NaN.
__device__ __forceinline__ float rescale(float m, float m_new) {
    return m == -INFINITY ? 0.f : exp2f(m - m_new);
}

__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 p = __bfloat1622float2(h[i]);
        f[2 * i] = p.x;
        f[2 * i + 1] = p.y;
    }
}

}  // namespace llama_attn

template <int HD, int G, int S, int MINL>
__global__ void __launch_bounds__(128)
attn_decode(float* __restrict__ out, const float* __restrict__ q, const __nv_bfloat16* __restrict__ kc,
            const __nv_bfloat16* __restrict__ vc, const int* __restrict__ pos_p, float* __restrict__ ws,
            int* __restrict__ counters, int cap) {
    using namespace llama_attn;
    static_assert(HD == 64 || HD == 128, "head dim 64 or 128");
    static_assert(G >= 1 && G <= 8, "1 to 8 query heads per KV head");
    static_assert(MINL % 16 == 0 && MINL >= 16, "MINL: a multiple of 16");
    constexpr int NW = 4;                // warps
    constexpr int LP = HD / 8;           // lanes per cache row
    constexpr int PPW = 32 / LP;         // rows per warp step
    constexpr int STEP = NW * PPW;       // rows per CTA step
    constexpr int ITER = G <= 4 ? 4 : 2; // steps per tile (registers: G=8 holds 64 accumulators)
    constexpr int TILE = STEP * ITER;
    constexpr float LOG2E = 1.4426950408889634f;

    __shared__ float s_acc[NW][G][HD];
    __shared__ float s_m[NW][G], s_l[NW][G];
    __shared__ float s_cm[S * G], s_cl[S * G], s_cw[S * G];
    __shared__ int s_last;

    const int h = blockIdx.x / S, s = blockIdx.x % S;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int dl = lane % LP, pg = lane / LP;

    pdl_launch_dependents();  // the next kernel (O projection) may start streaming its weights
    pdl_wait();               // q, pos and the cache are complete from here on (see the header)

    const int pos = __ldcg(pos_p);
    float* const out_h = out + (size_t)h * G * HD;
    if (pos < 0 || pos >= cap) {  // refused: nothing read, the output poisoned
        if (s == 0)
            for (int i = tid; i < G * HD; i += 128) out_h[i] = __int_as_float(0x7fc00000);
        return;
    }
    const int n = pos + 1;
    const int L = max(MINL, (((n + S - 1) / S) + 15) & ~15);
    const int nch = (n + L - 1) / L;
    if (s >= nch) return;  // beyond the length: contributes nothing, touches no counter
    const int c0 = s * L, c1 = min(c0 + L, n);

    // this lane's 8 dims of each of the G query heads, pre-scaled so that scores are in log2 units
    float qr[G][8];
    const float qs = rsqrtf((float)HD) * LOG2E;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float4* q4 = reinterpret_cast<const float4*>(q + ((size_t)h * G + g) * HD + dl * 8);
        const float4 a = __ldcg(q4), b = __ldcg(q4 + 1);
        qr[g][0] = a.x * qs; qr[g][1] = a.y * qs; qr[g][2] = a.z * qs; qr[g][3] = a.w * qs;
        qr[g][4] = b.x * qs; qr[g][5] = b.y * qs; qr[g][6] = b.z * qs; qr[g][7] = b.w * qs;
    }

    const uint4* kh = reinterpret_cast<const uint4*>(kc + (size_t)h * cap * HD) + dl;
    const uint4* vh = reinterpret_cast<const uint4*>(vc + (size_t)h * cap * HD) + dl;
    const int row0 = warp * PPW + pg;  // this lane's row within a step

    float m[G], l[G], acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -INFINITY;
        l[g] = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[g][e] = 0.f;
    }

    uint4 kr[ITER], vr[ITER];
    auto load = [&](int t0, uint4* kd, uint4* vd) {
#pragma unroll
        for (int it = 0; it < ITER; ++it) {
            const int p = t0 + it * STEP + row0;
            if (p < c1) {
                kd[it] = __ldcg(kh + (size_t)p * LP);
                vd[it] = __ldcg(vh + (size_t)p * LP);
            } else {
                kd[it] = make_uint4(0, 0, 0, 0);
                vd[it] = make_uint4(0, 0, 0, 0);
            }
        }
    };
    load(c0, kr, vr);
    for (int t0 = c0; t0 < c1; t0 += TILE) {
        uint4 kn[ITER], vn[ITER];
        if (t0 + TILE < c1) load(t0 + TILE, kn, vn);  // next tile in flight while this one is computed
        float sc[ITER][G];
#pragma unroll
        for (int it = 0; it < ITER; ++it) {
            float kf[8];
            unpack8(kr[it], kf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float d = 0.f;
#pragma unroll
                for (int e = 0; e < 8; ++e) d = fmaf(qr[g][e], kf[e], d);
#pragma unroll
                for (int o = LP / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
                sc[it][g] = (t0 + it * STEP + row0 < c1) ? d : -INFINITY;
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mx = m[g];
#pragma unroll
            for (int it = 0; it < ITER; ++it) mx = fmaxf(mx, sc[it][g]);
            if (mx == -INFINITY) continue;  // no row of this lane so far
            const float a = rescale(m[g], mx);
            l[g] *= a;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[g][e] *= a;
            m[g] = mx;
        }
#pragma unroll
        for (int it = 0; it < ITER; ++it) {
            float vf[8];
            unpack8(vr[it], vf);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float p = m[g] == -INFINITY ? 0.f : exp2f(sc[it][g] - m[g]);
                l[g] += p;
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[g][e] = fmaf(p, vf[e], acc[g][e]);
            }
        }
        if (t0 + TILE < c1) {
#pragma unroll
            for (int it = 0; it < ITER; ++it) { kr[it] = kn[it]; vr[it] = vn[it]; }
        }
    }

    // merge the warp's row groups (lanes LP apart), then the warps through shared memory
#pragma unroll
    for (int o = LP; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float m2 = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float l2 = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float mn = fmaxf(m[g], m2);
            const float a = rescale(m[g], mn), b = rescale(m2, mn);
            l[g] = l[g] * a + l2 * b;
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                const float x2 = __shfl_xor_sync(0xffffffffu, acc[g][e], o);
                acc[g][e] = acc[g][e] * a + x2 * b;
            }
            m[g] = mn;
        }
    }
    if (pg == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
#pragma unroll
            for (int e = 0; e < 8; ++e) s_acc[warp][g][dl * 8 + e] = acc[g][e];
            if (dl == 0) { s_m[warp][g] = m[g]; s_l[warp][g] = l[g]; }
        }
    }
    __syncthreads();

    const size_t part = (size_t)h * S + s;                // this chunk's partial
    float* const ws_acc = ws;                             // [Hkv][S][G][HD]
    float* const ws_m = ws + (size_t)gridDim.x * G * HD;  // [Hkv][S][G]
    float* const ws_l = ws_m + (size_t)gridDim.x * G;
    for (int i = tid; i < G * HD; i += 128) {
        const int g = i / HD, d = i % HD;
        float mn = -INFINITY;
#pragma unroll
        for (int w = 0; w < NW; ++w) mn = fmaxf(mn, s_m[w][g]);
        float lsum = 0.f, a = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float f = rescale(s_m[w][g], mn);
            lsum += s_l[w][g] * f;
            a += s_acc[w][g][d] * f;
        }
        if (nch == 1) {
            out_h[i] = a / lsum;
        } else {
            ws_acc[part * G * HD + i] = a;
            if (d == 0) { ws_m[part * G + g] = mn; ws_l[part * G + g] = lsum; }
        }
    }
    if (nch == 1) return;

    // the last of the head's nch CTAs combines (threadFenceReduction's protocol)
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(counters + h, 1) == nch - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    for (int i = tid; i < nch * G; i += 128) {
        s_cm[i] = __ldcg(ws_m + (size_t)h * S * G + i);
        s_cl[i] = __ldcg(ws_l + (size_t)h * S * G + i);
    }
    __syncthreads();
    if (tid < G) {  // each query head's maximum and normaliser over the chunks
        float mn = -INFINITY, lsum = 0.f;
        for (int c = 0; c < nch; ++c) mn = fmaxf(mn, s_cm[c * G + tid]);
        for (int c = 0; c < nch; ++c) lsum += s_cl[c * G + tid] * rescale(s_cm[c * G + tid], mn);
        s_m[0][tid] = mn;
        s_l[0][tid] = 1.f / lsum;
    }
    __syncthreads();
    for (int i = tid; i < nch * G; i += 128) s_cw[i] = rescale(s_cm[i], s_m[0][i % G]) * s_l[0][i % G];
    __syncthreads();
    // every chunk's partial of this thread's outputs is loaded before any is used: one L2 round trip,
    // not nch of them (a loop of dependent loads cost ~0.5 us a chunk)
    constexpr int ITEMS = (G * HD + 127) / 128;
    constexpr int IU = ITEMS * S <= 128 ? ITEMS : 1;  // outputs in flight at once (registers: IU * S)
    for (int i0 = tid; i0 < G * HD; i0 += 128 * IU) {
        float x[IU][S];
#pragma unroll
        for (int u = 0; u < IU; ++u) {
            const int i = i0 + u * 128;
#pragma unroll
            for (int c = 0; c < S; ++c)
                x[u][c] = c < nch && i < G * HD ? __ldcg(ws_acc + ((size_t)h * S + c) * G * HD + i) : 0.f;
        }
#pragma unroll
        for (int u = 0; u < IU; ++u) {
            const int i = i0 + u * 128;
            if (i >= G * HD) break;
            const int g = i / HD;
            float a = 0.f;
#pragma unroll
            for (int c = 0; c < S; ++c) a = c < nch ? fmaf(x[u][c], s_cw[c * G + g], a) : a;
            out_h[i] = a;
        }
    }
    if (tid == 0) counters[h] = 0;  // ready for the next launch (ordered by the kernel boundary)
}
