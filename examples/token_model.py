"""The tutorial's model (seed 001), built with DeviceOp combinators.

A stack of layers, each RMSNorm -> Q matvec -> O matvec -> residual add, the
hidden state flowing through all of them.  ``build_forward`` builds the whole
pass lazily — nothing runs until it is executed (eagerly here; captured as a
CUDA graph by ``graph_on``).  Run it to execute one forward eagerly and check
it against float64 NumPy:

    python examples/token_model.py [--d 2048] [--layers 22]

``--d`` must be a multiple of 128 (the kernels' tiles); it is checked first.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import deviceop as dop  # noqa: E402
from deviceop import DeviceOpVec, shared, zip_  # noqa: E402
from deviceop.kernels import (add, batch_tile, load_row, matvec, matvec_add, matvec_add_bf16, matvec_batched,  # noqa: E402
                     rms_matvec, rms_matvec_bf16, rms_norm, store_row)


@dataclass(frozen=True)
class Config:
    d: int = 2048
    n_layers: int = 22
    block: int = 128   # add<B>: elements per tile
    bn: int = 16       # matvec<BN>: output rows per tile
    bk: int = 16       # matvec<BK>: 16-byte loads in flight per lane
    rms_bs: int = 256  # rms_norm<BS>: threads per row (at most d/4: one float4 per thread and up)
    eps: float = 1e-5

    def rms_generics(self):
        return [self.d, min(self.rms_bs, self.d // 4)]

    def mv_generics(self):
        return [self.bn, self.bk, self.d]

    def fused_generics(self, bf16: bool = False):
        """rms_matvec / matvec_add <BN, BK, K>: BK counts 16-byte loads, and a bf16 load
        holds 8 weights where an fp32 one holds 4, so bf16 takes half the loads per row."""
        return [self.bn, max(1, self.bk // 2) if bf16 else self.bk, self.d]


def sized(d: int, n_layers: int) -> Config:
    """A Config for hidden size ``d`` (see ``size_problem``): the largest matvec BK
    (<= 16) and rms_norm BS (<= 256) that divide it."""
    bk = next(b for b in (16, 8, 4, 2, 1) if d % (128 * b) == 0)
    bs = next(b for b in (256, 128, 64, 32) if d % (4 * b) == 0)
    return Config(d=d, n_layers=n_layers, bk=bk, rms_bs=bs)


def size_problem(d: int, fused: bool = False) -> str | None:
    """Why the model's kernels cannot run at hidden size ``d`` (None if they can)."""
    if d < 128 or d % 128:
        return f"--d {d}: the kernels need a multiple of 128 (add<128> tiles; matvec reads rows 128 floats at a time)"
    if fused and (d % 256 or 4 * (d + 16) > 48 * 1024):
        return (f"--d {d}: the fused kernels need a multiple of 256, at most 12032 (a bf16 load holds 8 weights; "
                "x is staged in 48 KB of shared memory)")
    return None


