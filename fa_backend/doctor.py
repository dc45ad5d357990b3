"""`python -m fa_backend doctor`: what this machine has, which backends can run, routing status.

The kernel check compiles and runs each installed kernel once on a tiny input (forward and
backward) and compares it with PyTorch's float32 math; on a machine without a GPU it runs only
when Triton's interpreter is on (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import importlib.metadata
import platform
import sys
import time

import torch


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _hardware() -> list[str]:
    if not torch.cuda.is_available():
        return ["GPU: none visible to torch (CUDA available: no)"]
    lines = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"GPU {i}: {p.name}, compute capability {p.major}.{p.minor}, {p.multi_processor_count} SMs, "
                     f"{p.total_memory / 2**30:.0f} GiB")
    return lines


def _error_vs_math(out: torch.Tensor, grads, q, k, v) -> float:
    """Max abs difference of a causal call's output and its (sum of squares) gradients from float32 math."""
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_in, is_causal=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), ref_in)
    return max([(out.float() - ref).abs().max().item()] + [(g.float() - r).abs().max().item()
                                                           for g, r in zip(grads, ref_grads)])


def _check_triton() -> str:
    """Compile and run the Triton kernels once (fwd + bwd) and compare with float32 math."""
    from .dispatch.backends import triton as triton_backend

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not triton_backend.INTERPRETER:
        return "skipped: no GPU (set TRITON_INTERPRET=1 to run it in Triton's CPU interpreter)"
    import fa_backend

    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 64, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    t0 = time.perf_counter()
    try:
        out = fa_backend.attention(q, k, v, is_causal=True)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    except Exception as e:  # report, do not crash: the doctor's job is to say what is wrong
        return f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    seconds = time.perf_counter() - t0
    err = _error_vs_math(out, grads, q, k, v)
    ok = err < (5e-2 if dtype == torch.bfloat16 else 1e-2)
    return (f"{'ok' if ok else 'WRONG'}: fwd+bwd on (1, 4, 64, 64) {str(dtype).replace('torch.', '')}, max error vs "
            f"float32 math {err:.1e}; first call incl. compile {seconds:.1f} s")


def _check_cute() -> str:
    """Compile and run the CuTe forward once (op fa_backend::cute_flash_fwd, backward through the Triton
    kernels) and compare with float32 math; skipped with the reason where the backend cannot run."""
    from .dispatch.backends.cute import CuteBackend
    from .dispatch.call import AttentionCall

    if not torch.cuda.is_available():
        return "skipped: no GPU"
    q, k, v = (torch.randn(1, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    reasons = CuteBackend.why_not(AttentionCall.from_tensors(q.detach(), k.detach(), v.detach(), is_causal=True))
    if reasons:
        return "skipped: " + "; ".join(str(r) for r in reasons)
    from .ops.cute_flash import cute_flash_attention

    t0 = time.perf_counter()
    try:
        out = cute_flash_attention(q, k, v, is_causal=True)[0]
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    except Exception as e:  # report, do not crash
        return f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
    seconds = time.perf_counter() - t0
    err = _error_vs_math(out, grads, q, k, v)
    return (f"{'ok' if err < 5e-2 else 'WRONG'}: fwd (+ Triton bwd) on (1, 4, 256, 64) bfloat16, max error vs float32 "
            f"math {err:.1e}; first call incl. compile {seconds:.1f} s")


def _provider_status() -> str:
    try:
        from .integrations import provider
    except ImportError:
        return "not available in this build"
    try:
        return "active" if provider.is_active() else "registered on demand (fa_backend.integrations.provider.activate())"
    except Exception as e:  # noqa: BLE001
        return f"unknown ({type(e).__name__}: {e})"


def report() -> str:
    import fa_backend
    from .dispatch.backends import BACKENDS
    from .dispatch.call import AttentionCall

    lines = [f"fa_backend {fa_backend.__version__}",
             f"python {platform.python_version()}, torch {torch.__version__}, triton {_version('triton')}, "
             f"CUDA {torch.version.cuda or 'none'}, nvidia-cutlass-dsl {_version('nvidia-cutlass-dsl')}"]
    lines += _hardware()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    probe = torch.empty(1, 8, 1024, 128, device=device, dtype=dtype)
    call = AttentionCall.from_tensors(probe, probe, probe, is_causal=True)
    lines.append(f"backends (asked about a {str(dtype).replace('torch.', '')} d=128 causal call on {device}):")
    for name, backend in BACKENDS.items():
        reasons = backend.why_not(call)
        status = "can run it" if not reasons else "no: " + "; ".join(str(r) for r in reasons)
        lines.append(f"  {name:7} {status}")
    lines.append(f"kernel check, triton: {_check_triton()}")
    lines.append(f"kernel check, cute: {_check_cute()}")
    s = fa_backend.stats()["routing"]
    lines.append(f"SDPA routing: enabled process-wide: {'yes' if s['enabled'] else 'no'}; active in this thread: "
                 f"{'yes' if s['active_in_this_thread'] else 'no'}; backend restriction: {s['allowed_backends']}")
    lines.append(f"PyTorch provider hook: {_provider_status()}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
