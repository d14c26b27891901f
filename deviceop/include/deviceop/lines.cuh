// The one-shot exchange's line protocol over peer memory, shared by the one-shot
// all-reduce (allreduce.cu) and kernels that fuse it into their epilogue
// (kernels/llama_tp.cu's matvec_allreduce).
//
// NCCL's "LL" line format: each 16-byte line carries 8 payload bytes and the call's
// epoch twice, {d0, epoch, d1, epoch}, written with one 16-byte volatile store;
// 8-byte stores are single-copy atomic, so a reader that sees the epoch in both
// halves has both data words, without a fence or a separate flag.  A receive buffer
// is [parity][source rank][line] of 16-byte lines, slot_lines lines a slot; parity =
// epoch & 1 double-buffers the slots (why that suffices: allreduce.cu).
#pragma once
#include <cuda_bf16.h>

namespace oneshot {

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

// The next epoch of a counter in device memory: never 0 (fresh lines hold 0); after
// 2^32 calls 2 keeps the parity alternating.
__device__ __forceinline__ unsigned next_epoch(unsigned* counter) {
    unsigned e = *counter + 1u;
    e = e ? e : 2u;
    *counter = e;
    return e;
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

// Store this rank's payload of `line` into slot [parity][rank] of every peer's buffer
// (peer rank+1 first: the ranks spread their stores over the peers).  dst[k] is rank
// (rank + k) % W's buffer; dst[0] this rank's own.
template <int W>
__device__ __forceinline__ void push(const unsigned long long (&dst)[W], uint2 mine, unsigned e, int rank,
                                     unsigned slot_lines, size_t line) {
    const size_t parity_base = (size_t)(e & 1u) * W;
#pragma unroll
    for (int k = 1; k < W; ++k) {
        uint4* slot = reinterpret_cast<uint4*>(dst[k]) + (parity_base + rank) * slot_lines + line;
        store_line(slot, mine.x, mine.y, e);
    }
}

// acc = the sum, in fp32 and rank order 0..W-1, of every rank's payload of `line`
// (this rank's is `mine`; the others' are awaited in this rank's own buffer `own`).
// A bounded wait: past timeout_ns, or once another block set the error word state[0],
// it sets that word and returns false (acc is then meaningless).
template <typename T, int W>
__device__ __forceinline__ bool gather_sum(float (&acc)[Lane<T>::N], uint2 mine, unsigned long long own, unsigned e,
                                           int rank, unsigned slot_lines, size_t line, unsigned* state,
                                           unsigned long long timeout_ns) {
    using L = Lane<T>;
    const uint4* mine_slots = reinterpret_cast<const uint4*>(own) + (size_t)(e & 1u) * W * slot_lines + line;
    const unsigned long long start = now_ns();
    float v[L::N];
#pragma unroll
    for (int src = 0; src < W; ++src) {
        uint2 data = mine;
        if (src != rank) {
            const uint4* p = mine_slots + (size_t)src * slot_lines;
            uint4 got = load_line(p);
            for (unsigned spin = 1; got.y != e || got.w != e; ++spin) {
                if ((spin & 255u) == 0u) {
                    if (load_volatile(state) != 0u) return false;
                    if (now_ns() - start > timeout_ns) {
                        atomicOr(state, 1u);
                        return false;
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
    return true;
}

}  // namespace oneshot
