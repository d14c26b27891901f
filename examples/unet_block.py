"""Seed 000: a U-Net-style block, captured once as a CUDA graph and replayed in an inference loop.

    h1 = SiLU(GroupNorm(conv3x3(x)))           # kernels/conv.py: 2 launches
    h2 = SiLU(GroupNorm(conv3x3(h1)))          # 2 launches
    out = x + h2                               # the residual: 1 launch

N=1, C=320, 64x64, fp16 NHWC, G=32 by default on a GPU; N=1, C=32, 16x16,
G=8 on the reference device (NumPy), which then prints no timings.  Warm-up runs the block
eagerly (compiles and loads every kernel), then ``graph_on`` captures its 5
launches and each step copies a new input in and replays.  The output is
checked against PyTorch (fp32, from the same fp16 inputs) when torch is
present, else against float64 NumPy.

    python examples/unet_block.py [--c 320] [--hw 64] [--steps 50]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import deviceop as dop  # noqa: E402
from deviceop.kernels.conv import ConvGnAct, add_f16, conv_gn_act_reference  # noqa: E402
from token_model import HelpFormatter, positive  # noqa: E402

# (N, C, HW, G, steps): the block's size on a GPU, and on the reference device (NumPy: seconds, not minutes)
GPU_SIZE, REFERENCE_SIZE = (1, 320, 64, 32, 50), (1, 32, 16, 8, 5)


class UNetBlock:
    """Weights, the two fused conv plans and the activations of one block."""

    def __init__(self, n, c, hw, groups, stream, seed=0):
        rng = np.random.default_rng(seed)
        self.shape = (n, hw, hw, c)
        self.groups = groups
        host = lambda *s, scale=1.0, shift=0.0, dt=np.float16: (shift + scale * rng.standard_normal(s)).astype(dt)  # noqa: E731
        self.host = [(host(c, 3, 3, c, scale=1 / np.sqrt(9 * c)), host(c, scale=0.1),
                      host(c, scale=0.1, shift=1.0, dt=np.float32), host(c, scale=0.1, dt=np.float32))
                     for _ in range(2)]                                   # (w KRSC, bias, gamma, beta) x 2
        self.weights = [[dop.from_numpy(a, stream=stream) for a in layer] for layer in self.host]
        self.plans = [ConvGnAct(n, hw, hw, c, c, groups=groups, act="silu", stream=stream) for _ in range(2)]
        self.x = dop.from_numpy(rng.standard_normal(self.shape).astype(np.float16), stream=stream)  # the input buffer
        self.h1, self.h2, self.out = (dop.empty(list(self.shape), "float16", stream=stream) for _ in range(3))

    def forward_op(self):
        """The block as one lazy op (5 launches); its value is the output tensor."""
        size = self.out.size
        flat = lambda t: t.view([size])  # noqa: E731
        return dop.zip_(
            self.plans[0](self.h1, self.x, *self.weights[0]),
            self.plans[1](self.h2, self.h1, *self.weights[1]),
            add_f16(flat(self.out).partition([2048]), flat(self.x), flat(self.h2)),
        ).map(lambda _: self.out)

    def reference(self, x):
        """The block in fp32 (torch, on the GPU) or float64 (NumPy), from the same fp16 inputs."""
        try:
            import torch
            import torch.nn.functional as F
            if not torch.cuda.is_available():
                raise ImportError
        except ImportError:
            h = x
            for w, b, g, be in self.host:
                h = conv_gn_act_reference(h, w, b, g, be, self.groups, 1e-5, "silu")
                h = h.astype(np.float16)          # the activations between layers are fp16
            return x.astype(np.float64) + h.astype(np.float64), "float64 NumPy"
        h = torch.from_numpy(x).cuda().float().permute(0, 3, 1, 2)
        for w, b, g, be in self.host:
            t = lambda a: torch.from_numpy(a).cuda().float()  # noqa: E731
            h = F.silu(F.group_norm(F.conv2d(h, t(w).permute(0, 3, 1, 2), t(b), padding=1), self.groups,
                                    t(g), t(be), 1e-5)).half().float()
        out = torch.from_numpy(x).cuda().float().permute(0, 3, 1, 2) + h
        return out.permute(0, 2, 3, 1).cpu().double().numpy(), "torch fp32"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    on = lambda i: f"(default: {GPU_SIZE[i]} on a GPU, {REFERENCE_SIZE[i]} on the reference device)"  # noqa: E731
    ap.add_argument("--n", type=positive, default=None, help=f"batch {on(0)}")
    ap.add_argument("--c", type=positive, default=None, help=f"channels in and out, a multiple of 8 {on(1)}")
    ap.add_argument("--hw", type=positive, default=None, help=f"height and width {on(2)}")
    ap.add_argument("--groups", type=positive, default=None, help=f"GroupNorm groups, dividing --c {on(3)}")
    ap.add_argument("--steps", type=positive, default=None, help=f"graph replays timed {on(4)}")
    args = ap.parse_args()
    device = dop.Device(0)
    small = device.is_reference
    n, c, hw, groups, steps = (v if v is not None else d for v, d in
                               zip((args.n, args.c, args.hw, args.groups, args.steps),
                                   REFERENCE_SIZE if small else GPU_SIZE))
    stream = device.new_stream()
    try:   # the flags first: the conv plan checks the shape before any data is made
        ConvGnAct(n, hw, hw, c, c, groups=groups, act="silu", stream=stream)
    except dop.DeviceOpError as e:
        ap.error(f"--n {n} --c {c} --hw {hw} --groups {groups}: {e}")
    where = "the reference device (no GPU: NumPy; a small block, no timings)" if small else device.name
    print(f"U-Net block N={n} C={c} {hw}x{hw} G={groups}, fp16 NHWC, on {where}")
    block = UNetBlock(n, c, hw, groups, stream)
    print(f"plan: {block.plans[0]}")

    block.forward_op().sync_on(stream)                 # warm-up: compile, load, run once eagerly
    graph = block.forward_op().graph_on(stream)        # capture the 5 launches
    model = dop.GraphModel(graph, block.x, block.out)
    print(f"captured: {graph.summary()['nodes']} kernel nodes")

    rng = np.random.default_rng(1)
    inputs = [dop.from_numpy(rng.standard_normal(block.shape).astype(np.float16), stream=stream) for _ in range(2)]
    stream.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):                             # the inference loop: copy in, replay
        model.forward_async(inputs[i % 2])
    stream.synchronize()
    us = (time.perf_counter() - t0) / steps * 1e6

    worst = 0.0
    for i, inp in enumerate(inputs, 1):                # each input's output, against the reference
        got = model.forward(inp).numpy().astype(np.float64)
        ref, what = block.reference(inp.numpy())
        err, rel = float(np.abs(got - ref).max()), float(np.sqrt(np.mean((got - ref) ** 2) / np.mean(ref ** 2)))
        worst = max(worst, err)
        print(f"input {i} of {len(inputs)}, graph output vs {what}: max abs error {err:.2e}, relative RMS {rel:.2e}")
        if not (err <= 1e-2 and rel <= 1e-3):
            print("FAILED: the block's output does not match the reference (max abs 1e-2, relative RMS 1e-3)")
            return 1
    if not small:   # the reference device runs NumPy: its timings say nothing about a GPU
        print(f"{steps} graph replays: {us:.1f} us per step (copy in + replay, host-timed)")
    print(f"ok: U-Net block output matches (max abs error {worst:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
