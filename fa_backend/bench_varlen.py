"""Varlen benchmark (GPU): a packed batch of mixed lengths through flash_attn_varlen_func vs the same
batch padded for PyTorch's SDPA with a key-padding mask.

Lengths are drawn uniformly in [--min-len, --max-len] (seeded) until about --tokens tokens; bf16,
hq=16, d=128 by default. Peers run F.scaled_dot_product_attention on the padded (b, h, max_len, d)
batch (made from (b, max_len, h, d) memory, the usual model layout) with a bool key-padding mask
(b, 1, 1, max_len) (True = attend): once as PyTorch's dispatcher chooses ("sdpa_default") and once
restricted to its memory-efficient backend ("sdpa_efficient"). With --causal, ours runs causal=True
and the peers get the key-padding mask combined with a causal one, (b, 1, max_len, max_len).

Reported per backend: median time of the forward and of forward + backward
(triton.testing.do_bench), the effective TFLOP/s on the real (unpadded) tokens, and the peak memory
(torch.cuda.max_memory_allocated) of one forward and of one forward + backward, both including the
inputs (packed for ours, padded for the peers) and as the increase over what was allocated before.

    python -m fa_backend.bench_varlen [--json F] [--tokens 65536] [--min-len 256] [--max-len 8192] [--causal]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch


def draw_lengths(tokens: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    """Uniform lengths in [lo, hi] summing to about `tokens` (the last one clipped, kept >= lo)."""
    gen = torch.Generator().manual_seed(seed)
    lens: list[int] = []
    while sum(lens) < tokens:
        lens.append(int(torch.randint(lo, hi + 1, (1,), generator=gen)))
    rest = tokens - sum(lens[:-1])  # the last length, clipped to land on `tokens` (dropped if below lo)
    if rest >= lo:
        lens[-1] = rest
    elif len(lens) > 1:
        lens.pop()
    return lens


def useful_flops(lens: list[int], heads: int, d: int, causal: bool) -> float:
    """Forward FLOPs of the real tokens: 4 * s^2 * d per head (half of it when causal)."""
    return sum(4.0 * s * s * d * heads * (0.5 if causal else 1.0) for s in lens)


def _bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def _peak(fn) -> tuple[float, float]:
    """(peak MiB including what is already allocated, increase over it) of one call of fn."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    return peak / 2**20, (peak - before) / 2**20


def _measure(name: str, fwd, fwd_bwd, flops: float) -> dict:
    row: dict = {"backend": name}
    try:
        with torch.no_grad():
            fwd()
        fwd_bwd()
        row["peak_fwd_mib"], row["extra_fwd_mib"] = _peak(lambda: fwd())
        row["peak_fwd_bwd_mib"], row["extra_fwd_bwd_mib"] = _peak(fwd_bwd)
        with torch.no_grad():
            row["fwd_ms"] = _bench(fwd)
        row["fwd_bwd_ms"] = _bench(fwd_bwd)
        row["fwd_tflops"] = flops / row["fwd_ms"] * 1e-9
        row["fwd_bwd_tflops"] = 3.5 * flops / row["fwd_bwd_ms"] * 1e-9
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # a peer refusing the inputs is reported
        row["error"] = str(e).splitlines()[0][:160]
    torch.cuda.empty_cache()
    return row


def _run_ours(cu, total, max_len, heads, d, causal, dtype, flops, device="cuda") -> dict:
    """flash_attn_varlen_func on packed (total, h, d) inputs (freed on return)."""
    from . import flash_attn_varlen_func

    q, k, v = (torch.randn(total, heads, d, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
    dout = torch.randn(total, heads, d, dtype=dtype, device=device)

    def ours():
        return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=causal)

    def ours_fwd_bwd():
        torch.autograd.grad(ours(), (q, k, v), dout)

    return _measure("triton_varlen", ours, ours_fwd_bwd, flops)


def run(lens: list[int], heads: int = 16, d: int = 128, causal: bool = False,
        dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> list[dict]:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dev = device
    total, b, max_len = sum(lens), len(lens), max(lens)
    flops = useful_flops(lens, heads, d, causal)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=dev)
    rows = []

    rows.append(_run_ours(cu, total, max_len, heads, d, causal, dtype, flops, dev))

    # Peers: padded (b, max_len, h, d) memory viewed as (b, h, max_len, d), key-padding mask.
    valid = torch.arange(max_len, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None]
    mask = valid[:, None, None, :]
    if causal:
        # Bottom-right per sequence = top-left here: every sequence starts at row 0 of its padded slot.
        mask = mask & torch.ones(max_len, max_len, dtype=torch.bool, device=dev).tril()
    qp, kp, vp = (torch.randn(b, max_len, heads, d, dtype=dtype, device=dev).transpose(1, 2).requires_grad_()
                  for _ in range(3))
    doutp = torch.randn(b, max_len, heads, d, dtype=dtype, device=dev).transpose(1, 2)
    for name, backend in (("sdpa_default", None), ("sdpa_efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def sdpa(backend=backend):
            if backend is None:
                return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask)

        def sdpa_fwd_bwd(sdpa=sdpa):
            torch.autograd.grad(sdpa(), (qp, kp, vp), doutp)

        rows.append(_measure(name, sdpa, sdpa_fwd_bwd, flops))
    return rows


def _fmt(row: dict) -> str:
    if "error" in row:
        return f"{row['backend']:>15}  error: {row['error']}"
    return (f"{row['backend']:>15} {row['fwd_ms']:8.2f} {row['fwd_bwd_ms']:9.2f} {row['fwd_tflops']:7.0f} "
            f"{row['fwd_bwd_tflops']:7.0f} {row['peak_fwd_mib']:9.0f} {row['peak_fwd_bwd_mib']:10.0f} "
            f"{row['extra_fwd_bwd_mib']:10.0f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the configuration and rows to this file")
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--min-len", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_varlen needs a CUDA GPU", file=sys.stderr)
        return 1
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    lens = draw_lengths(args.tokens, args.min_len, args.max_len, args.seed)
    print(f"# {torch.cuda.get_device_name()}  {args.dtype} h={args.heads} d={args.head_dim} causal={args.causal}  "
          f"{len(lens)} sequences, {sum(lens)} tokens, lengths {min(lens)}..{max(lens)} (padded to {max(lens)}: "
          f"{len(lens) * max(lens)} tokens)")
    print(f"{'backend':>15} {'fwd_ms':>8} {'fwdbwd_ms':>9} {'fwd_TF':>7} {'fb_TF':>7} {'peak_fwd':>9} "
          f"{'peak_fb':>10} {'extra_fb':>10}   (MiB; TF = TFLOP/s of the real tokens)")
    rows = run(lens, args.heads, args.head_dim, args.causal, dtype)
    for row in rows:
        print(_fmt(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "heads": args.heads,
                       "head_dim": args.head_dim, "causal": args.causal, "lengths": lens, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
