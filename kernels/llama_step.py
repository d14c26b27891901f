"""The control kernels of a generation loop (kernels/llama_step.cu).

* ``llama_step(tokens [cap] tile [cap], state int32 [4], sampled int32 [1], eos int32 [n], n_eos,
  prompt_len, max_new, cap)``: ends an iteration (see the .cu file); writes ``state``
  = [pos, cond, cur, generated] and ``tokens[pos + 1]`` once generating.
* ``llama_step_start(state [4] tile [4], tokens [cap])``: state = [0, 1, tokens[0], 0].
"""
from pathlib import Path

from deviceop.kernel import In, InOut, Kernel, Out, Scalar

from ._checks import _need

HERE = Path(__file__).resolve().parent



def _step_ref(g, tokens, state, sampled, eos, n_eos, prompt_len, max_new, cap):
    pos = int(state[0])
    nxt, generated = pos + 1, int(state[3])
    stop = nxt >= cap
    if not stop and nxt >= prompt_len:
        s = int(sampled[0])
        tokens[nxt] = s
        generated += 1
        stop = s in [int(e) for e in eos[:n_eos]] or generated >= max_new
    state[3] = generated
    if stop:
        state[1] = 0
        return
    state[0], state[2] = nxt, tokens[nxt]


def _step_check(g, tokens, state, sampled, eos, n_eos, prompt_len, max_new, cap):
    _need(0 <= n_eos <= eos.shape[0], f"llama_step: n_eos={n_eos} but eos holds {eos.shape[0]} ids")
    _need(1 <= prompt_len and max_new >= 1 and prompt_len + max_new <= cap,
          f"llama_step: a prompt of {prompt_len} and {max_new} new tokens must fit the capacity {cap}")


def _start_ref(g, state, tokens):
    state[:] = [0, 1, tokens[0], 0]


llama_step = Kernel(  # one thread: tokens is partitioned whole, [cap]
    "llama_step", HERE / "llama_step.cu",
    [Out("tokens", "int32", shape=("cap",), tile=("cap",)), InOut("state", "int32", shape=(4,)),
     In("sampled", "int32", shape=(1,)), In("eos", "int32", rank=1), Scalar("n_eos", "int32"),
     Scalar("prompt_len", "int32"), Scalar("max_new", "int32"), Scalar("cap", "int32")],
    block=1, reference=_step_ref, validate=_step_check)

llama_step_start = Kernel(  # one thread
    "llama_step_start", HERE / "llama_step.cu",
    [Out("state", "int32", shape=(4,), tile=(4,)), In("tokens", "int32", rank=1)],
    block=1, reference=_start_ref)

__all__ = ["llama_step", "llama_step_start"]
