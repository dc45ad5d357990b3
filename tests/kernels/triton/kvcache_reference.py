"""Reference for flash_attn_with_kvcache tests: plain PyTorch, per batch entry, in any dtype.

float64 is the truth; the inputs' own dtype is the baseline of the 2x rule (tests/reference.py).
Written from FlashAttention-2's documented semantics, independently of the kernels.
"""

from __future__ import annotations

import torch


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, interleaved: bool):
    """Rotate x (s, h, d) at integer positions pos (s,) in x's dtype; cos/sin (seqlen_ro, rd / 2)."""
    rd = 2 * cos.shape[1]
    c = cos[pos].to(x.dtype)[:, None, :]  # (s, 1, rd/2)
    s = sin[pos].to(x.dtype)[:, None, :]
    xr, rest = x[..., :rd], x[..., rd:]
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        rot = torch.stack((o1, o2), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., : rd // 2], xr[..., rd // 2:]
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rot, rest), dim=-1)


def kvcache_ref(q, k_cache, v_cache, k=None, v=None, *, rotary_cos=None, rotary_sin=None, cache_seqlens,
                cache_batch_idx=None, cache_leftpad=None, block_table=None, scale=None, causal=False,
                window_size=(-1, -1), softcap=0.0, rotary_interleaved=True, alibi_slopes=None, dtype=None):
    """Returns (out (b, sq, hq, d), lse (b, hq, sq), [per-batch appended k cache rows], [v rows]) computed
    in `dtype` (default q's). cache_seqlens: (b,) tensor. Caches are not modified."""
    dtype = q.dtype if dtype is None else dtype
    b, sq, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    scale = d ** -0.5 if scale is None else scale
    left, right = window_size
    if causal:
        right = 0
    local = causal or left >= 0 or right >= 0
    dev = q.device
    outs, lses, kcs, vcs = [], [], [], []
    for i in range(b):
        sl = int(cache_seqlens[i])
        lp = 0 if cache_leftpad is None else int(cache_leftpad[i])
        if block_table is not None:
            kc = k_cache[block_table[i].long()].flatten(0, 1).to(dtype)
            vc = v_cache[block_table[i].long()].flatten(0, 1).to(dtype)
        else:
            cb = i if cache_batch_idx is None else int(cache_batch_idx[i])
            kc, vc = k_cache[cb].to(dtype), v_cache[cb].to(dtype)
        qi = q[i].to(dtype)
        sn = 0
        if k is not None:
            sn = k.shape[1]
            kn, vn = k[i].to(dtype), v[i].to(dtype)
            if rotary_cos is not None:
                kn = rotary_ref(kn, rotary_cos, rotary_sin, sl + torch.arange(sn, device=dev), rotary_interleaved)
            kc, vc = kc.clone(), vc.clone()
            kc[sl:sl + sn], vc[sl:sl + sn] = kn, vn
        if rotary_cos is not None:
            qpos = sl + (torch.arange(sq, device=dev) if local else torch.zeros(sq, dtype=torch.long, device=dev))
            qi = rotary_ref(qi, rotary_cos, rotary_sin, qpos, rotary_interleaved)
        kcs.append(kc)
        vcs.append(vc)
        keys = kc[lp:sl + sn].repeat_interleave(group, dim=1)  # (sk, hq, d)
        vals = vc[lp:sl + sn].repeat_interleave(group, dim=1)
        sk = keys.shape[0]
        s = torch.einsum("qhd,khd->hqk", qi, keys) * scale
        if softcap > 0:
            s = torch.tanh(s / softcap) * softcap
        rel = torch.arange(sk, device=dev)[None, :] - (torch.arange(sq, device=dev)[:, None] + sk - sq)  # (sq, sk)
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i]
            s = s - slopes.to(dtype)[:, None, None] * rel.abs().to(dtype)
        keep = torch.ones(sq, sk, dtype=torch.bool, device=dev)
        if right >= 0:
            keep &= rel <= right
        if left >= 0:
            keep &= rel >= -left
        s = s.masked_fill(~keep, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)  # (hq, sq)
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no key: 0
        outs.append(torch.einsum("hqk,khd->qhd", p, vals))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses), kcs, vcs
