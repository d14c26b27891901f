"""The fused conv's float64 references: what the GPU is held to (conv_gn_act_reference)
and what the reference device runs for each launch (the partial statistics, Chan's
merge and the apply step exactly as the kernels compute them)."""
from __future__ import annotations

import numpy as np

ACTS = {"identity": 0, "silu": 1, "mish": 2}  # the activation codes the kernels take


def conv2d_reference(x, w, bias, pad):
    """y [N, P, Q, K] = conv(x [N, H, W, C], w [K, R, S, C]) + bias, in float64."""
    x64 = np.pad(x.astype(np.float64), ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    kk, r, s, _ = w.shape
    p, q = x64.shape[1] - r + 1, x64.shape[2] - s + 1
    w64 = w.astype(np.float64)
    y = np.zeros((x.shape[0], p, q, kk)) + bias.astype(np.float64)
    for i in range(r):
        for j in range(s):
            y += x64[:, i:i + p, j:j + q, :] @ w64[:, i, j, :].T
    return y


def activation_reference(v, act: str):
    if act == "silu":
        return v / (1.0 + np.exp(-v))
    if act == "mish":
        return v * np.tanh(np.logaddexp(0.0, v))
    return v


def conv_gn_act_reference(x, w, bias, gamma, beta, groups: int, eps: float, act: str):
    """conv2d -> GroupNorm(groups) -> act, all in float64 (what the GPU is held to)."""
    return _gn_act(conv2d_reference(x, w, bias, (w.shape[1] - 1) // 2), gamma, beta, groups, eps, act)


def _tile_partials(y2, hw, tm, tn, cpg, gs, m0, n0):
    """The conv kernel's (mean, M2) per (segment, group-in-tile) of one tile, float64."""
    mm, kk = y2.shape
    m_end = min(m0 + tm, mm)
    boundary = min((m0 // hw + 1) * hw, m_end)
    out = np.zeros((2, gs, 2))
    for sg, (a, b) in enumerate(((m0, boundary), (boundary, m_end))):
        if b <= a:
            continue
        for lg in range(gs):
            g = n0 // cpg + lg
            ca, cb = max(g * cpg, n0), min((g + 1) * cpg, n0 + tn, kk)
            if cb <= ca:
                continue
            block = y2[a:b, ca:cb]
            out[sg, lg] = block.mean(), ((block - block.mean()) ** 2).sum()
    return out


def _conv_ref(g, stats, y, x, w, bias, blob, semaphore, hw, cpg, gs, with_stats):
    """Reference of conv2d_gn_stats: y = conv + bias (rounded to y's dtype), and the partials."""
    _conv_and_partials(g, stats, y, x, w, bias, hw, cpg, gs, with_stats)


def _conv_wgmma_ref(g, stats, y, x, w, bias, tmaps, partials, counters, n, h, wd, c, k, r, pad, cpg, gs, with_stats,
                    workspace_split):
    """Reference of conv2d_gn_stats_wgmma: the same results (split-K leaves no trace)."""
    _conv_and_partials(g, stats, y, x, w, bias, h * wd, cpg, gs, with_stats)


def _one_launch_ref(g, stats, out, x, w, bias, gamma, beta, partials, counters, tmaps, n, h, wd, c, k, r, pad, cpg,
                    gs, groups, eps, act):
    """Reference of conv2d_gn_act_wgmma: the partials of the unrounded conv (the
    kernel stages its tile in fp32), then GroupNorm and the activation into out."""
    y = conv2d_reference(x, w, bias, pad)
    _tile_stats_into(g, stats, y.reshape(-1, k), h * wd, cpg, gs)
    out[...] = _gn_act(y, gamma, beta, groups, eps, {v: name for name, v in ACTS.items()}[act])


def _gn_act(y, gamma, beta, groups: int, eps: float, act: str):
    n, p, q, k = y.shape
    grouped = y.reshape(n, p * q, groups, k // groups)
    mean = grouped.mean(axis=(1, 3), keepdims=True)
    var = grouped.var(axis=(1, 3), keepdims=True)
    z = ((grouped - mean) / np.sqrt(var + eps)).reshape(n, p, q, k) * gamma.astype(np.float64) + beta.astype(np.float64)
    return activation_reference(z, act)


def _conv_and_partials(g, stats, y, x, w, bias, hw, cpg, gs, with_stats):
    pad = (w.shape[1] - 1) // 2
    y[...] = conv2d_reference(x, w, bias, pad).reshape(y.shape)
    if with_stats:
        _tile_stats_into(g, stats, y.reshape(-1, y.shape[-1]).astype(np.float64), hw, cpg, gs)


def _tile_stats_into(g, stats, y2, hw, cpg, gs):
    """Every tile's partials into stats [MT, NT, KS * 4 * GS] (the last slice's slot)."""
    tm, tn = g["TM"], g["TN"]
    mt, nt, _ = stats.shape
    ks = stats.shape[2] // (4 * gs)
    for i in range(mt):
        for j in range(nt):
            part = _tile_partials(y2, hw, tm, tn, cpg, gs, i * tm, j * tn)  # [2, GS, (mean, M2)]
            stats[i, j, (ks - 1) * 4 * gs:] = part.reshape(-1)


def _merge_partials(stats, n_img, hw, c, groups, tm, tn, gs):
    """Chan's merge of image n's partials per group, as gn_act.cu does it: (mean, var) per group."""
    cpg = c // groups
    ks = stats.shape[2] // (4 * gs)
    st = stats[:, :, (ks - 1) * 4 * gs:].reshape(stats.shape[0], stats.shape[1], 2, gs, 2)
    means, vars_ = np.zeros(groups), np.zeros(groups)
    t_first, t_last = n_img * hw // tm, (n_img * hw + hw - 1) // tm
    for g in range(groups):
        cnt = mean = m2 = 0.0
        for t in range(t_first, t_last + 1):
            for j in range(g * cpg // tn, ((g + 1) * cpg - 1) // tn + 1):
                rows = min((t + 1) * tm, (n_img + 1) * hw) - max(t * tm, n_img * hw)
                chans = min((g + 1) * cpg, (j + 1) * tn) - max(g * cpg, j * tn)
                sg = 1 if n_img * hw > t * tm else 0
                mb, m2b = st[t, j, sg, g - (j * tn) // cpg]
                nb = float(rows * chans)
                nn = cnt + nb
                d = mb - mean
                mean += d * nb / nn
                m2 += m2b + d * d * cnt * nb / nn
                cnt = nn
        means[g], vars_[g] = mean, max(m2 / cnt, 0.0)
    return means, vars_


def _apply_ref_common(g, z, y, stats, gamma, beta, eps, hw, c, groups, tm, tn, ntiles, ks, gs, rows_per):
    act = {v: k for k, v in ACTS.items()}[g["ACT"]]
    n = z.shape[0]
    yv = y.reshape(n, hw, c).astype(np.float64)
    out = np.empty((n, hw, c))
    for i in range(n):
        mean, var = _merge_partials(stats, i, hw, c, groups, tm, tn, gs)
        rstd = 1.0 / np.sqrt(var + eps)
        scale = gamma.astype(np.float64) * np.repeat(rstd, c // groups)
        shift = beta.astype(np.float64) - np.repeat(mean, c // groups) * scale
        out[i] = activation_reference(yv[i] * scale + shift, act)
    z[...] = out.reshape(z.shape)


def _apply_ref(g, z, y, stats, gamma, beta, eps, *rest):
    _apply_ref_common(g, z, y, stats, gamma, beta, eps, *rest)


def _apply_inplace_ref(g, y, stats, gamma, beta, eps, *rest):
    _apply_ref_common(g, y, y.copy(), stats, gamma, beta, eps, *rest)
