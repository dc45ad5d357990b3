"""Forward speed of the CuTe sm90 kernels (simple, warp-specialised serial and overlap) against PyTorch's
cuDNN and flash SDPA and fa_backend's Triton forward, in one run (bf16, batch = 16384 / seqlen, heads =
2048 / d, the issue's sizes), plus each CuTe variant's first-call compile time. With --backward: the backward
instead (the CuTe backward, kernels/cute/flash_bwd.py, dQ by bulk adds and by atomics, on the CuTe forward's out and LSE, against the
Triton backward and PyTorch's cuDNN and flash backwards through autograd; TFLOP/s = 2.5 x the forward's FLOPs).
FlashAttention-4 (`flash_attn.cute`, package flash-attn-4) is timed as the peer `fa4` when installed, on (b, s, h, d)
copies of the same inputs (its layout).
Usage: python scripts/bench_cute.py [--json FILE] [--backward | --host] [--runners NAME ...] [--dims D ...]
       [--seqlens S ...] [--repeat R] [--causal both|no|yes]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

import fa_backend
from fa_backend.kernels.cute.flash_fwd import flash_fwd
from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_ws
from _records import write_records  # scripts/_records.py


def _fa4():
    """FlashAttention-4's flash_attn_func ((b, s, h, d) in, (out, lse) out), or None when not installed."""
    try:
        from flash_attn.cute import flash_attn_func
    except ImportError:
        return None
    return flash_attn_func


