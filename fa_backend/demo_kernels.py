"""`python -m fa_backend demo --kernels`: run the fused kernels next to PyTorch and print the comparison.

On a GPU the kernels run natively (bf16); without one they run in Triton's CPU interpreter
(fp16, small shapes, slow). Each case reports the max error of our kernel and of PyTorch's own
same-dtype SDPA against a float64 reference, for the output and the three gradients.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F


def _cases(gpu: bool):
    s = 1024 if gpu else 48
    return [
        ("causal, GQA 8:2, d=128", dict(b=2, hq=8, hkv=2, sq=s, sk=s, d=128, dv=128, causal=True, align="top_left")),
        ("non-causal, d=96, sq != sk", dict(b=2, hq=4, hkv=4, sq=s // 2, sk=s + 7, d=96, dv=96, causal=False, align="top_left")),
        ("bottom-right causal, d=192 / dv=128", dict(b=1, hq=4, hkv=1, sq=s // 4, sk=s, d=192, dv=128, causal=True, align="bottom_right")),
        ("MQA, d=64, (b, s, h, d) strides", dict(b=2, hq=8, hkv=1, sq=s, sk=s, d=64, dv=64, causal=True, align="top_left", bshd=True)),
    ]


def _make(c, dtype, device):
    def one(h, s, d):
        if c.get("bshd"):
            return torch.randn(c["b"], s, h, d, dtype=dtype, device=device).transpose(1, 2)
        return torch.randn(c["b"], h, s, d, dtype=dtype, device=device)
    return one(c["hq"], c["sq"], c["d"]), one(c["hkv"], c["sk"], c["d"]), one(c["hkv"], c["sk"], c["dv"])


def _pytorch(q, k, v, c):
    mask = None
    if c["causal"]:
        offset = c["sk"] - c["sq"] if c["align"] == "bottom_right" else 0
        mask = torch.ones(c["sq"], c["sk"], dtype=torch.bool, device=q.device).tril(offset)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=c["hq"] != c["hkv"])


def _grads(fn, tensors, dout):
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, leaves, dout.to(out.dtype))]


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    if not gpu:
        from .dispatch.backends.triton import use_interpreter

        use_interpreter()
    import fa_backend

    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float16)
    where = torch.cuda.get_device_name() if gpu else "CPU (Triton interpreter: small shapes, slow)"
    print(f"fa_backend {fa_backend.__version__} | torch {torch.__version__} | {where} | {dtype}")
    print(f"{'case':38} {'tensor':6} {'fa_backend err':>15} {'PyTorch err':>12}")
    worst = 0.0
    for name, c in _cases(gpu):
        q, k, v = _make(c, dtype, device)
        ours_fn = lambda q, k, v: fa_backend.attention(  # noqa: E731
            q, k, v, is_causal=c["causal"], causal_alignment=c["align"])
        dout = torch.randn(c["b"], c["hq"], c["sq"], c["dv"], device=device)
        ref = _grads(lambda *t: _pytorch(*t, c), [t.double() for t in (q, k, v)], dout.double())
        ours = _grads(ours_fn, (q, k, v), dout)
        theirs = _grads(lambda *t: _pytorch(*t, c), (q, k, v), dout)
        for label, a, b, r in zip(("out", "dq", "dk", "dv"), ours, theirs, ref):
            e_ours = (a.double() - r).abs().max().item()
            e_pt = (b.double() - r).abs().max().item()
            worst = max(worst, e_ours / max(e_pt, 1e-6))
            print(f"{name if label == 'out' else '':38} {label:6} {e_ours:15.2e} {e_pt:12.2e}")
    print(f"worst ratio of our error to PyTorch's: {worst:.2f} (the test bar is 2.0)")
    if gpu:
        from triton.testing import do_bench

        b, h, s, d = 4, 16, 4096, 128
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=dtype).transpose(1, 2) for _ in range(3))
        t_ours = do_bench(lambda: fa_backend.attention(q, k, v, is_causal=True), return_mode="median")
        t_sdpa = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), return_mode="median")
        tf = 2 * b * h * s * s * d * 1e-9
        print(f"causal fwd b={b} h={h} s={s} d={d}: fa_backend {tf / t_ours:.0f} TFLOP/s, "
              f"PyTorch SDPA (default backend) {tf / t_sdpa:.0f} TFLOP/s")
    return 0 if worst <= 2.0 else 1


if __name__ == "__main__":
    sys.exit(main())
