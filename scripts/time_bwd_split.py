"""The split-column backward (head dims 129-192 on 128 + 64 columns, 193-256 on 128 + 128) against the general
kernels' 256-wide tiles and PyTorch's (GPU, sm90): TFLOP/s of the whole backward (bf16, MHA, batch = 16384 /
seqlen, heads = 2048 // d; 2.5x the forward's FLOPs, halved when causal).

`split_<dK/dV tile>_<dQ tile>` times `flash_bwd` (delta, dK / dV, dQ) with `flash_bwd_split` in each pair of
--pairs (BLOCK_M, BLOCK_N, warps, stages for each launch), `general` with it off (the kernels that run otherwise:
at d=96 without a causal mask the warp-specialized dK / dV); cuDNN and SDPA-flash their SDPA backward through
autograd (retain_graph). Each gradient is compared with cuDNN's first. --dims 96 / 128 time the 64 + 32 / 64 + 64
splits (off by default; d=192's tiles unless --pairs). `split_*` rows run flash_bwd_split's defaults; with
--block-major / --one-loop, causal rows also run these variants (suffixes): `_hm2l` head-major with a masked and an
unmasked dK / dV loop (before the fortieth session), `_bm` block-major, `_1l` one masked dK / dV loop, `_bm1l`
block-major with one dK / dV loop (the default at 129-192 since the fortieth session). Until 6d7eb94 the unsuffixed
causal rows were `_hm2l`. --ds-gemm: also each pair with dQ from the dS^T the dK / dV launch writes, by the
dq_from_ds kernel (`_dsg`; flash_bwd_split.DS_GEMM, the default at 193-256 since the forty-fifth session) and with
the dQ launch (`_dql`);
--ds-mib M ...: with dS^T in pieces of at most M MiB each (`_dsg<M>M`; DS_GEMM_MAX_BYTES); --dq-tiles M,N,W,S ...: dQ
from dS^T by the dq_from_ds kernel at these tiles (`_dsgk<M>x<N>x<W>x<S>`; dq_from_ds.TILE). (Forty-fifth session:
dQ from dS^T by cuBLAS matmuls, --ds-panel-rows: causal ones in query panels; forty-sixth: --dq-kernel, `_dsgk` the
dq_from_ds kernel, `_dsgm` the matmuls; the matmuls removed since.)

    python3 scripts/time_bwd_split.py [--dims 192] [--causal no yes] [--seqlens 2048 4096 8192 16384]
                                      [--pairs 32,64,8,2/64,64,8,2 ...] [--launches] [--block-major] [--one-loop]
                                      [--ds-gemm] [--ds-mib 256 4096] [--dq-tiles 128,64,8,3 ...] [--json F]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(__file__))

from _bwd_case import backward_case  # noqa: E402
from _records import write_records  # noqa: E402

from fa_backend.kernels.triton import dq_from_ds, flash_bwd_split
from fa_backend.kernels.triton.flash_bwd import bwd_delta, flash_bwd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", type=int, nargs="*", default=[192])
    parser.add_argument("--seqlens", type=int, nargs="*", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--causal", nargs="+", default=["no", "yes"], choices=["no", "yes"])
    parser.add_argument("--pairs", nargs="*", default=[], help="default: the table's tiles (TILES)")
    parser.add_argument("--launches", action="store_true",
                        help="also time the dK / dV and dQ launches of each pair alone (ms, share of the pair)")
    parser.add_argument("--block-major", action="store_true",
                        help="causal rows: also each pair with its launches in block-major order (`_bm`)")
    parser.add_argument("--one-loop", action="store_true",
                        help="causal rows: also each pair with its dK / dV in one masked loop (`_1l`)")
    parser.add_argument("--ds-gemm", action="store_true",
                        help="also each pair with dQ from the dK / dV launch's dS^T (`_dsg`) and with the dQ "
                             "launch (`_dql`)")
    parser.add_argument("--ds-mib", type=int, nargs="*", default=[],
                        help="also each pair with dQ from dS^T in pieces of at most this many MiB (`_dsg<M>M`)")
    parser.add_argument("--dq-tiles", nargs="*", default=[],
                        help="also each pair with dQ from dS^T by the dq_from_ds kernel at these BLOCK_M,BLOCK_N,"
                             "warps,stages (`_dsgk<tile>`)")
    parser.add_argument("--json")
    args = parser.parse_args()
    pairs = [tuple(tuple(int(x) for x in t.split(",")) for t in p.split("/")) for p in args.pairs]
    # (64 + 32 and 64 + 64: experiments; 128 + 128 the default)
    for d, widths in ((96, (64, 32)), (128, (64, 64)), (256, (128, 128))):
        if d in args.dims:
            flash_bwd_split.SPLITS[d] = widths
            flash_bwd_split.TILES.setdefault(d, flash_bwd_split.TILES[192])
    tiles_before = dict(flash_bwd_split.TILES)
    block_major_before, one_loop_before = flash_bwd_split.CAUSAL_BLOCK_MAJOR, flash_bwd_split.CAUSAL_ONE_LOOP
    ds_gemm_before, ds_whole_before = flash_bwd_split.DS_GEMM, flash_bwd_split.DS_GEMM_CAUSAL_WHOLE
    ds_bytes_before, dq_tile_before = flash_bwd_split.DS_GEMM_MAX_BYTES, dq_from_ds.TILE
    dq_tiles = [tuple(int(x) for x in t.split(",")) for t in args.dq_tiles]
    rows = []
    for d in args.dims:
        top = flash_bwd_split.split_widths(d, d, flash_bwd_split.SPLITS)[0]
        for causal in (c == "yes" for c in args.causal):
            for s in args.seqlens:
                case = backward_case(d, s, causal)
                q, k, v, do, out, lse, flops, ref = (case.q, case.k, case.v, case.do, case.out, case.lse, case.flops,
                                                     case.ref)
                b, h = q.shape[:2]

                def ours(pair=None, block_major=None, one_loop=None, ds_gemm=None, ds_mib=None, dq_tile=None):
                    # (None: the module's default for this split class)
                    flash_bwd_split.ENABLED = pair is not None
                    dq_from_ds.TILE = dq_tile or dq_tile_before
                    # (ds_gemm given: DS_GEMM alone says, in any number of pieces)
                    flash_bwd_split.DS_GEMM_CAUSAL_WHOLE = ds_whole_before if ds_gemm is None else frozenset()
                    flash_bwd_split.DS_GEMM_MAX_BYTES = ds_bytes_before if ds_mib is None else ds_mib << 20
                    flash_bwd_split.TILES[top] = pair or tiles_before[top]
                    for name, on, before in (("CAUSAL_BLOCK_MAJOR", block_major, block_major_before),
                                             ("CAUSAL_ONE_LOOP", one_loop, one_loop_before),
                                             ("DS_GEMM", ds_gemm, ds_gemm_before)):
                        setattr(flash_bwd_split, name, before if on is None else frozenset({top} if on else ()))
                    return flash_bwd(do, q, k, v, out, lse, d ** -0.5, causal, False)

                variants = {"": {}}  # name suffix -> ours()'s keyword arguments ("": the defaults)
                if causal and (args.block_major or args.one_loop):
                    two = dict(block_major=False, one_loop=False)
                    variants["_hm2l"] = two
                    variants.update({"_bm": dict(two, block_major=True)} if args.block_major else {})
                    variants.update({"_1l": dict(two, one_loop=True)} if args.one_loop else {})
                    variants.update({"_bm1l": dict(two, block_major=True, one_loop=True)}
                                    if args.block_major and args.one_loop else {})
                if args.ds_gemm:
                    variants.update(_dsg=dict(ds_gemm=True), _dql=dict(ds_gemm=False))
                variants.update({f"_dsg{m}M": dict(ds_gemm=True, ds_mib=m) for m in args.ds_mib})
                variants.update({"_dsgk" + "x".join(map(str, t)): dict(ds_gemm=True, dq_tile=t) for t in dq_tiles})
                fns = {"split_" + "_".join("x".join(map(str, t)) for t in p) + suffix:
                       (lambda p=p, kw=kw: ours(p, **kw)) for suffix, kw in variants.items()
                       for p in pairs or [tiles_before[top]]}
                fns["general"] = ours
                fns.update(case.peers)
                res = {}
                for name, fn in fns.items():
                    try:
                        grads = fn()
                        # (a tensor max: Python's max() drops a NaN that is not first)
                        diff = torch.stack([(g.float() - r.float()).abs().max()
                                            for g, r in zip(grads, ref)]).max().item()
                        ms = triton.testing.do_bench(fn, warmup=30, rep=200)
                        res[name] = dict(tflops=flops / ms / 1e9, ms=ms, max_diff_vs_cudnn=diff)
                    except Exception as e:  # noqa: BLE001 - a tile that does not build: reported
                        res[name] = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
                if args.launches:  # (the default loops and order)
                    flash_bwd_split.CAUSAL_BLOCK_MAJOR = block_major_before
                    flash_bwd_split.CAUSAL_ONE_LOOP = one_loop_before
                    flash_bwd_split.DS_GEMM_MAX_BYTES, dq_from_ds.TILE = ds_bytes_before, dq_tile_before
                    flash_bwd_split.DS_GEMM, flash_bwd_split.DS_GEMM_CAUSAL_WHOLE = ds_gemm_before, ds_whole_before
                    _time_launches(res, pairs or [tiles_before[top]], top, q, k, v, do, out, lse, d, causal)
                rows.append(dict(d=d, causal=causal, seqlen=s, batch=b, heads=h, results=res))
                fl = res["sdpa_flash"]["tflops"]
                print(f"d={d} causal={int(causal)} s={s}: " + "  ".join(
                    f"{n} {r['tflops']:.0f} ({r['tflops'] / fl:.3f}x flash, diff {r['max_diff_vs_cudnn']:.1e})"
                    if "tflops" in r else f"{n} {r['error']}" for n, r in res.items() if "launch" not in n), flush=True)
                for n, r in res.items():
                    if "launch" in n:
                        print(f"  {n}: " + "  ".join(f"{k} {x:.3f} ms" for k, x in r.items()), flush=True)
                del q, k, v, do, out, lse, leaves, ref_out, flash_out
    flash_bwd_split.ENABLED = True
    flash_bwd_split.CAUSAL_BLOCK_MAJOR, flash_bwd_split.CAUSAL_ONE_LOOP = block_major_before, one_loop_before
    flash_bwd_split.DS_GEMM, flash_bwd_split.DS_GEMM_CAUSAL_WHOLE = ds_gemm_before, ds_whole_before
    flash_bwd_split.DS_GEMM_MAX_BYTES, dq_from_ds.TILE = ds_bytes_before, dq_tile_before
    flash_bwd_split.TILES.update(tiles_before)
    write_records(args.json, rows)


def _time_launches(res: dict, pairs: list, top: int, q, k, v, do, out, lse, d: int, causal: bool) -> None:
    """Time the dK / dV and the dQ launch of each pair alone (delta computed once beforehand), in the grid order
    and causal loops flash_bwd_split's CAUSAL_BLOCK_MAJOR and CAUSAL_ONE_LOOP say."""
    delta = bwd_delta(out, do, None, triton.next_power_of_2(d))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    before = flash_bwd_split.TILES[top]
    for p in pairs:
        flash_bwd_split.TILES[top] = p
        calls = flash_bwd_split.launches(q, k, v, do, lse, delta, dq, dk, dv, d ** -0.5, 0 if causal else None,
                                         False)
        # (with DS_GEMM, a dK / dV launch and a dQ one per piece of the call: each kind summed)
        def dkdv(calls=calls):
            for c in calls[0::2]:
                c()

        def dq_(calls=calls):
            for c in calls[1::2]:
                c()
        name = "launch_" + "_".join("x".join(map(str, t)) for t in p)
        try:
            res[name] = dict(dkdv=triton.testing.do_bench(dkdv, warmup=30, rep=200),
                             dq=triton.testing.do_bench(dq_, warmup=30, rep=200))
        except Exception as e:  # noqa: BLE001 - a tile that does not build: reported by the pair above
            res[name] = dict(error=float("nan"))
            print(f"  {name}: {type(e).__name__}", flush=True)
    flash_bwd_split.TILES[top] = before


if __name__ == "__main__":
    main()
