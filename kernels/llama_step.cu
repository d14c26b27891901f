// The control step that ends each iteration of a generation loop (one thread).
//
// The token buffer holds the prompt in tokens[0, prompt_len) before the loop;
// the iteration at position pos has just turned tokens[pos] into `sampled`,
// the next token.  This step decides what the next iteration reads:
//
//   next = pos + 1
//   next <  prompt_len: the prompt's own token (the sample is discarded);
//   next >= prompt_len: tokens[next] = sampled, one more generated token.
//
// and whether there is a next iteration: the loop stops (cond = 0) once
// max_new tokens were generated, on a generated token found in eos[0, n_eos),
// or when position next would not fit the KV cache (next >= cap: the host
// refuses such a request before it launches; this keeps a corrupted state
// from ever addressing past the cache).  state = [pos, cond, cur, generated]:
// pos and cur (= tokens[pos]) are what the next iteration's kernels read.
// PDL-ready: everything it reads comes from the previous kernels, so it waits first.

#include <deviceop/pdl.cuh>

extern "C" __global__ void llama_step(int* __restrict__ tokens, int* __restrict__ state,
                                      const int* __restrict__ sampled, const int* __restrict__ eos,
                                      int n_eos, int prompt_len, int max_new, int cap) {
    pdl_wait();
    const int pos = state[0];
    const int next = pos + 1;
    int generated = state[3];
    bool stop = next >= cap;
    if (!stop && next >= prompt_len) {
        const int s = *sampled;
        tokens[next] = s;
        generated += 1;
        for (int i = 0; i < n_eos; ++i) stop |= (s == eos[i]);
        stop |= generated >= max_new;
    }
    state[3] = generated;
    if (stop) {
        state[1] = 0;
        return;
    }
    state[0] = next;
    state[2] = tokens[next];
}

// Before the loop: state = [0, 1, tokens[0], 0].
extern "C" __global__ void llama_step_start(int* __restrict__ state, const int* __restrict__ tokens) {
    pdl_wait();
    state[0] = 0;
    state[1] = 1;
    state[2] = tokens[0];
    state[3] = 0;
}