def _time_fa4(fa4, q, k, v, causal, dout=None):
    """FA4's forward (or, with dout, backward through autograd) median ms on (b, s, h, d) copies; None if it fails."""
    q4, k4, v4 = (t.transpose(1, 2).contiguous().requires_grad_(dout is not None) for t in (q, k, v))
    try:
        if dout is None:
            return triton.testing.do_bench(lambda: fa4(q4, k4, v4, causal=causal), warmup=50, rep=300)
        o = fa4(q4, k4, v4, causal=causal)[0]
        d4 = dout.transpose(1, 2).contiguous()
        return triton.testing.do_bench(lambda: torch.autograd.grad(o, (q4, k4, v4), d4, retain_graph=True),
                                       warmup=20, rep=200)
    except Exception as e:  # noqa: BLE001  (a peer that cannot run a cell is reported, not fatal)
        print(f"fa4 failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return None


def _wide(block_n, kw, q, k, v, causal):
    """flash_fwd_ws with block_n keys per block (ValueError, a skipped cell, where causal or not fitting)."""
    return flash_fwd_ws(q, k, v, causal=causal, block_n=block_n, **kw)


def _stages(kv_stages, kw, q, k, v, causal):
    """flash_fwd_ws with a K / V ring kv_stages deep (ValueError, a skipped cell, where it does not fit)."""
    return flash_fwd_ws(q, k, v, causal=causal, kv_stages=kv_stages, **kw)


def _flops(b, h, s, d, causal):
    return 4 * b * h * s * s * d / (2 if causal else 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--seqlens", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--backward", action="store_true")
    parser.add_argument("--runners", nargs="+", help="forward runners to time (default: all); with --backward, the "
                                                     f"backward kernel variants ({', '.join(CUTE_BACKWARDS[:-1])})")
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--host", action="store_true",
                        help="instead: host time per forward call, tensor convention against kernels/cute/_fast_call.py")
    parser.add_argument("--repeat", type=int, default=1,
                        help="forward: rounds over the runners, interleaved; each cell is the median round")
    parser.add_argument("--causal", choices=("both", "no", "yes"), default="both",
                        help="forward: the causal modes to time (default both)")
    args = parser.parse_args()
    if args.host:
        host_time()
        return
    if args.backward:
        records = backward(args.seqlens, tuple(args.dims), args.runners)
        write_records(args.json, records)
        return
    dt = torch.bfloat16
    runners = {
        "cute_simple": lambda q, k, v, c: flash_fwd(q, k, v, causal=c),
        "cute_ws": lambda q, k, v, c: flash_fwd_ws(q, k, v, causal=c),
        "cute_ws_overlap": lambda q, k, v, c: flash_fwd_ws(q, k, v, causal=c, overlap=True),
        "cute_ws_pingpong": lambda q, k, v, c: flash_fwd_ws(q, k, v, causal=c, pingpong=True),
        "cute_ws_3wg": lambda q, k, v, c: flash_fwd_ws(q, k, v, causal=c, consumers=3),
        "cute_ws_3wg_overlap": lambda q, k, v, c: flash_fwd_ws(q, k, v, causal=c, consumers=3, overlap=True),
        "cute_ws_3wg_pingpong": lambda q, k, v, c: flash_fwd_ws(q, k, v, causal=c, consumers=3, pingpong=True),
        # O stored from registers (tma_store=False) instead of through shared memory and a TMA store
        "cute_ws_overlap_regs": lambda q, k, v, c: flash_fwd_ws(q, k, v, causal=c, overlap=True, tma_store=False),
        "cute_ws_pingpong_regs": lambda q, k, v, c: flash_fwd_ws(q, k, v, causal=c, pingpong=True, tma_store=False),
        "cute_ws_3wg_regs": lambda q, k, v, c: flash_fwd_ws(q, k, v, causal=c, consumers=3, tma_store=False),
        "cute_ws_overlap_persistent": lambda q, k, v, c: flash_fwd_ws(q, k, v, causal=c, overlap=True, persistent=True),
        "cute_ws_pingpong_persistent": lambda q, k, v, c: flash_fwd_ws(q, k, v, causal=c, pingpong=True,
                                                                       persistent=True),
        "cute_ws_3wg_pingpong_persistent": lambda q, k, v, c: flash_fwd_ws(q, k, v, causal=c, consumers=3,
                                                                           pingpong=True, persistent=True),
        "triton": lambda q, k, v, c: fa_backend.attention(q, k, v, is_causal=c),
    }
    # wider key blocks without a causal mask (block_n; FA3's 176 at d=128), timed only when named: e.g.
    # cute_ws_overlap_n176 (twenty-seventh session: none faster than the 128-key variants at d=128)
    wide = {}
    for n in (160, 176, 192, 256):
        wide[f"cute_ws_overlap_n{n}"] = functools.partial(_wide, n, dict(overlap=True))
        wide[f"cute_ws_pingpong_n{n}"] = functools.partial(_wide, n, dict(pingpong=True))
    # deeper K / V rings (kv_stages; FlashForwardSm90WS has KV_STAGES = 2), timed only when named: e.g.
    # cute_ws_3wg_pingpong_s3 (d=64's 192-row tiles fit four stages, d=128's two)
    for st in (3, 4):
        wide[f"cute_ws_3wg_pingpong_s{st}"] = functools.partial(_stages, st, dict(consumers=3, pingpong=True))
        wide[f"cute_ws_overlap_s{st}"] = functools.partial(_stages, st, dict(overlap=True))
    if args.runners:
        runners = {n: f for n, f in {**runners, **wide}.items() if n in args.runners}
    peers = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    fa4 = _fa4()
    records = []
    for d in args.dims:
        for causal in {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]:
            for s in args.seqlens:
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=dt) for _ in range(3))
                row = dict(d=d, causal=causal, seqlen=s, batch=b, heads=h)
                active = {}
                for name, fn in runners.items():
                    t0 = time.perf_counter()
                    try:
                        fn(q, k, v, causal)
                    except ValueError as e:  # a variant without this head dim (e.g. three consumers at d > 128)
                        print(f"d={d:3d} {name}: skipped ({e})", flush=True)
                        continue
                    torch.cuda.synchronize()
                    row[f"{name}_first_call_s"] = round(time.perf_counter() - t0, 3)
                    active[name] = fn
                rounds = {name: [] for name in active}
                for _ in range(args.repeat):
                    for name, fn in active.items():
                        ms = triton.testing.do_bench(lambda: fn(q, k, v, causal), warmup=50, rep=300)
                        rounds[name].append(_flops(b, h, s, d, causal) / ms / 1e9)
                for name, values in rounds.items():
                    row[name] = statistics.median(values)
                    if args.repeat > 1:
                        row[f"{name}_rounds"] = [round(x, 1) for x in values]
                for name, backend in peers.items():
                    with sdpa_kernel(backend):
                        ms = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                                     warmup=50, rep=300)
                    row[name] = _flops(b, h, s, d, causal) / ms / 1e9
                if fa4 is not None:
                    ms = _time_fa4(fa4, q, k, v, causal)
                    row["fa4"] = None if ms is None else _flops(b, h, s, d, causal) / ms / 1e9
                records.append(row)
                cells = "  ".join(f"{n} {row[n]:6.1f}" for n in (*active, *peers) if row.get(n) is not None)
                cute_rows = [n for n in active if n.startswith("cute")]
                if row.get("fa4") and cute_rows:
                    best = max(row[n] for n in cute_rows)
                    cells += f"  fa4 {row['fa4']:6.1f}  best_cute/fa4 {best / row['fa4']:.2f}"
                ratios = "  ".join(f"{n[5:]}/cudnn {row[n] / row['cudnn']:.2f}" for n in cute_rows)
                print(f"d={d:3d} causal={int(causal)} s={s:5d}  TFLOP/s: {cells}  {ratios}", flush=True)
                if args.repeat > 1:
                    print("    rounds: " + "  ".join(f"{n} {row[n + '_rounds']}" for n in active), flush=True)
                del q, k, v
    print("first-call seconds (compile + run), per variant:",
          {k: v for r in records for k, v in r.items() if k.endswith("first_call_s") and v > 0.5})
    write_records(args.json, records)


