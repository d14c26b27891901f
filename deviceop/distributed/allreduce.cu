// One-shot all-reduce for small messages over peer memory (deviceop/distributed/peer.py).
//
// Push model, NCCL's "LL" line format: each 16-byte line carries 8 payload bytes and
// the call's epoch twice, {d0, epoch, d1, epoch}, written with one 16-byte volatile
// store; 8-byte stores are single-copy atomic, so a reader that sees the epoch in both
// halves has both data words, without a fence or a separate flag.  Every rank stores
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
#include <cuda_bf16.h>

#include <deviceop/pdl.cuh>  // pdl_wait, pdl_launch_dependents: no-ops without PDL

namespace oneshot {

constexpr int LINES = 64;  // lines per block = threads per block; 512 payload bytes

__device__ __forceinline__ void store_line(uint4* p, unsigned d0, unsigned d1, unsigned e) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};"
                 :: "l"(p), "r"(d0), "r"(e), "r"(d1), "r"(e) : "memory");
}

__device__ __forceinline__ uint4 load_line(const uint4* p) {
    uint4 v;
    asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ unsigned load_volatile(const unsigned* p) {
    return *reinterpret_cast<const volatile unsigned*>(p);
}

// 8 payload bytes <-> floats: 2 fp32 or 4 bf16 values
template <typename T> struct Lane;
template <> struct Lane<float> {
    static constexpr int N = 2;
    static __device__ __forceinline__ void unpack(uint2 v, float* f) {
        f[0] = __uint_as_float(v.x); f[1] = __uint_as_float(v.y);
    }
    static __device__ __forceinline__ uint2 pack(const float* f) {
        return make_uint2(__float_as_uint(f[0]), __float_as_uint(f[1]));
    }
    static __device__ __forceinline__ uint2 nan() { return make_uint2(0x7fc00000u, 0x7fc00000u); }
};
template <> struct Lane<__nv_bfloat16> {
    static constexpr int N = 4;
    static __device__ __forceinline__ float lo(unsigned w) { return __uint_as_float(w << 16); }
    static __device__ __forceinline__ float hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
    static __device__ __forceinline__ void unpack(uint2 v, float* f) {
        f[0] = lo(v.x); f[1] = hi(v.x); f[2] = lo(v.y); f[3] = hi(v.y);
    }
    static __device__ __forceinline__ unsigned two(float a, float b) {  // round to nearest even, as NumPy
        __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
        return *reinterpret_cast<unsigned*>(&h);
    }
    static __device__ __forceinline__ uint2 pack(const float* f) {
        return make_uint2(two(f[0], f[1]), two(f[2], f[3]));
    }
    static __device__ __forceinline__ uint2 nan() { return make_uint2(0x7fc07fc0u, 0x7fc07fc0u); }
};

// MODE 0: out = sum_r x_r;  1: out = out + sum_r x_r;  2: out = residual + sum_r x_r
template <typename T, int W, int MODE>
__device__ __forceinline__ void all_reduce(T* out, const T* x, const T* residual, const unsigned long long* peers,
                                           unsigned* state, int rank, unsigned slot_lines,
                                           unsigned long long timeout_ns) {
    using L = Lane<T>;
    __shared__ unsigned s_epoch;
    pdl_wait();  // x, state and the slots are the previous kernels' to finish with
    const unsigned line = blockIdx.x * LINES + threadIdx.x;
    if (threadIdx.x == 0) {
        unsigned e = state[1 + blockIdx.x] + 1u;
        e = e ? e : 2u;  // never 0 (fresh lines hold 0); after 2^32 calls 2 keeps the parity alternating
        state[1 + blockIdx.x] = e;
        s_epoch = e;
    }
    // Every load that does not need the epoch is issued before the barrier, so its latency
    // overlaps thread 0's read of the epoch instead of following it.
    bool failed = load_volatile(state) != 0u;
    const uint2 mine = reinterpret_cast<const uint2*>(x)[line];
    uint2 base = make_uint2(0u, 0u);
    if (MODE != 0) base = reinterpret_cast<const uint2*>(MODE == 1 ? out : residual)[line];
    unsigned long long dst_base[W];
#pragma unroll
    for (int k = 0; k < W; ++k) dst_base[k] = peers[(rank + k) % W];  // [0]: this rank's own buffer
    __syncthreads();
    const unsigned e = s_epoch;
    const size_t parity_base = (size_t)(e & 1u) * W;
    if (!failed) {
#pragma unroll
        for (int k = 1; k < W; ++k) {  // rank+1 first: the ranks spread their stores over the peers
            uint4* slot = reinterpret_cast<uint4*>(dst_base[k]) + (parity_base + rank) * slot_lines + line;
            store_line(slot, mine.x, mine.y, e);
        }
    }
    pdl_launch_dependents();
    const uint4* own = reinterpret_cast<const uint4*>(dst_base[0]) + parity_base * slot_lines + line;
    const unsigned long long start = now_ns();
    float acc[L::N], v[L::N];
#pragma unroll
    for (int src = 0; src < W; ++src) {
        uint2 data = mine;
        if (src != rank && !failed) {
            const uint4* p = own + (size_t)src * slot_lines;
            uint4 got = load_line(p);
            for (unsigned spin = 1; got.y != e || got.w != e; ++spin) {
                if ((spin & 255u) == 0u) {
                    if (load_volatile(state) != 0u) { failed = true; break; }
                    if (now_ns() - start > timeout_ns) {
                        atomicOr(state, 1u);
                        failed = true;
                        break;
                    }
                }
                got = load_line(p);
            }
            data = make_uint2(got.x, got.z);
        }
        L::unpack(data, v);
#pragma unroll
        for (int i = 0; i < L::N; ++i) acc[i] = src == 0 ? v[i] : acc[i] + v[i];
    }
    uint2* dst = reinterpret_cast<uint2*>(out) + line;
    if (failed) {
        *dst = L::nan();
        return;
    }
    if (MODE != 0) {
        L::unpack(base, v);
#pragma unroll
        for (int i = 0; i < L::N; ++i) acc[i] = v[i] + acc[i];
    }
    *dst = L::pack(acc);
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
