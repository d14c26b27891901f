// The greedy choice across vocabulary shards of a tensor-parallel Llama (one thread each).
//
// Each rank's rms_lm_head_argmax picks the first largest logit of its own rows; the token
// of the whole vocabulary is the first largest over the ranks' picks.  Both steps use
// llama::argmax_key (kernels/llama_common.cuh) on the *global* index, so the rule is the
// TP=1 kernel's exactly: the largest logit, NaN counting as largest, the lowest index on ties.
//
//   tp_argmax_key(key u64 [1], logits fp32 [Vp], token int32 [1], offset)
//       key = argmax_key(logits[token], offset + token)   (token: this rank's local argmax)
//   ... all_gather of the ranks' keys -> keys u64 [N] (8 bytes a rank)
//   tp_argmax_pick(token int32 [1], keys u64 [N], n)
//       token = the global index of the largest of keys[0, n)
//
// PDL-ready: both read only what the previous kernels wrote, so they wait first.
#include "llama_common.cuh"

extern "C" __global__ void tp_argmax_key(unsigned long long* __restrict__ key, const float* __restrict__ logits,
                                         const int* __restrict__ token, int offset) {
    llama::pdl_launch_dependents();
    llama::pdl_wait();
    const int t = *token;
    *key = llama::argmax_key(logits[t], (unsigned)(offset + t));
}

extern "C" __global__ void tp_argmax_pick(int* __restrict__ token, const unsigned long long* __restrict__ keys,
                                          int n) {
    llama::pdl_launch_dependents();
    llama::pdl_wait();
    unsigned long long best = keys[0];
    for (int i = 1; i < n; ++i) best = keys[i] > best ? keys[i] : best;
    *token = (int)(0xffffffffu - (unsigned)(best & 0xffffffffull));
}