def positive(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be at least 1")
    return v


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and each option's default after its help
    (options whose default depends on the device say so in their help)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "(default" not in text:
            text += " (default: %(default)s)"
        return text


@dataclass
class LayerWeights:
    norm_w: dop.SharedTensor
    wq: dop.SharedTensor
    wo: dop.SharedTensor


@dataclass
class LayerBuffers:
    norm: dop.SharedTensor
    q: dop.SharedTensor
    o: dop.SharedTensor
    residual: dop.SharedTensor

    @staticmethod
    def allocate(d: int, stream=None) -> "LayerBuffers":
        return LayerBuffers(*(dop.empty(shape, stream=stream).into_shared() for shape in ([1, d], [d], [d], [d])))


def random_weights(cfg: Config, seed: int = 0, stream=None) -> tuple[list[LayerWeights], list]:
    """Weights scaled like a trained model's (1/sqrt(d)), and their host copies."""
    rng = np.random.default_rng(seed)
    weights, host = [], []
    for _ in range(cfg.n_layers):
        h = (1 + 0.1 * rng.standard_normal(cfg.d).astype(np.float32),
             (rng.standard_normal((cfg.d, cfg.d)) / np.sqrt(cfg.d)).astype(np.float32),
             (rng.standard_normal((cfg.d, cfg.d)) / np.sqrt(cfg.d)).astype(np.float32))
        host.append(h)
        weights.append(LayerWeights(*(dop.from_numpy(a, stream=stream).into_shared() for a in h)))
    return weights, host


def build_forward(cfg: Config, weights, input, buffers):
    """The whole forward pass as one lazy op, and the shared op of its output."""
    ops, hidden = [], shared(input)
    for w, bufs in zip(weights, buffers):
        norm = (rms_norm(bufs.norm.try_partition([1, cfg.d]), hidden.clone().reshape([1, cfg.d]), w.norm_w, cfg.eps)
                .generics(cfg.rms_generics()).first().unpartition().shared())
        q = (matvec(bufs.q.try_partition([cfg.bn]), norm.clone(), w.wq)
             .generics(cfg.mv_generics()).first().unpartition().shared())
        o = (matvec(bufs.o.try_partition([cfg.bn]), q.clone().reshape([1, cfg.d]), w.wo)
             .generics(cfg.mv_generics()).first().unpartition().shared())
        residual = (add(bufs.residual.try_partition([cfg.block]), hidden.clone().reshape([cfg.d]), o.clone())
                    .generics([cfg.block]).first().unpartition().shared())
        hidden = residual.clone()
        ops.append(zip_(norm, q, o, residual).map(lambda _: None).boxed())
    return DeviceOpVec(ops), hidden


def build_batched_forward(cfg: Config, weights, x, alloc):
    """The same model for a batch of tokens: ``x`` is [B, d], rows independent.

    ``alloc(shape)`` makes each intermediate buffer (``dop.empty``, or a
    GraphCache workspace's ``ws.empty``).  The matvecs become
    ``matvec_batched`` (still one pass over the weights); rms_norm and add
    already work row by row.  Returns an op producing the [B, d] output."""
    batch, d = x.shape
    mb = batch_tile(batch)
    mv = [cfg.bn, cfg.bk, d, mb]
    hidden, ops = x, []
    for w in weights:
        norm, q, o, res = (alloc([batch, d]) for _ in range(4))
        ops += [rms_norm(norm.partition([1, d]), hidden, w.norm_w, cfg.eps).generics(cfg.rms_generics()),
                matvec_batched(q.partition([mb, cfg.bn]), norm, w.wq).generics(mv),
                matvec_batched(o.partition([mb, cfg.bn]), q, w.wo).generics(mv),
                add(res.view([batch * d]).partition([cfg.block]), hidden.view([batch * d]), o.view([batch * d]))
                .generics([cfg.block])]
        hidden = res
    return zip_(*ops).map(lambda _, out=hidden: out)


def bf16_weights(weights) -> list[LayerWeights]:
    """The same layers with bfloat16 projection weights (the norm weights stay fp32)."""
    import ml_dtypes
    out = []
    for w in weights:
        wq, wo = (dop.from_numpy(t.numpy().astype(ml_dtypes.bfloat16)).into_shared() for t in (w.wq, w.wo))
        out.append(LayerWeights(w.norm_w, wq, wo))
    return out


def fused_buffers(cfg: Config, stream=None) -> list:
    """Per layer: the Q output and the new hidden state (each [d])."""
    return [(dop.empty([cfg.d], stream=stream), dop.empty([cfg.d], stream=stream)) for _ in range(cfg.n_layers)]


def build_fused_forward(cfg: Config, weights, x, buffers, pdl: bool = False):
    """The model in 2 kernels a layer: rms_matvec (RMSNorm folded into Q) and
    matvec_add (O plus the residual).  ``weights`` fp32 or bfloat16 (bf16_weights);
    ``pdl`` launches each kernel with programmatic dependent launch.  Returns an op
    producing the output hidden state [d]."""
    d = cfg.d
    bf16 = weights[0].wq.dtype is dop.bfloat16
    first, second = (rms_matvec_bf16, matvec_add_bf16) if bf16 else (rms_matvec, matvec_add)
    gen = cfg.fused_generics(bf16)
    hidden, ops = x, []
    for w, (q, h) in zip(weights, buffers):
        ops += [first(q.partition([cfg.bn]), hidden.view([1, d]), w.norm_w, w.wq, cfg.eps).generics(gen).pdl(pdl),
                second(h.partition([cfg.bn]), q.view([1, d]), w.wo, hidden).generics(gen).pdl(pdl)]
        hidden = h
    return zip_(*ops).map(lambda _, out=hidden: out)


def build_device_loop(cfg: Config, weights, inputs, outputs, index, count, buffers, pdl: bool = False,
                      stream=None):
    """T tokens in one op: ``inputs`` [T, d] holds every token's embedding,
    ``outputs`` [T, d] receives every token's output.  Each iteration loads row
    ``index`` into the model's input, runs the fused forward and stores its
    output at row ``index``; captured (``graph_on``) it is one conditional WHILE
    node, so one graph launch runs all ``count`` tokens.  ``count``: an int or
    an int32 [1] device tensor (change it between replays)."""
    rows, d = inputs.shape
    x = dop.empty([d], stream=stream)  # the model's input: each iteration loads its row here

    def token(i):
        forward = build_fused_forward(cfg, weights, x, buffers, pdl=pdl)
        return zip_(load_row(x.partition([cfg.block]), inputs, i, rows).generics([cfg.block]).pdl(pdl),
                    forward.then(lambda h: store_row(outputs.partition([rows, cfg.block]), h, i, rows)
                                 .generics([cfg.block]).pdl(pdl)))
    return dop.loop(count, index, token)


def numpy_forward(cfg: Config, host_weights, x: np.ndarray) -> np.ndarray:
    """The same model in float64 NumPy (``x``: [d], or [B, d] for a batch)."""
    h = x.astype(np.float64)
    for norm_w, wq, wo in host_weights:
        n = h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + cfg.eps) * norm_w
        h = h + (n @ wq.astype(np.float64).T) @ wo.astype(np.float64).T
    return h


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--d", type=positive, default=2048, help="hidden size (a multiple of 128)")
    ap.add_argument("--layers", type=positive, default=22, help="number of layers")
    args = ap.parse_args()
    problem = size_problem(args.d)
    if problem:
        ap.error(problem)
    cfg = sized(args.d, args.layers)
    device = dop.Device(0)
    where = device.name if not device.is_reference else "the reference device (no GPU: NumPy)"
    print(f"{cfg.n_layers}-layer forward, d={cfg.d}, on {where}")
    stream = device.new_stream()
    weights, host = random_weights(cfg, stream=stream)
    x = np.random.default_rng(1).standard_normal(cfg.d).astype(np.float32)
    buffers = [LayerBuffers.allocate(cfg.d, stream) for _ in range(cfg.n_layers)]
    forward, out = build_forward(cfg, weights, dop.from_numpy(x, stream=stream), buffers)
    forward.sync_on(stream)
    got = out.sync_on(stream).numpy()
    ref = numpy_forward(cfg, host, x)
    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
    print(f"max |out - float64 NumPy| / max |NumPy| = {err:.2e} ({'ok' if err < 1e-5 else 'FAILED: above 1e-5'})")
    return 0 if err < 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
