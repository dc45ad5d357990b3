"""`python -m fa_backend bench --features`: our kernels with masks and dropout against PyTorch (GPU).

Cases (d=128 by default, seqlen 2k-16k, b*s = 16k tokens, h*d = 2048):
- causal_mask: causal attention given as an explicit bool (sq, sk) mask (SDPA has to read it);
- key_padding: a bool (b, 1, 1, sk) key-padding mask, read with stride 0: sequence i of the batch has
  its first L_i keys, L_i drawn uniformly from [sk / 2, sk] (seeded), the rest padded;
- random_keys: a bool (b, 1, 1, sk) mask hiding a random ~10% of the keys (every tile partial);
- dropout: dropout_p = 0.1, no mask.
Ours: "triton" (fa_backend.attention, the Triton kernels) and, where nvidia-cutlass-dsl is installed, "cute"
(the CuTe kernels through their op, which take bool key masks: key_padding and random_keys, and dropout: at d=128
forward and backward in the CuTe kernels, the forward saving its keep bits for the backward; at other head dims
the backward is the Triton kernels'; causal_mask is reported with the op's refusal). Peers are PyTorch's efficient and cuDNN SDPA backends, each with exactly the same
arguments (a peer that refuses a case is reported with its error). FLOPs count the full (non-causal) matrix for
masks, since neither side knows the mask is causal.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import torch
import torch.nn.functional as F

CASES = ("causal_mask", "key_padding", "random_keys", "dropout")
PEERS = {"efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION"}


@dataclasses.dataclass
class FeatureRecord:
    case: str
    backend: str
    d: int
    seqlen: int
    batch: int
    heads: int
    fwd_ms: float | None = None
    bwd_ms: float | None = None
    fwd_tflops: float | None = None
    bwd_tflops: float | None = None
    error: str | None = None


def case_arguments(case: str, batch: int, seqlen: int, device: str = "cuda") -> dict:
    """SDPA keyword arguments of one case (the same for every backend)."""
    if case == "causal_mask":
        return {"attn_mask": torch.ones(seqlen, seqlen, dtype=torch.bool, device=device).tril()}
    if case == "key_padding":
        gen = torch.Generator(device="cpu").manual_seed(0)
        lengths = torch.randint(seqlen // 2, seqlen + 1, (batch, 1, 1, 1), generator=gen)
        return {"attn_mask": (torch.arange(seqlen) < lengths).to(device)}
    if case == "random_keys":
        gen = torch.Generator(device="cpu").manual_seed(0)
        keep = torch.rand(batch, 1, 1, seqlen, generator=gen) >= 0.1
        return {"attn_mask": keep.to(device)}
    if case == "dropout":
        return {"dropout_p": 0.1}
    raise ValueError(f"unknown case {case!r} (known: {', '.join(CASES)})")


def runner(backend: str, kwargs: dict):
    """(fn(q, k, v), context manager) for one backend and case."""
    if backend == "triton":
        import fa_backend

        return (lambda q, k, v: fa_backend.attention(q, k, v, **kwargs)), contextlib.nullcontext()
    if backend == "cute":
        from .ops.cute_flash import cute_flash_attention

        mask, p = kwargs.get("attn_mask"), kwargs.get("dropout_p", 0.0)
        return ((lambda q, k, v: cute_flash_attention(q, k, v, None, False, False, mask, dropout_p=p)[0]),
                contextlib.nullcontext())
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return ((lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs)),
            sdpa_kernel(getattr(SDPBackend, PEERS[backend])))


def bench_case(case: str, backend: str, d: int, seqlen: int, dtype: torch.dtype, backward: bool,
               tokens: int = 16384, width: int = 2048) -> FeatureRecord:
    from triton.testing import do_bench

    from .bench import _inputs, attention_flops

    batch, heads = max(1, tokens // seqlen), max(1, width // d)
    rec = FeatureRecord(case, backend, d, seqlen, batch, heads)
    flops = attention_flops(batch, heads, seqlen, seqlen, d, False)
    try:
        fn, ctx = runner(backend, case_arguments(case, batch, seqlen))
        q, k, v = _inputs(batch, heads, seqlen, d, dtype)
        with ctx:
            out = fn(q, k, v)
            rec.fwd_ms = do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")
            rec.fwd_tflops = flops / rec.fwd_ms * 1e-9
            if backward:
                dout = torch.randn_like(out)
                rec.bwd_ms = do_bench(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True),
                                      warmup=25, rep=100, return_mode="median")
                rec.bwd_tflops = 2.5 * flops / rec.bwd_ms * 1e-9
    except RuntimeError as e:  # a peer that refuses the inputs is reported, not fatal
        rec.error = str(e).splitlines()[0][:120]
    return rec


def _fmt(x: float | None) -> str:
    return "    -" if x is None else f"{x:5.0f}"


def run(cases=CASES, backends=("triton", "efficient", "cudnn"), dims=(128,), seqlens=(2048, 4096, 8192, 16384),
        dtype: torch.dtype = torch.bfloat16, backward: bool = True, out=sys.stdout) -> list[FeatureRecord]:
    records = []
    for case in cases:
        for d in dims:
            for s in seqlens:
                for backend in backends:
                    rec = bench_case(case, backend, d, s, dtype, backward)
                    torch.cuda.empty_cache()
                    records.append(rec)
                    print(f"  {case:>11} {backend:>9} d={d} s={s:5d}: fwd {_fmt(rec.fwd_tflops)} bwd "
                          f"{_fmt(rec.bwd_tflops)} TFLOP/s{'  ' + rec.error if rec.error else ''}", file=out, flush=True)
    return records