def host_time(calls: int = 2000) -> None:
    """Wall time per call of a small forward (bf16, b=1, hq=8, hkv=2, s=128, d=128: GPU time of a few µs) issued back
    to back, with each calling convention, alternated over three rounds (medians printed)."""
    from fa_backend.kernels.cute import _fast_call
    from fa_backend.kernels.cute.flash_fwd_ws import flash_fwd_fastest

    q = torch.randn(1, 8, 128, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 128, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rounds = {False: [], True: []}
    default = _fast_call.ENABLED
    for _ in range(3):
        for fast in (False, True):
            _fast_call.ENABLED = fast
            for _ in range(20):
                flash_fwd_fastest(q, k, v, causal=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                flash_fwd_fastest(q, k, v, causal=True)
            torch.cuda.synchronize()
            rounds[fast].append((time.perf_counter() - t0) / calls * 1e6)
    _fast_call.ENABLED = default
    print(f"host µs per forward call: tensor convention {statistics.median(rounds[False]):.1f}, fast call "
          f"{statistics.median(rounds[True]):.1f} (rounds {rounds})", flush=True)


# the CuTe backward's rows: the kernel function's variants, then the op through autograd
# (dq_buffer with one warpgroup, at d=64: 8-14 % slower in the tenth session, no longer timed)
# (_det: the deterministic variant, dQ adds in key-block order; the op's under torch.use_deterministic_algorithms)
CUTE_BACKWARDS = ("cute_bwd", "cute_bwd_2wg", "cute_bwd_2wg_dqbuf", "cute_bwd_ws", "cute_bwd_ws80", "cute_bwd_ws128",
                  "cute_bwd_ws_det", "cute_bwd_ws128_det", "cute_op")


def backward(seqlens: list[int], dims: tuple[int, ...] = (128, 64), only: list[str] | None = None) -> list[dict]:
    """Backward TFLOP/s per (d, causal, seqlen): the CuTe backward kernel's variants (`only`: these), the op's,
    Triton's, cuDNN's and flash's."""
    from fa_backend.kernels.cute.flash_bwd import HEAD_DIMS as BWD_HEAD_DIMS
    from fa_backend.kernels.cute.flash_bwd import WIDE_HEAD_DIMS
    from fa_backend.kernels.cute.flash_bwd import flash_bwd
    from fa_backend.ops import cute_flash

    fa4 = _fa4()
    records = []
    for d in dims:
        for causal in (False, True):
            for s in seqlens:
                b, h = 16384 // s, 2048 // d
                q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                dout = torch.randn_like(q)
                out, lse = flash_fwd_ws(q, k, v, causal=causal, overlap=True)
                flops = 2.5 * _flops(b, h, s, d, causal)
                row = dict(d=d, causal=causal, seqlen=s, batch=b, heads=h)
                # the atomic-dQ variant (136-160 TFLOP/s at 8k) is no longer timed
                variants = [("cute_bwd", dict())] if d in BWD_HEAD_DIMS else []
                if d == 128:
                    variants.append(("cute_bwd_2wg", dict(wgs=2)))
                    variants.append(("cute_bwd_2wg_dqbuf", dict(wgs=2, dq_buffer=True)))
                    variants.append(("cute_bwd_ws", dict(wgs=2, warp_specialized=True)))
                    variants.append(("cute_bwd_ws80", dict(wgs=2, warp_specialized=True, tile_m=80)))
                    variants.append(("cute_bwd_ws_det", dict(wgs=2, warp_specialized=True, deterministic=True)))
                if d in WIDE_HEAD_DIMS:  # flash_bwd_wide's kernel
                    variants.append(("cute_bwd_ws", dict(wgs=2, warp_specialized=True)))
                    variants.append(("cute_bwd_ws_det", dict(wgs=2, warp_specialized=True, deterministic=True)))
                if d == 64:
                    variants.append(("cute_bwd_ws128", dict(wgs=2, warp_specialized=True, tile_m=128)))
                    variants.append(("cute_bwd_ws128_det", dict(wgs=2, warp_specialized=True, tile_m=128,
                                                                deterministic=True)))
                if only:
                    variants = [(n, kw) for n, kw in variants if n in only]
                for name, kw in variants:
                    t0 = time.perf_counter()
                    flash_bwd(dout, q, k, v, out, lse, causal=causal, **kw)
                    torch.cuda.synchronize()
                    row[f"{name}_first_call_s"] = round(time.perf_counter() - t0, 3)
                    ms = triton.testing.do_bench(
                        lambda: flash_bwd(dout, q, k, v, out, lse, causal=causal, **kw), warmup=20, rep=200)
                    row[name] = flops / ms / 1e9
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                for name, ctx in (("triton", None), ("cute_op", "op"), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                                  ("flash", SDPBackend.FLASH_ATTENTION)):
                    if ctx is None:
                        o = fa_backend.attention(*leaves, is_causal=causal)
                    elif ctx == "op":  # the op's autograd with the CuTe backward, as the product would run it
                        cute_flash.CUTE_BACKWARD = True
                        o = cute_flash.cute_flash_attention(*leaves, None, causal)[0]
                    else:
                        with sdpa_kernel(ctx):
                            o = F.scaled_dot_product_attention(*leaves, is_causal=causal)
                    ms = triton.testing.do_bench(
                        lambda: torch.autograd.grad(o, leaves, dout, retain_graph=True), warmup=20, rep=200)
                    row[name] = flops / ms / 1e9
                if fa4 is not None:
                    ms = _time_fa4(fa4, q, k, v, causal, dout)
                    row["fa4"] = None if ms is None else flops / ms / 1e9
                records.append(row)
                cells = "  ".join(f"{n} {row[n]:6.1f}" for n in (*CUTE_BACKWARDS, "triton", "cudnn", "flash", "fa4")
                                  if row.get(n) is not None)
                best = max(row[n] for n in CUTE_BACKWARDS if row.get(n) is not None and not n.endswith("_det"))
                print(f"bwd d={d:3d} causal={int(causal)} s={s:5d}  TFLOP/s: {cells}  best cute/cudnn "
                      f"{best / row['cudnn']:.2f}  cute_op/triton {row['cute_op'] / row['triton']:.2f}", flush=True)
                del q, k, v, dout, out, lse, leaves
    return records


if __name__ == "__main__":
    main()
