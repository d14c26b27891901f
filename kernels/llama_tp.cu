// The greedy choice across vocabulary shards of a tensor-parallel Llama.
//
// Each rank's rms_lm_head_argmax picks the first largest logit of its own rows; the token
// of the whole vocabulary is the first largest over the ranks' picks, ordered by
// llama::argmax_key (kernels/llama_common.cuh) on the *global* index: the TP=1 kernel's
// rule exactly (the largest logit, NaN counting as largest, the lowest index on ties).
// The picks travel as an all-reduce *sum* of a [P] float32 vector that is zero but for
// each rank's own pair (its logit, its global index as a float): adding zeros is exact in
// any order, so the sum is every rank's pair, and the small-message all-reduce serves it.
//
//   tp_argmax_pair(pairs fp32 [P], logits fp32 [Vp], token int32 [1], rank, offset)
//       pairs = 0 but pairs[2 rank] = logits[token], pairs[2 rank + 1] = offset + token
//   ... all-reduce (sum) of pairs over the ranks
//   tp_argmax_pick(token int32 [1], pairs fp32 [P], n)
//       token = the global index of the largest of the n pairs
//
// PDL-ready: both read what the previous kernels wrote only after griddepcontrol.wait.
#include "llama_common.cuh"
#include <deviceop/lines.cuh>  // the one-shot exchange's line protocol (deviceop/distributed)

using llama::RowStream;

extern "C" __global__ void tp_argmax_pair(float* __restrict__ pairs, const float* __restrict__ logits,
                                          const int* __restrict__ token, int n_pairs, int rank, int offset) {
    llama::pdl_launch_dependents();
    llama::pdl_wait();
    const int t = *token;
    for (int i = threadIdx.x; i < n_pairs; i += blockDim.x) {
        float v = 0.f;
        if (i == 2 * rank) v = logits[t];
        if (i == 2 * rank + 1) v = (float)(offset + t);  // exact: the host checks vocab < 2^24
        pairs[i] = v;
    }
}

extern "C" __global__ void tp_argmax_pick(int* __restrict__ token, const float* __restrict__ pairs, int n) {
    llama::pdl_launch_dependents();
    llama::pdl_wait();
    unsigned long long best = 0ull;
    for (int r = 0; r < n; ++r) {
        const unsigned long long key = llama::argmax_key(pairs[2 * r], (unsigned)pairs[2 * r + 1]);
        best = key > best ? key : best;
    }
    *token = (int)(0xffffffffu - (unsigned)(best & 0xffffffffull));
}

// A rank's logits placed in a vector of the whole vocabulary, zero elsewhere: an all-reduce
// sum of these is the ranks' logits gathered (exact: every sum adds zeros to one value).
//   tp_place(out fp32 [Vp] tile [B], src fp32 [n], offset, n): out[i] = src[i - offset] on the
//   rank's rows [offset, offset + n), 0 elsewhere.  B / 4 threads, 4 elements each.
template <int B>
__global__ void tp_place(float* __restrict__ out, const float* __restrict__ src, int offset, int n) {
    llama::pdl_launch_dependents();
    llama::pdl_wait();
    #pragma unroll
    for (int k = 0; k < 4; ++k) {
        const int i = blockIdx.x * B + k * (B / 4) + threadIdx.x;
        const int j = i - offset;
        out[i] = (j >= 0 && j < n) ? src[j] : 0.f;
    }
}

