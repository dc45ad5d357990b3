"""`python -m fa_backend demo`: a small GPT routed through fa_backend, with a routing report.

The model (random weights, nothing downloaded) calls `F.scaled_dot_product_attention` like any
model does. The demo runs forward + backward three times: with routing disabled (the reference),
routed in eager mode, and routed under torch.compile(fullgraph=True); then prints what ran where,
every fallback and why, and the largest difference to the reference.

On a GPU the fused Triton path runs (bf16). On a CPU everything falls back to PyTorch, with the
reasons; with TRITON_INTERPRET=1 set before the run, the Triton kernels run in the interpreter
(fp16, slow). `python -m fa_backend demo --kernels` compares the kernels with PyTorch directly.
"""

from __future__ import annotations

import argparse
import math

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, dim = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, dim // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, dim))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 512, dim: int = 256, heads: int = 4, layers: int = 2, max_len: int = 4096):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _step(model, tokens, targets, run=None):
    """Forward + backward of `run` (default: the model itself; e.g. its compiled version)."""
    model.zero_grad(set_to_none=True)
    logits = (model if run is None else run)(tokens)
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    loss.backward()
    return logits.detach().float(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def _max_diff(a, b):
    logits = (a[0] - b[0]).abs().max().item()
    grads = max((a[1][n] - b[1][n]).abs().max().item() for n in a[1])
    return logits, grads


def routing_demo() -> int:
    import fa_backend
    from fa_backend.dispatch.backends import triton as triton_backend

    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    if gpu:
        dtype, cfg, batch, seq, compile_backend = torch.bfloat16, dict(dim=512, heads=8, layers=4), 4, 1024, "inductor"
    else:
        dtype = torch.float16 if triton_backend.INTERPRETER else torch.float32
        cfg, batch, seq, compile_backend = dict(dim=128, heads=4, layers=2), 2, 64, "aot_eager"
    torch.manual_seed(0)
    model = TinyGPT(**cfg).to(device, dtype)
    tokens = torch.randint(0, 512, (batch, seq), device=device)
    targets = torch.randint(0, 512, (batch, seq), device=device)
    where = torch.cuda.get_device_name() if gpu else "CPU" + (" (Triton interpreter)" if triton_backend.INTERPRETER else "")
    print(f"fa_backend {fa_backend.__version__} | torch {torch.__version__} | {where}")
    print(f"TinyGPT: {cfg['layers']} layers, dim {cfg['dim']}, {cfg['heads']} heads (d={cfg['dim'] // cfg['heads']}), "
          f"batch {batch}, seqlen {seq}, {str(dtype).replace('torch.', '')}; forward + backward\n")

    reference = _step(model, tokens, targets)
    fa_backend.reset_stats()
    with fa_backend.enabled():
        eager = _step(model, tokens, targets)
        eager_stats = fa_backend.stats()
        fa_backend.reset_stats()
        compiled_model = torch.compile(model, fullgraph=True, backend=compile_backend)
        compiled = _step(model, tokens, targets, run=compiled_model)
        compiled_stats = fa_backend.stats()

    head_dim = cfg["dim"] // cfg["heads"]
    q = torch.empty(batch, cfg["heads"], seq, head_dim, device=device, dtype=dtype)
    print("Routing decision for the model's attention call (fa_backend.explain):")
    print(fa_backend.explain(q, q, q, is_causal=True))
    print(f"\neager:    runs {eager_stats['runs']}")
    print(f"          fallback reasons counted {eager_stats['fallbacks'] or '{}'}")
    print(f"compiled: runs {compiled_stats['runs']} (backend={compile_backend}, fullgraph=True)")
    print(f"          decisions taken while tracing {compiled_stats['traced']}")
    worst = 0.0
    for name, result in (("eager", eager), ("compiled", compiled)):
        d_logits, d_grads = _max_diff(result, reference)
        scale = max(reference[0].abs().max().item(), 1e-6)
        worst = max(worst, d_logits / scale)
        print(f"max |routed - unrouted| {name:8}: logits {d_logits:.3e} (relative {d_logits / scale:.2e}), "
              f"parameter grads {d_grads:.3e}")
    return 0 if math.isfinite(worst) and worst < 5e-2 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fa_backend demo", description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", action="store_true", help="compare the kernels with PyTorch directly")
    args = parser.parse_args(argv)
    if args.kernels:
        from .demo_kernels import main as kernels_main

        return kernels_main()
    return routing_demo()


if __name__ == "__main__":
    sys.exit(main())
