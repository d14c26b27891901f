// Decode attention with grouped query heads over a bf16 KV cache, split over the
// sequence (flash-decoding), the length read from device memory.
//
// attn_decode<HD, G, S, MINL, LMAX, PREFETCH, RG>(out, q, k, v, pos, ws, counters, cap)
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
//   cap       int32                 the cache capacity (k.shape[1]); S * LMAX >= cap (the declaration checks)
//   out[j*HD + d] = sum_{t<=pos} softmax_t(q_j . k[j/G, t] / sqrt(HD)) * v[j/G, t, d], fp32 math.
//   Dynamic shared memory: 4 * LMAX * HD bytes (a chunk's K and V rows).
//
// pos < 0 or pos >= cap reads no cache entry and writes NaN to the whole output (the host can test
// it): refusing is safer than clamping, which would silently attend to a wrong window.
//
// Sequence split.  The grid is fixed (a graph is captured once and replayed at every position), so
// the chunk length adapts to the device-side length n = pos+1: L = max(MINL, ceil(n/S) rounded up to
// 16) <= LMAX, nch = ceil(n/L) chunks are active; CTAs with s >= nch exit at once.  Each active CTA
// copies its chunk's K and V rows into shared memory (cp.async, all issued at once, one commit group a
// tile), then computes tile by tile as the groups land, for all G query heads of its group (the GQA
// saving): a per-lane online softmax, merged over lanes and warps.  With one chunk (short context) the
// CTA writes the output itself; otherwise it writes its partial (m, l, acc) to ws and the last CTA of
// the head to finish (an atomic counter per head) combines the nch partials and resets the counter.
//
// Lane layout: a CTA has G*RG warps (block 32*G*RG); warp w computes query head w % G over row group
// w / G.  LP = HD/8 lanes share a cache row (16 bytes = 8 bf16 each), so a warp covers 32/LP rows per
// step and the CTA RG*32/LP rows (each seen by the G warps of its group, from shared memory); 4 such
// steps form a tile (64 rows at HD=64, RG=4).
//
// PDL and the PREFETCH contract.  q and cache entry pos come from the immediately preceding kernel (the
// QKV projection), so they are read after griddepcontrol.wait, always.  Without PREFETCH everything is
// read after the wait: with PDL, kernels trigger their dependents at their start, so several kernels of
// a chain may be in flight and nothing but the previous kernel's start is known before the wait.
// PREFETCH=1 is a promise by the caller: pos, and cache entries 0..pos-1 of this layer, were written by
// work that completed before this launch's PDL chain began (an earlier graph launch, an earlier
// iteration of a conditional WHILE node's body graph, or stream-ordered work before the first PDL
// launch), never by a kernel of the chain this launch is part of.  The Llama decode loop keeps it:
// pos is written only by the control step at the end of the previous iteration, and the QKV kernel of
// this step appends entry pos alone.  Then each CTA reads pos, decides its chunk (idle CTAs exit
// before the wait, freeing their SM for the next kernel) and issues its chunk's copies of entries < pos
// before the wait; after it only q and entry pos are read.  Nothing is written before the wait either
// way (the output and ws may still be read by a kernel of the chain).  A caller that cannot keep the
// promise (a chunked prefill appending several entries in the same chain) launches PREFETCH=0.
// Reads of the cache go through L2 (cp.async.cg, ld.cg): the entries were written by other kernels.
//
// Measurements, and what was tried: docs/llama.md ("Kernel measurements").
//
#include <cuda_bf16.h>

#include "llama_common.cuh"