// -- matvec_allreduce -------------------------------------------------------------
// The O and down projections of a tensor-parallel layer with the all-reduce of their
// partial sums in the epilogue: out fp32 [N] (RPC rows a CTA) = residual + the sum over
// the W ranks of w_r @ x_r, every rank computing the same bits.  The matvec is
// matvec_residual's (kernels/llama_proj.cu); then each CTA exchanges its own RPC rows
// with the same CTA of every peer, as the one-shot all-reduce does a block's lines
// (deviceop/include/deviceop/lines.cuh), while the other CTAs still stream their weights:
// no separate all-reduce launch and no kernel boundary between the product and the sum.
//   peers uint64 [W]: the receive buffers (dist.PeerBuffers), state uint32: [0] the
//   error word, [epoch0 + blockIdx.x] this CTA's epoch; the CTA's rows travel as the
//   RPC/2 lines from line0 + blockIdx.x RPC/2 of each slot.  Every CTA waits for the
//   same CTA of the peers, so the whole grid must be resident at once (the host checks
//   grid <= SMs).  A peer that does not answer within timeout_ns: the error word is
//   set and out is NaN, as the one-shot all-reduce.
template <int K, int NR, int CH, int W, int RPC, int KS, int NB, int WORLD>
__global__ void __launch_bounds__(32 * W, llama::min_ctas(W))
matvec_allreduce(float* __restrict__ out, const float* __restrict__ x, const __nv_bfloat16* __restrict__ w_,
                 const float* __restrict__ residual, const unsigned long long* __restrict__ peers,
                 unsigned* state, int rank, unsigned slot_lines, unsigned line0, unsigned epoch0,
                 unsigned long long timeout_ns) {
    static_assert(RPC % NR == 0 && RPC % 2 == 0, "RPC must be even and a multiple of NR");
    static_assert(KS >= 1 && W % KS == 0 && K % KS == 0, "KS must divide W and K");
    static_assert(RPC / 2 <= 32 * W, "a CTA's lines must not outnumber its threads");
    constexpr int G = RPC / NR, WR = W / KS, KP = K / KS;
    float4 *xlo, *xhi;
    llama::x_stage<K>(xlo, xhi);
    __shared__ float part[KS * RPC];
    __shared__ unsigned s_epoch;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, slice = warp % KS, rw = warp / KS;
    const int groups = rw < G ? (G - rw + WR - 1) / WR : 0;
    const size_t row0 = (size_t)blockIdx.x * RPC;
    const uint4* w = reinterpret_cast<const uint4*>(w_) + slice * (KP / 8);
    auto row_ptr = [&](int k, int r) { return w + (row0 + (size_t)(rw + k * WR) * NR + r) * (K / 8); };
    RowStream<NR, CH, KP, NB> s;
    llama::StageX<K, 32 * W, false> sx;
    llama::pdl_launch_dependents();
    s.prefetch(row_ptr, groups * s.C, lane);
    llama::pdl_wait();
    const int t = threadIdx.x;
    float2 res = make_float2(0.f, 0.f);
    if (t < RPC / 2) res = __ldcg(reinterpret_cast<const float2*>(residual + row0) + t);
    if (t == 0) s_epoch = oneshot::next_epoch(state + epoch0 + blockIdx.x);
    sx.issue(x);
    sx.commit(xlo, xhi, nullptr);
    auto finish = [&](int k, const float (&acc)[NR]) {
        if (lane < NR) {
            float v = acc[0];
            #pragma unroll
            for (int r = 1; r < NR; ++r) v = lane == r ? acc[r] : v;
            part[slice * RPC + (rw + k * WR) * NR + lane] = v;
        }
    };
    s.run(row_ptr, finish, groups * s.C, xlo + slice * (KP / 8), xhi + slice * (KP / 8), lane);
    __syncthreads();
    if (t >= RPC / 2) return;
    float p[2] = {part[2 * t], part[2 * t + 1]};
    #pragma unroll
    for (int j = 1; j < KS; ++j) {
        p[0] += part[j * RPC + 2 * t];
        p[1] += part[j * RPC + 2 * t + 1];
    }
    using L = oneshot::Lane<float>;
    const uint2 mine = L::pack(p);
    const unsigned e = s_epoch;
    const size_t line = line0 + blockIdx.x * (RPC / 2) + t;
    unsigned long long dst[WORLD];
    #pragma unroll
    for (int k = 0; k < WORLD; ++k) dst[k] = peers[(rank + k) % WORLD];
    float acc[2];
    bool ok = oneshot::load_volatile(state) == 0u;
    if (ok) oneshot::push<WORLD>(dst, mine, e, rank, slot_lines, line);
    ok = ok && oneshot::gather_sum<float, WORLD>(acc, mine, dst[0], e, rank, slot_lines, line, state, timeout_ns);
    float2* o = reinterpret_cast<float2*>(out + row0) + t;
    *o = ok ? make_float2(res.x + acc[0], res.y + acc[1]) : make_float2(__int_as_float(0x7fc00000), __int_as_float(0x7fc00000));
}
