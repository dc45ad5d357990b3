"""Host time per forward call of the CuTe op's Python paths, on any machine (no GPU: the kernel, the input check and
the layout copy are stubbed, so what is timed is the path around them): `fa_backend::cute_flash_fwd` through
torch.library (with its registered autograd) against cute_flash_attention's eager twin, with and without gradients,
and a forward + backward (torch.autograd.grad; the backward kernel stubbed too).

    python3 scripts/host_cute_twin.py [--rounds 5] [--n 500] [--unprepared]

Median and min over rounds of the mean time per call; the kernel's real host cost (_fast_call) is not in it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--n", type=int, default=500)
    parser.add_argument("--unprepared", action="store_true",
                        help="no prepared launches: every call takes the checks and the kernel's entry")
    args = parser.parse_args()
    import fa_backend.kernels.cute.flash_fwd_ws as fwd_ws
    import fa_backend.ops.cute_flash as cute_flash

    def stub_kernel(q, k, v, scale, causal, bottom_right=False, key_words=None, dropout=None):
        return (torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype),
                torch.empty(q.shape[:-1], dtype=torch.float32))

    def stub_backward(dout, q, k, v, out, lse, *args, **kwargs):
        return tuple(torch.empty_like(t) for t in (q, k, v))

    import fa_backend.kernels.cute.flash_bwd as bwd_module

    fwd_ws.flash_fwd_fastest = stub_kernel
    # the prepared launch of a plain call (ops/cute_flash._LAUNCHES) runs the same stub; --unprepared: none, so
    # that every call takes the general path (checks, the kernel's entry) as before the launches existed
    fwd_ws.prepare_fastest = (lambda *a: None) if args.unprepared else (
        lambda q, k, v, scale, causal, bottom_right: lambda q, k, v: stub_kernel(q, k, v, scale, causal))
    bwd_module.flash_bwd = stub_backward
    cute_flash.check_cute_inputs = lambda *a, **k: None
    cute_flash._readable = lambda t: t
    q, k, v = (torch.randn(1, 2, 64, 128, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def op(grad):
        with torch.set_grad_enabled(grad):
            return cute_flash.cute_flash_fwd(q, k, v, None, True, False, None, 0.0, None, False)[0]

    def twin(grad):
        with torch.set_grad_enabled(grad):
            return cute_flash.cute_flash_attention(q, k, v, None, True, False)[0]

    dout = torch.randn(1, 2, 64, 128, dtype=torch.bfloat16)

    def op_step(_):
        return torch.autograd.grad(op(True), (q, k, v), dout)

    def twin_step(_):
        return torch.autograd.grad(twin(True), (q, k, v), dout)

    times: dict = {}
    for _ in range(args.rounds):
        for name, fn in (("op", op), ("twin", twin), ("op fwd+bwd", op_step), ("twin fwd+bwd", twin_step)):
            for grad in ((False, True) if "bwd" not in name else (True,)):
                for _ in range(20):
                    fn(grad)
                t = time.perf_counter()
                for _ in range(args.n):
                    fn(grad)
                times.setdefault((name, grad), []).append((time.perf_counter() - t) / args.n * 1e6)
    for (name, grad), us in times.items():
        print(f"{name:12s} grad={grad!s:5s}: median {statistics.median(us):6.1f} us, min {min(us):6.1f} us per call")


if __name__ == "__main__":
    main()