namespace llama_attn {

// NVRTC has no <cmath>: infinity from its bits
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

using llama::pdl_launch_dependents;  // kernels/llama_common.cuh
using llama::pdl_wait;

// 16 bytes global -> shared, asynchronous, through L2 only
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// wait until at most n of this thread's commit groups are pending (n is an immediate in PTX; a larger
// n than 7 waits for more than needed, which is safe)
__device__ __forceinline__ void cp_async_wait(int n) {
    switch (n) {
        case 0: asm volatile("cp.async.wait_group 0;" ::: "memory"); break;
        case 1: asm volatile("cp.async.wait_group 1;" ::: "memory"); break;
        case 2: asm volatile("cp.async.wait_group 2;" ::: "memory"); break;
        case 3: asm volatile("cp.async.wait_group 3;" ::: "memory"); break;
        case 4: asm volatile("cp.async.wait_group 4;" ::: "memory"); break;
        case 5: asm volatile("cp.async.wait_group 5;" ::: "memory"); break;
        case 6: asm volatile("cp.async.wait_group 6;" ::: "memory"); break;
        default: asm volatile("cp.async.wait_group 7;" ::: "memory"); break;
    }
}

// release this CTA's writes (ordered before by a barrier) / acquire the other CTAs', at GPU scope
__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

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

// G*RG warps: warp w serves query head w % G over row group w / G, so a warp's state is one head's
// (8 dims of q and acc a lane) and the CTA has many warps to hide the dependent-latency of a row.
template <int HD, int G, int S, int MINL, int LMAX, int PREFETCH, int RG>
__global__ void __launch_bounds__(32 * G * RG)
attn_decode(float* __restrict__ out, const float* __restrict__ q, const __nv_bfloat16* __restrict__ kc,
            const __nv_bfloat16* __restrict__ vc, const int* __restrict__ pos_p, float* __restrict__ ws,
            int* __restrict__ counters, int cap) {
    using namespace llama_attn;
    static_assert(HD == 64 || HD == 128, "head dim 64 or 128");
    static_assert(G >= 1 && G <= 8, "1 to 8 query heads per KV head");
    static_assert(MINL % 16 == 0 && MINL >= 16, "MINL: a multiple of 16");
    static_assert(LMAX % 16 == 0 && LMAX >= MINL, "LMAX: a multiple of 16, at least MINL");
    static_assert(RG >= 1 && G * RG <= 32, "G*RG warps: at most 32");
    constexpr int NT = 32 * G * RG;      // threads
    constexpr int LP = HD / 8;           // lanes per cache row
    constexpr int PPW = 32 / LP;         // rows per warp step
    constexpr int STEP = RG * PPW;       // rows per CTA step (each row seen by the G warps of its group)
    constexpr int ITER = 4;              // steps per tile
    constexpr int TILE = STEP * ITER;
    constexpr float LOG2E = 1.4426950408889634f;

    extern __shared__ uint4 s_kv[];      // K rows [LMAX][LP], then V rows [LMAX][LP]
    __shared__ float s_acc[RG][G][HD];
    __shared__ float s_m[RG][G], s_l[RG][G];
    __shared__ float s_cm[S * G], s_cl[S * G], s_cw[S * G];
    __shared__ int s_last;
    uint4* const s_k = s_kv;
    uint4* const s_v = s_kv + LMAX * LP;

    const int h = blockIdx.x / S, s = blockIdx.x % S;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int hg = warp % G, rg = warp / G;  // this warp's query head in the group, its row group
    const int dl = lane % LP, pg = lane / LP;
    float* const out_h = out + (size_t)h * G * HD;

    pdl_launch_dependents();  // the next kernel (O projection) may start streaming its weights
    if (!PREFETCH) pdl_wait();

    const int pos = __ldcg(pos_p);
    if (pos < 0 || pos >= cap) {  // refused: no cache entry read, the output poisoned (after the wait)
        if (s == 0) {
            if (PREFETCH) pdl_wait();
            for (int i = tid; i < G * HD; i += NT) out_h[i] = __int_as_float(0x7fc00000);
        }
        return;
    }
    const int n = pos + 1;
    const int L = max(MINL, (((n + S - 1) / S) + 15) & ~15);  // <= LMAX because S * LMAX >= cap
    const int nch = (n + L - 1) / L;
    if (s >= nch) return;  // beyond the length: contributes nothing, touches no counter
    const int c0 = s * L, c1 = min(c0 + L, n);
    const int ntiles = (c1 - c0 + TILE - 1) / TILE;

    // the chunk's rows below pos, one commit group a tile (before the wait under PREFETCH)
    const uint4* kh = reinterpret_cast<const uint4*>(kc + (size_t)h * cap * HD);
    const uint4* vh = reinterpret_cast<const uint4*>(vc + (size_t)h * cap * HD);
    const int pre_end = min(c1, pos);
    for (int t = 0; t < ntiles; ++t) {
        const int r0 = c0 + t * TILE, r1 = min(r0 + TILE, pre_end);
        for (int i = tid; i < (r1 - r0) * LP; i += NT) {
            const size_t gi = (size_t)r0 * LP + i;
            const int si = (r0 - c0) * LP + i;
            cp_async16(s_k + si, kh + gi);
            cp_async16(s_v + si, vh + gi);
        }
        cp_async_commit();
    }
    if (PREFETCH) pdl_wait();
    // entry pos (the last row of the last chunk), appended by the kernel just before this one
    if (c1 == n && tid < 2 * LP) {
        const int i = tid % LP;
        const size_t gi = (size_t)pos * LP + i;
        const int si = (pos - c0) * LP + i;
        if (tid < LP) cp_async16(s_k + si, kh + gi);
        else cp_async16(s_v + si, vh + gi);
    }
    cp_async_commit();

    // this lane's 8 dims of the warp's query head, pre-scaled so that scores are in log2 units
    float qr[8];
    const float qs = rsqrtf((float)HD) * LOG2E;
    {
        const float4* q4 = reinterpret_cast<const float4*>(q + ((size_t)h * G + hg) * HD + dl * 8);
        const float4 a = __ldcg(q4), b = __ldcg(q4 + 1);
        qr[0] = a.x * qs; qr[1] = a.y * qs; qr[2] = a.z * qs; qr[3] = a.w * qs;
        qr[4] = b.x * qs; qr[5] = b.y * qs; qr[6] = b.z * qs; qr[7] = b.w * qs;
    }

    float m = -INFINITY, l = 0.f, acc[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;

    for (int t = 0; t < ntiles; ++t) {
        // tile t's group has landed (the later tiles' and entry pos's may still be in flight; entry
        // pos lies in the last tile)
        cp_async_wait(t + 1 < ntiles ? ntiles - t : 0);
        __syncthreads();
        const int t0 = c0 + t * TILE;
        float sc[ITER];
        uint4 kr[ITER], vr[ITER];
#pragma unroll
        for (int it = 0; it < ITER; ++it) {
            const int p = t0 + (it * RG + rg) * PPW + pg;
            const bool in = p < c1;
            kr[it] = in ? s_k[(p - c0) * LP + dl] : make_uint4(0, 0, 0, 0);
            vr[it] = in ? s_v[(p - c0) * LP + dl] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int it = 0; it < ITER; ++it) {
            float kf[8];
            unpack8(kr[it], kf);
            float d = 0.f;
#pragma unroll
            for (int e = 0; e < 8; ++e) d = fmaf(qr[e], kf[e], d);
#pragma unroll
            for (int o = LP / 2; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
            sc[it] = t0 + (it * RG + rg) * PPW + pg < c1 ? d : -INFINITY;
        }
        float mx = m;
#pragma unroll
        for (int it = 0; it < ITER; ++it) mx = fmaxf(mx, sc[it]);
        if (mx == -INFINITY) continue;  // no row of this lane so far
        const float a = rescale(m, mx);
        l *= a;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] *= a;
        m = mx;
#pragma unroll
        for (int it = 0; it < ITER; ++it) {
            float vf[8];
            unpack8(vr[it], vf);
            const float p = exp2f(sc[it] - m);  // sc = -inf (no row): 0
            l += p;
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[e] = fmaf(p, vf[e], acc[e]);
        }
    }

    // merge the lanes that share dims (LP apart), then the RG warps of each head through shared memory
#pragma unroll
    for (int o = LP; o < 32; o <<= 1) {
        const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
        const float l2 = __shfl_xor_sync(0xffffffffu, l, o);
        const float mn = fmaxf(m, m2);
        const float a = rescale(m, mn), b = rescale(m2, mn);
        l = l * a + l2 * b;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
            const float x2 = __shfl_xor_sync(0xffffffffu, acc[e], o);
            acc[e] = acc[e] * a + x2 * b;
        }
        m = mn;
    }
    if (pg == 0) {
#pragma unroll
        for (int e = 0; e < 8; ++e) s_acc[rg][hg][dl * 8 + e] = acc[e];
        if (dl == 0) { s_m[rg][hg] = m; s_l[rg][hg] = l; }
    }
    __syncthreads();

    const size_t part = (size_t)h * S + s;                // this chunk's partial
    float* const ws_acc = ws;                             // [Hkv][S][G][HD]
    float* const ws_m = ws + (size_t)gridDim.x * G * HD;  // [Hkv][S][G]
    float* const ws_l = ws_m + (size_t)gridDim.x * G;
    for (int i = tid; i < G * HD; i += NT) {
        const int g = i / HD, d = i % HD;
        float mn = -INFINITY;
#pragma unroll
        for (int w = 0; w < RG; ++w) mn = fmaxf(mn, s_m[w][g]);
        float lsum = 0.f, a = 0.f;
#pragma unroll
        for (int w = 0; w < RG; ++w) {
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

    // the last of the head's nch CTAs combines: the barrier orders the CTA's partial before thread 0's
    // release fence and counter increment; the last one's acquire fence, then the barrier, order the
    // other CTAs' partials before its reads
    __syncthreads();
    if (tid == 0) {
        fence_acq_rel_gpu();
        const bool last = atomicAdd(counters + h, 1) == nch - 1;
        if (last) fence_acq_rel_gpu();
        s_last = last;
    }
    __syncthreads();
    if (!s_last) return;

    // every chunk's partial of this thread's outputs is loaded before any is used, together with the
    // maxima and sums: one L2 round trip (a loop of dependent loads cost ~0.5 us a chunk)
    constexpr int ITEMS = (G * HD + NT - 1) / NT;
    constexpr int IU = ITEMS * S <= 64 ? ITEMS : 1;  // outputs in flight at once (registers: IU * S)
    float x[IU][S];
    auto load_x = [&](int i0) {
#pragma unroll
        for (int u = 0; u < IU; ++u) {
            const int i = i0 + u * NT;
#pragma unroll
            for (int c = 0; c < S; ++c)
                x[u][c] = c < nch && i < G * HD ? __ldcg(ws_acc + ((size_t)h * S + c) * G * HD + i) : 0.f;
        }
    };
    load_x(tid);
    for (int i = tid; i < nch * G; i += NT) {
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
    for (int i = tid; i < nch * G; i += NT) s_cw[i] = rescale(s_cm[i], s_m[0][i % G]) * s_l[0][i % G];
    __syncthreads();
    for (int i0 = tid; i0 < G * HD; i0 += NT * IU) {
        if (i0 != tid) load_x(i0);
#pragma unroll
        for (int u = 0; u < IU; ++u) {
            const int i = i0 + u * NT;
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
