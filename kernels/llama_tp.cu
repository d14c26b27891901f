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
