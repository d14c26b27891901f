// One-shot all-reduce for small messages over peer memory (deviceop/distributed/peer.py).
//
// Push model, in lines.cuh's line format (NCCL's "LL": 8 payload bytes and the epoch
// twice in each 16-byte line, so that a line is its own flag).  Every rank stores
// its x into slot [parity][its rank] of every peer's receive buffer, then reads the
// W-1 slots of its own buffer as they arrive and reduces in rank order 0..W-1 in
// fp32 (so every rank computes bit-identical results).
//
// Epochs live in device memory, one per block, incremented by the kernel itself:
// graph replays and device loops advance them as eager calls do, so no replay can
// meet a stale line (flashinfer #3053).  Parity double-buffers the slots: a peer can
// write a slot of parity p again only two calls later, which it cannot finish before
// this rank's next call has started, i.e. after this call has read the slot.
// A bounded spin: after timeout_ns the block sets state[0] (the error word the host
// reads), writes NaN, and every later call writes NaN at once until the buffers are
// rebuilt: a missing peer never hangs the GPU.
#include <deviceop/lines.cuh>  // the one-shot exchange's line protocol

#include <deviceop/pdl.cuh>  // pdl_wait, pdl_launch_dependents: no-ops without PDL

namespace oneshot {

constexpr int LINES = 64;  // lines per block = threads per block; 512 payload bytes

// MODE 0: out = sum_r x_r;  1: out = out + sum_r x_r;  2: out = residual + sum_r x_r
template <typename T, int W, int MODE>
__device__ __forceinline__ void all_reduce(T* out, const T* x, const T* residual, const unsigned long long* peers,
                                           unsigned* state, int rank, unsigned slot_lines,
                                           unsigned long long timeout_ns) {
    using L = Lane<T>;
    __shared__ unsigned s_epoch;
    pdl_wait();  // x, state and the slots are the previous kernels' to finish with
    const unsigned line = blockIdx.x * LINES + threadIdx.x;
    if (threadIdx.x == 0) s_epoch = next_epoch(state + 1 + blockIdx.x);
    // Every load that does not need the epoch is issued before the barrier, so its latency
    // overlaps thread 0's read of the epoch instead of following it.
    bool ok = load_volatile(state) == 0u;
    const uint2 mine = reinterpret_cast<const uint2*>(x)[line];
    uint2 base = make_uint2(0u, 0u);
    if (MODE != 0) base = reinterpret_cast<const uint2*>(MODE == 1 ? out : residual)[line];
    unsigned long long dst[W];
#pragma unroll
    for (int k = 0; k < W; ++k) dst[k] = peers[(rank + k) % W];  // [0]: this rank's own buffer
    __syncthreads();
    const unsigned e = s_epoch;
    if (ok) push<W>(dst, mine, e, rank, slot_lines, line);
    pdl_launch_dependents();
    float acc[L::N], v[L::N];
    ok = ok && gather_sum<T, W>(acc, mine, dst[0], e, rank, slot_lines, line, state, timeout_ns);
    uint2* out_line = reinterpret_cast<uint2*>(out) + line;
    if (!ok) {
        *out_line = L::nan();
        return;
    }
    if (MODE != 0) {
        L::unpack(base, v);
#pragma unroll
        for (int i = 0; i < L::N; ++i) acc[i] = v[i] + acc[i];
    }
    *out_line = L::pack(acc);
}

}  // namespace oneshot

// B (the output's tile, 512 bytes of T) is the declaration's: the block is oneshot::LINES threads.
template <typename T, int B, int W, bool ACC>
__global__ void __launch_bounds__(oneshot::LINES) allreduce_oneshot(
        T* out, const T* x, const unsigned long long* peers, unsigned* state, int rank, unsigned slot_lines,
        unsigned long long timeout_ns) {
    oneshot::all_reduce<T, W, ACC ? 1 : 0>(out, x, nullptr, peers, state, rank, slot_lines, timeout_ns);
}

template <typename T, int B, int W>
__global__ void __launch_bounds__(oneshot::LINES) allreduce_oneshot_inplace(
        T* out, const unsigned long long* peers, unsigned* state, int rank, unsigned slot_lines,
        unsigned long long timeout_ns) {
    oneshot::all_reduce<T, W, 0>(out, out, nullptr, peers, state, rank, slot_lines, timeout_ns);
}

template <typename T, int B, int W>
__global__ void __launch_bounds__(oneshot::LINES) allreduce_oneshot_residual(
        T* out, const T* x, const T* residual, const unsigned long long* peers, unsigned* state, int rank,
        unsigned slot_lines, unsigned long long timeout_ns) {
    oneshot::all_reduce<T, W, 2>(out, x, residual, peers, state, rank, slot_lines, timeout_ns);
}
