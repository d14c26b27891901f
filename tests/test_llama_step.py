"""The generation loop's control step (kernels/llama_step.cu): the prompt is fed
token by token, then each sample is appended, and the loop stops on EOS, on
max_new or at the cache's capacity, decided on the device."""
import numpy as np
import pytest

import deviceop as dop
from deviceop.kernel import In, Kernel, Out
from deviceop.kernels.llama_step import llama_step, llama_step_start

# A stand-in for the model: sampled = (7 * cur + pos) % 50, read from the loop state.
_FAKE = r'''
extern "C" __global__ void fake_model(int* sampled, const int* state) {
    sampled[0] = (7 * state[2] + state[0]) % 50;
}'''
fake_model = Kernel("fake_model", _FAKE, [Out("sampled", "int32", rank=1), In("state", "int32", rank=1)],
                    block=1, reference=lambda g, s, st: s.__setitem__(0, (7 * int(st[2]) + int(st[0])) % 50))


def expected(prompt, max_new, eos, cap):
    tokens, out = list(prompt), []
    pos = 0
    while True:
        s = (7 * tokens[pos] + pos) % 50
        nxt = pos + 1
        if nxt >= cap:
            break
        if nxt >= len(prompt):
            tokens.append(s)
            out.append(s)
            if s in eos or len(out) >= max_new:
                break
        pos = nxt
    return out


def generate(stream, prompt, max_new, eos, cap, captured):
    tokens = np.zeros(cap, np.int32)
    tokens[:len(prompt)] = prompt
    tok = dop.from_numpy(tokens, stream=stream)
    state = dop.from_numpy(np.zeros(4, np.int32), stream=stream)
    sampled = dop.from_numpy(np.zeros(1, np.int32), stream=stream)
    eos_t = dop.from_numpy(np.array(list(eos) or [0], np.int32), stream=stream)
    cond = state.view([4])[1:2]

    def body():
        return dop.zip_(fake_model(sampled.partition([1]), state),
                        llama_step(tok.partition([cap]), state, sampled, eos_t, len(eos), len(prompt), max_new, cap))

    op = dop.zip_(llama_step_start(state.partition([4]), tok), dop.while_(cond, body))
    if captured:
        op.graph_on(stream).replay()
    else:
        op.sync_on(stream)
    stream.synchronize()
    st = state.numpy(stream=stream)
    return list(tok.numpy(stream=stream)[len(prompt):len(prompt) + st[3]]), st


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("prompt,max_new,eos", [([3, 1, 4], 6, ()), ([5], 9, (2,)), ([9, 9, 8, 1, 2], 3, (41, 7))])
def test_the_loop_feeds_the_prompt_then_appends_until_a_stop(stream, captured, prompt, max_new, eos):
    cap = 32
    got, state = generate(stream, prompt, max_new, eos, cap, captured)
    assert got == expected(prompt, max_new, eos, cap)
    assert state[1] == 0  # the loop ended by its own decision


def test_a_prompt_and_max_new_past_the_capacity_is_refused_before_any_launch(stream):
    tok = dop.from_numpy(np.zeros(8, np.int32), stream=stream)
    state, one = (dop.from_numpy(np.zeros(n, np.int32), stream=stream) for n in (4, 1))
    with pytest.raises(dop.ShapeError, match="must fit the capacity 8"):
        llama_step(tok.partition([8]), state, one, one, 0, 5, 4, 8).sync_on(stream)


def test_the_step_kernels_compile_for_sm90():
    for k in (llama_step, llama_step_start):
        program, _ = k.compile((), arch="sm_90")
        assert program.cubin[:4] == b"\x7fELF"
