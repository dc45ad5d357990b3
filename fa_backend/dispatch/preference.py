"""Measured speed preferences: where a lower-priority backend is known to be faster.

The default order tries our kernels first. A rule here says that on some GPU, for some class of
calls, PyTorch's own fused kernel has been measured faster than one of ours; the dispatcher then
passes over ours for that call with reason `slower` (and the measurement in the message), so that
enabling fa_backend never makes such a call slower. Rules are data: each names the call class, the
backend passed over, the one that runs, and the evidence. An explicit `sdpa_backends([...])` order
is the user's and is followed as given.

Rules read metadata only. In eager mode the router also asks PyTorch which kernel it would pick
for the actual tensors (once per shape): if that is not the kernel the evidence is about (e.g. cuDNN
refuses this mask layout), our kernel runs after all. Compiled code cannot ask, and follows the rule.

Two kinds of evidence: kernel speed on a given GPU (cuDNN on the H200), and host time per call, which
decides host-bound calls on any GPU (PyTorch's C++ path launches a tiny call in less host time than our
Python launcher).
"""

from __future__ import annotations

import dataclasses

import torch

from .call import AttentionCall
from .reasons import Reason, ReasonCode


@torch.compiler.assume_constant_result
def _cudnn_sdp_usable() -> bool:
    """Whether PyTorch may pick its cuDNN SDPA kernel: its switch is on and deterministic algorithms (unless
    warn-only) do not rule it out, as PyTorch's own check_cudnn_deterministic does (read once per trace: Dynamo
    cannot trace the C getters). Under torch.use_deterministic_algorithms the cuDNN rules therefore pass nothing
    over, and our kernels (deterministic backwards) run."""
    if not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    return not (torch._C._get_deterministic_algorithms() and not torch._C._get_deterministic_algorithms_warn_only())


# PyTorch's fused kernels (what pytorch_choice names them) that run without our per-call Python.
FUSED_CHOICES = frozenset({"flash_attention", "efficient_attention", "cudnn_attention"})


@dataclasses.dataclass(frozen=True)
class FasterPeer:
    """PyTorch's `kernel` beats our `backend` on calls of this class (None: any value of that field)."""

    backend: str
    kernel: str
    capabilities: frozenset[tuple[int, int]] | None
    dtypes: frozenset[torch.dtype]
    head_dims: frozenset[int] | None
    evidence: str
    masks: bool = False  # also calls with an attn_mask (bool or additive)
    dropout: bool = False  # also calls with dropout_p > 0
    dropout_only: bool = False  # only calls with dropout_p > 0
    mask_only: bool = False  # only calls with an attn_mask
    max_fwd_flops: int | None = None  # only calls with fewer forward FLOPs (fwd_flops)
    max_kv_bytes: int | None = None  # only calls reading fewer bytes of K and V (kv_bytes)
    max_seqlen_q: int | None = None  # only calls with at most this many queries
    min_seqlen_q: int | None = None  # only calls with at least this many queries
    max_seqlen_k: int | None = None  # only calls with at most this many keys
    gqa: bool = False  # also calls with hq != hkv
    gqa_only: bool = False  # only calls with hq != hkv
    causal_only: bool = False  # only calls with is_causal
    non_causal_only: bool = False  # only calls without is_causal
    grad_only: bool = False  # only calls that need gradients (the evidence is about forward + backward)
    no_grad_only: bool = False  # only calls that need no gradients (the evidence is about the forward)
    choices: frozenset[str] = frozenset({"cudnn_attention"})  # PyTorch's own picks the evidence is about
    head_dim_v: int | None = None  # only calls with this V head dim (None: calls whose V head dim is head_dim)
    unless_keep_bits: bool = False  # not calls whose CuTe forward saves its dropout keep bits (saves_keep_bits)

    def applies(self, call: AttentionCall) -> bool:
        return (call.device_type == "cuda" and (self.capabilities is None or call.capability in self.capabilities)
                and call.dtype in self.dtypes
                and call.head_dim_v == (call.head_dim if self.head_dim_v is None else self.head_dim_v)
                and (self.head_dims is None or call.head_dim in self.head_dims)
                and (call.mask_kind == "none" or self.masks) and (call.dropout_p == 0.0 or self.dropout)
                and (call.dropout_p > 0.0 or not self.dropout_only)
                and (call.mask_kind != "none" or not self.mask_only)
                and (call.heads_q == call.heads_kv or self.gqa or self.gqa_only)
                and (call.heads_q != call.heads_kv or not self.gqa_only)
                and (call.is_causal or not self.causal_only)
                and (not call.is_causal or not self.non_causal_only)
                and (call.requires_grad or not self.grad_only)
                and (not call.requires_grad or not self.no_grad_only)
                and not (call.is_causal and call.seqlen_q != call.seqlen_k)
                and call.shapes_consistent and not call.subclass
                and (self.max_seqlen_q is None or call.seqlen_q <= self.max_seqlen_q)
                and (self.min_seqlen_q is None or call.seqlen_q >= self.min_seqlen_q)
                and (self.max_seqlen_k is None or call.seqlen_k <= self.max_seqlen_k)
                and (self.max_fwd_flops is None or fwd_flops(call) < self.max_fwd_flops)
                and (self.max_kv_bytes is None or kv_bytes(call) < self.max_kv_bytes)
                and not (self.unless_keep_bits and saves_keep_bits(call))
                and (self.choices != CUDNN_ONLY or _cudnn_sdp_usable()))

    def reason(self) -> Reason:
        return Reason(ReasonCode.SLOWER, f"PyTorch's {self.kernel} kernel is faster here ({self.evidence}); "
                                         f"force ours with fa_backend.sdpa_backends(['{self.backend}', ...])")


CUDNN_ONLY = frozenset({"cudnn_attention"})


# The saved-keep-bits backward was timed from 2k tokens (docs/benchmarks.md, "Saved keep bits")
KEEP_BITS_MIN_SEQLEN = 2048
# the periods of saved rows of tiles (kernels/keep_bits.KEEP_PERIODS) whose backward was timed against cuDNN's: every
# row (2k-8k, H200; 16k causal in the causal layout, thirty-fifth session, H100: 1.30x), every second (16k) and fourth
# (32k; thirty-fourth session, H100: the op's backward 1.15-1.21x / 1.06-1.15x cuDNN's dropout backward;
# docs/benchmarks.md "Masks and dropout")
ROUTED_KEEP_PERIODS = frozenset({1, 2, 4})


def saves_keep_bits(call: AttentionCall) -> bool:
    """Whether the CuTe op would save this dropout call's keep bits for its backward (ops/cute_flash.save_keep_bits:
    gradients, d = dv = 128, no mask, within kernels/keep_bits.KEEP_BITS_BUDGET, no deterministic algorithms),
    for an MHA call of at least KEEP_BITS_MIN_SEQLEN queries at a period of ROUTED_KEEP_PERIODS (what was timed)."""
    from ..kernels.keep_bits import causal_offset, keep_period

    diagonal = causal_offset(call.seqlen_q, call.seqlen_k, call.is_causal, call.causal_alignment == "bottom_right")
    return (call.dropout_p > 0.0 and call.requires_grad and call.mask_kind == "none" and call.head_dim == 128
            and call.head_dim_v == 128 and call.heads_q == call.heads_kv and call.seqlen_q >= KEEP_BITS_MIN_SEQLEN
            and call.scale != 0.0 and not torch.are_deterministic_algorithms_enabled()
            and keep_period(call.batch, call.heads_q, call.heads_kv, call.seqlen_q, call.seqlen_k, call.head_dim,
                            call.head_dim_v, call.dtype.itemsize, diagonal) in ROUTED_KEEP_PERIODS)


def fwd_flops(call: AttentionCall) -> int:
    """Forward FLOPs of the call without causal savings: 2 * b * hq * sq * sk * (d + dv)."""
    return 2 * call.batch * call.heads_q * call.seqlen_q * call.seqlen_k * (call.head_dim + call.head_dim_v)


def kv_bytes(call: AttentionCall) -> int:
    """Bytes of K and V the call reads once: b * hkv * sk * (d + dv) * itemsize."""
    return call.batch * call.heads_kv * call.seqlen_k * (call.head_dim + call.head_dim_v) * call.dtype.itemsize


# Below both a call is host-bound: a few µs of GPU work (2**30 FLOPs at ~400 TFLOP/s, 8 MiB at ~3 TB/s),
# less than the host time per call our Triton path costs beyond PyTorch's C++ path (tens of µs:
# docs/benchmarks.md, "Host overhead").
TINY_FWD_FLOPS = 1 << 30
TINY_KV_BYTES = 1 << 23

# The GQA rules' evidence is about dense calls (seqlen 2k / 8k); short-query (decode-sized, sq <= 16) GQA calls
# were measured separately and keep their own rules.
DENSE_MIN_SEQLEN_Q = 17

PREFERENCES: tuple[FasterPeer, ...] = (
    # docs/benchmarks.md, "nn modules with routing on" (H200, torch 2.11): one tiny call (b=1, s=16, d=32)
    # through our Triton kernel took 250 µs per nn.MultiheadAttention call against 74 µs on PyTorch's path;
    # "Host overhead": our op 89.5 µs of host time per call, PyTorch's SDPA 18.4 µs. Any GPU: host cost.
    FasterPeer(backend="triton", kernel="fused SDPA", capabilities=None,
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=None, masks=True, dropout=True, gqa=True,
               max_fwd_flops=TINY_FWD_FLOPS, max_kv_bytes=TINY_KV_BYTES, choices=FUSED_CHOICES,
               evidence=f"a host-bound call (under {TINY_FWD_FLOPS:.2e} forward FLOPs and {TINY_KV_BYTES >> 20} MiB "
                        "of K and V): PyTorch's C++ path costs less host time per call than our Triton launch"),
    # The H200 runs of docs/benchmarks.md (torch 2.11, triton 3.6): PyTorch picks cuDNN for these calls
    # on sm90 and it ran 1.06-1.43x our Triton forward and 1.23-1.69x our backward (d=64/128,
    # seqlen 512-16k), and was faster inside nn.MultiheadAttention at seqlen 128 too. d=96
    # (scripts/bench_cute.py, bf16, seqlen 2k / 8k, 2026-11-30): 1.24-1.37x forward, 1.55-1.63x backward. d=192 / 256
    # (docs/benchmarks.md, "Head dims 192 and 256 on the CuTe forward", bf16, seqlen 2k / 8k, 2026-12-01): 1.42-1.97x
    # forward, 1.99-2.55x backward. Since then (H100, thirty-seventh and thirty-ninth sessions, the split-column
    # kernels) cuDNN runs 0.95-1.07x our d=192 backward without a causal mask (1.18-1.39x with one) but still
    # 1.28-1.68x its forward, and 1.77-2.02x our d=256 backward (1.23-1.71x since the forty-fifth session's dQ from
    # dS^T, 1.18-1.38x with the forty-sixth's dq_from_ds kernel, H100): the rule stands.
    FasterPeer(backend="triton", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({64, 96, 128, 192, 256}),
               evidence="H200, torch 2.11: cuDNN 1.06-1.43x our Triton forward, 1.23-1.69x backward (d=64 / 128; "
                        "d=96: 1.24-1.37x, 1.55-1.63x; d=192 / 256: 1.42-1.97x, 1.99-2.55x)"),
    # MLA's head dims (q / k 192, v 128; docs/benchmarks.md "Unequal head dims", bf16, seqlen 2k-16k, seventeenth
    # session): cuDNN 1.58-1.81x our Triton forward, 1.86-3.03x its backward. (On sm90 the CuTe kernels come first.)
    # GQA at this pair was timed for cuDNN and the CuTe kernels only (16:4, seqlen 2k / 8k): cuDNN within 3 % of its
    # MHA figures.
    FasterPeer(backend="triton", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({192}), head_dim_v=128,
               gqa=True, min_seqlen_q=DENSE_MIN_SEQLEN_Q,
               evidence="H200, torch 2.11, bf16, q / k head dim 192 and v 128, seqlen 2k-16k: cuDNN 1.58-1.81x our "
                        "Triton forward, 1.86-3.03x its backward"),
    # docs/benchmarks.md, "Masks and dropout" (H200, torch 2.11, bf16, d=128, seqlen 2k-16k): with dropout 0.1
    # cuDNN ran 1.42-1.46x our Triton forward and 2.42-2.55x our backward (ninth session: 0.99-1.01x forward,
    # 1.96-2.08x backward). Calls with only a mask are not in the rule: ours skips what the mask hides
    # (kernels/triton/_mask_bounds.py) and ran (ninth session) an explicit causal mask at 1.85-2.82x cuDNN forward /
    # 1.83-2.34x backward, a right-padding key mask at 1.35-1.91x / 1.18-1.59x, and a mask without block structure
    # (a random 10 % of the keys) at 1.04-1.12x / 0.94-0.96x, which metadata cannot tell apart (force cuDNN for
    # such masks with fa_backend.sdpa_backends(['torch'])).
    FasterPeer(backend="triton", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({128}), masks=True,
               dropout=True, dropout_only=True,
               evidence="H200, torch 2.11, d=128, dropout 0.1: cuDNN 1.42-1.46x our Triton forward and "
                        "2.42-2.55x backward"),
    # GQA (enable_gqa=True), which PyTorch 2.11 also gives to cuDNN on sm90 (docs/benchmarks.md, "GQA on sm90: cuDNN
    # or ours", H200, bf16, hq:hkv 16:4 at d=128, 32:4 at d=64, 10:2 / 8:2 at d=192 / 256, seqlen 2k / 8k,
    # 2026-12-01): cuDNN ran 1.06-1.82x our Triton forward and 1.29-2.44x our backward.
    FasterPeer(backend="triton", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({64, 128, 192, 256}),
               gqa_only=True,
               min_seqlen_q=DENSE_MIN_SEQLEN_Q,
               evidence="H200, torch 2.11, bf16, GQA, seqlen 2k / 8k: cuDNN 1.06-1.82x our Triton forward, "
                        "1.29-2.44x backward (d=64 / 128 / 192 / 256)"),
    # Short-query calls with a mask (decode steps, sq <= 16) stay on cuDNN as before the rule above dropped
    # masks: the block bounds are the dense kernels' (a decode step has one query block), and our split-KV
    # decode kernel ran at 0.25-2.33x cuDNN eager and 0.97-1.13x as graph replays without a mask ("Decode (KV
    # cache)"); with one it reads the mask too.
    FasterPeer(backend="triton", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({128}), masks=True,
               mask_only=True, gqa=True, max_seqlen_q=16,
               evidence="H200, torch 2.11, d=128, short queries: our split-KV decode kernel 0.25-2.33x cuDNN "
                        "eager (host-bound) and 0.97-1.13x as graph replays, without a mask"),
    # docs/benchmarks.md, "nn modules with routing on" (H200, torch 2.11, bf16, E=512 with 16 heads, d=32,
    # seqlen 128-2048, two runs): with our Triton kernel, eval 0.28-1.08x of routing off (MHA 0.37-0.57x at
    # seqlen 128-512, 0.92-1.08x at 2048; encoder layer 0.28-0.52x) and training 0.80-0.99x; restricted to
    # PyTorch's kernel, eval 0.86-1.22x in the later run. At seqlen 8192 ours was faster (1.01-1.33x).
    FasterPeer(backend="triton", kernel="fused SDPA", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({32}), max_seqlen_k=2048,
               choices=FUSED_CHOICES,
               evidence="H200, torch 2.11, d=32, seqlen <= 2048: with our Triton kernel nn modules ran at "
                        "0.28-1.08x (eval) and 0.80-0.99x (training) of PyTorch's path"),
    # docs/benchmarks.md, "Decode (KV cache)" (H200, torch 2.11, bf16, hq=32, hkv 8 and 32, d=128, one query,
    # no mask): since the fused split merge our split-KV decode kernel runs at 0.97-1.13x cuDNN's speed as
    # CUDA-graph replays, but eager calls are host-bound at 0.25-2.33x, and a rule reads
    # metadata only: it cannot tell a replayed graph from an eager call, so the class stays with cuDNN.
    # Routed decode calls look up rules for "triton_decode" first (dispatch/select.py), then the "triton"
    # rules above.
    FasterPeer(backend="triton_decode", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({128}), gqa=True,
               max_seqlen_q=1,
               evidence="H200, torch 2.11, bf16, hq=32, d=128, one query token: our split-KV decode kernel "
                        "0.25-2.33x cuDNN in eager calls (host-bound), 0.97-1.13x as CUDA-graph replays"),
)


# The CuTe forward (issue 7). Host-bound calls: as for "triton" above (its runner converts each tensor with
# from_dlpack on every call). cuDNN, MHA at d=64 / 128: the rules after it. GQA: the rules below.
CUTE_PREFERENCES: tuple[FasterPeer, ...] = (
    dataclasses.replace(PREFERENCES[0], backend="cute",
                        evidence=f"a host-bound call (under {TINY_FWD_FLOPS:.2e} forward FLOPs and "
                                 f"{TINY_KV_BYTES >> 20} MiB of K and V): PyTorch's C++ path costs less host time "
                                 "per call than our CuTe runner"),
    # MHA at d=64 / 128 (docs/benchmarks.md, "Three consumers in ping-pong", scripts/bench_cute.py, H200, torch 2.11,
    # bf16, seqlen 2k / 8k, two device calls of the nineteenth session, the op's variants): the CuTe forward at d=64
    # 1.02-1.04x cuDNN's (2k) and 1.12-1.14x (8k) without a causal mask, 0.90-0.96x and 1.05-1.06x with one (1.04-1.15x
    # at 2k-16k, causal and not, in the twenty-eighth session's run). Its backward was 0.99-1.03x cuDNN's until the
    # twenty-eighth session (LSE / delta by warp shuffles): 1.07-1.12x at 2k-16k, and a routed training step with our
    # kernels forced 1.10-1.13x routing off (cuDNN) at 2k / 4k / 8k, causal and not (docs/benchmarks.md, "The d=64
    # backward's rows by warp shuffles"): d=64 calls from 2k tokens run ours with gradients too; shorter ones, with
    # gradients or without, were not timed and stay on cuDNN (and causal ones below 8k without gradients until the
    # twenty-fifth session, see below).
    # d=128 (docs/benchmarks.md, "The backward's rows once per column, the forward's masked blocks apart", twenty-first
    # session, 2026-12-02): forward 0.99-1.00x cuDNN's at 2k and 1.04x at 8k without a causal mask, 1.04x / 1.11x with
    # one; backward through the op 1.05x / 1.08x causal, 1.04x / 0.97x without (the kernel alone 1.05-1.06x). Causal
    # training calls from 2k run ours (a step 1.05x / 1.09x cuDNN's, from the two runs' times), non-causal ones stay on
    # cuDNN (a step 1.03x / 0.99x); calls without gradients run ours causal from 2k, non-causal from 8k. Shorter calls
    # were not timed.
    FasterPeer(backend="cute", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({64}), grad_only=True,
               max_seqlen_q=2047,
               evidence="H200, torch 2.11, bf16, d=64: our CuTe backward not timed below 2k tokens (from 2k, where "
                        "ours runs: backward 1.07-1.12x cuDNN's, a training step 1.10-1.13x)"),
    FasterPeer(backend="cute", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({128}), grad_only=True,
               non_causal_only=True,
               evidence="H200, torch 2.11, bf16, d=128 without a causal mask, seqlen 2k / 8k: our CuTe backward "
                        "0.97-1.04x cuDNN's through the op, a training step about on par (0.99-1.03x)"),
    FasterPeer(backend="cute", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({128}), causal_only=True,
               max_seqlen_q=2047,
               evidence="H200, torch 2.11, bf16, causal d=128: our CuTe kernels not timed below 2k tokens (from 2k, "
                        "where ours runs: forward 1.04-1.11x cuDNN's, backward 1.05-1.08x)"),
    FasterPeer(backend="cute", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({128}), no_grad_only=True,
               non_causal_only=True, max_seqlen_q=8191,
               evidence="H200, torch 2.11, bf16, d=128 without a causal mask, seqlen 2k: our CuTe forward 0.99-1.00x "
                        "cuDNN's (1.04x at 8k, where ours runs)"),
    # (causal d=64 calls without gradients from 2k run ours since the twenty-fifth session: its consumers pass the
    # key blocks past their own diagonal, and the forward ran 1.04x / 1.08x / 1.12x cuDNN's at 2k / 4k / 8k in one
    # process, docs/benchmarks/h200_cute_fwd_own_ranges_ab.json)
    FasterPeer(backend="cute", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({64}), no_grad_only=True,
               max_seqlen_q=2047,
               evidence="H200, torch 2.11, bf16, d=64: our CuTe forward not timed below 2k tokens (1.02-1.04x cuDNN's "
                        "at 2k without a causal mask, 1.04x with one, where ours runs)"),
    # d=256, MHA and GQA (docs/benchmarks.md, "CuTe backward at d=192 / 256", the run after the branch-free P^T,
    # 2026-12-01, seqlen 2k / 8k): the CuTe forward at 0.78-1.03x cuDNN's, the backward at 0.99-1.17x. A training
    # step without a causal mask ran 1.00-1.14x cuDNN's (ours), with one 0.94-1.06x: cuDNN keeps calls without
    # gradients and causal ones.
    FasterPeer(backend="cute", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({256}), gqa=True,
               no_grad_only=True, min_seqlen_q=DENSE_MIN_SEQLEN_Q,
               evidence="H200, torch 2.11, bf16, d=256, seqlen 2k / 8k: cuDNN 0.97-1.28x our CuTe forward (calls "
                        "with gradients and no causal mask run ours: a training step 1.00-1.14x cuDNN's)"),
    FasterPeer(backend="cute", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({256}), gqa=True,
               causal_only=True, min_seqlen_q=DENSE_MIN_SEQLEN_Q,
               evidence="H200, torch 2.11, bf16, causal d=256, seqlen 2k / 8k: cuDNN 1.10-1.28x our CuTe forward, a "
                        "training step 0.94-1.06x ours"),
    # d=192: the CuTe backward at 1.10-1.31x cuDNN's, a training step 1.05-1.24x (same section): cuDNN keeps the
    # calls without gradients only, whose forward it runs 1.02-1.30x faster.
    FasterPeer(backend="cute", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({192}), no_grad_only=True,
               evidence="H200, torch 2.11, bf16, d=192, seqlen 2k-8k: cuDNN 1.02-1.30x our CuTe forward (calls with "
                        "gradients run ours: a training step 1.05-1.24x cuDNN's)"),
    # GQA (docs/benchmarks.md, "GQA on sm90: cuDNN or ours", H200, bf16, seqlen 2k / 8k, 2026-12-01): at d=192 / 256
    # cuDNN ran 0.98-1.30x our CuTe forward and 1.97-2.42x our backward (then Triton's); at d=64 / 128, causal,
    # 1.00-1.24x the CuTe forward and 1.05-1.10x the CuTe backward. Non-causal GQA at d=64 / 128 stays ours: forward
    # 0.95-1.14x, backward 0.94-0.99x, a training step 0.95-1.01x.
    # GQA at d=192 since flash_bwd_wide (docs/benchmarks.md, "CuTe backward at d=192 / 256", 10:2, 2k / 8k): the
    # CuTe backward 1.22-1.34x cuDNN's, a training step 1.11-1.25x; calls without gradients stay on cuDNN.
    FasterPeer(backend="cute", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({192}), gqa_only=True,
               no_grad_only=True, min_seqlen_q=DENSE_MIN_SEQLEN_Q,
               evidence="H200, torch 2.11, bf16, GQA, d=192, seqlen 2k / 8k: cuDNN 1.02-1.28x our CuTe forward "
                        "(calls with gradients run ours: a training step 1.11-1.25x cuDNN's)"),
    FasterPeer(backend="cute", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({64, 128}), gqa_only=True,
               causal_only=True, min_seqlen_q=DENSE_MIN_SEQLEN_Q,
               evidence="H200, torch 2.11, bf16, causal GQA, d=64 / 128, seqlen 2k / 8k: cuDNN 1.00-1.24x our CuTe "
                        "forward, 1.05-1.10x our CuTe backward"),
    # Dropout (sixteenth session): the CuTe forward drops in the kernel, at 1.09-1.40x cuDNN's dropout forward; the
    # backward that draws the mask again, the CuTe one at d=128 (0.62-0.69x cuDNN's dropout backward) and the Triton
    # kernels' elsewhere (0.48-0.51x at d=128), is slower: calls with gradients go to cuDNN (docs/benchmarks.md,
    # "Masks and dropout", d=128, p=0.1, seqlen 2k-16k: a training step about 0.8x cuDNN's at 2k). Except (twenty-
    # second session) MHA calls from 2k tokens whose forward saves the keep bits (saves_keep_bits): the CuTe backward
    # that reads them ran 1.03-1.12x cuDNN's dropout backward, a training step 1.03-1.13x cuDNN's (2k-8k; at 16k the
    # bits exceed the memory budget: since the thirty-fourth session every second row of tiles is saved there, every
    # fourth at 32k, and the backward draws the rest).
    FasterPeer(backend="cute", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({64, 96, 128, 192, 256}),
               masks=True, dropout=True, dropout_only=True, grad_only=True, gqa=True, unless_keep_bits=True,
               evidence="H200, torch 2.11, d=128, dropout 0.1: cuDNN's dropout backward 1.45-1.61x the CuTe one "
                        "that draws the mask again (1.96-2.08x the Triton one that the other head dims run; calls "
                        "whose keep bits are saved run ours)"),
    # MLA's head dims, q / k 192 and v 128 (scripts/bench_head_dim_v.py --backward, docs/benchmarks.md "Unequal head
    # dims", bf16, 16 heads, seqlen 2k-16k, seventeenth session): without a causal mask the CuTe kernels run a training
    # step 1.17-1.28x cuDNN's (forward 1.07-1.13x, backward 1.18-1.34x); with one, cuDNN's backward is 1.17-1.27x ours
    # (a training step 1.09-1.24x ours) and its forward 1.15x ours at 2k (ours 1.06-1.19x at 8k / 16k). GQA 16:4 (2k /
    # 8k, h200_head_dim_v_gqa.json) alike: non-causal, our step 1.27x cuDNN's; causal, cuDNN's step 1.06-1.14x ours,
    # its forward 1.19x ours at 2k.
    FasterPeer(backend="cute", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({192}), head_dim_v=128,
               causal_only=True, grad_only=True, gqa=True, min_seqlen_q=DENSE_MIN_SEQLEN_Q,
               evidence="H200, torch 2.11, bf16, causal, q / k head dim 192 and v 128, seqlen 2k-16k: cuDNN's training "
                        "step 1.09-1.24x ours (GQA 16:4: 1.06-1.14x; its backward 1.10-1.27x ours)"),
    FasterPeer(backend="cute", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({192}), head_dim_v=128,
               causal_only=True, no_grad_only=True, max_seqlen_q=2048, gqa=True, min_seqlen_q=DENSE_MIN_SEQLEN_Q,
               evidence="H200, torch 2.11, bf16, causal, q / k head dim 192 and v 128, seqlen 2k: cuDNN's forward "
                        "1.15x ours (GQA 16:4: 1.19x; ours 1.06-1.19x cuDNN's at 8k / 16k)"),
    # d=96 (scripts/bench_cute.py, bf16, seqlen 2k / 8k, 2026-11-30): the CuTe forward at 0.97-1.14x cuDNN's (calls
    # without gradients stay ours), the CuTe backward through the op at 0.80-0.87x (cuDNN 1.16-1.25x).
    FasterPeer(backend="cute", kernel="cuDNN", capabilities=frozenset({(9, 0)}),
               dtypes=frozenset({torch.float16, torch.bfloat16}), head_dims=frozenset({96}), grad_only=True,
               evidence="H200, torch 2.11, bf16, d=96, seqlen 2k-8k: cuDNN's backward 1.16-1.25x our CuTe "
                        "backward (our forward 0.97-1.14x cuDNN's)"),
)
PREFERENCES = PREFERENCES + CUTE_PREFERENCES


def peer_for(backend: str, call: AttentionCall) -> FasterPeer | None:
    """The rule that passes over an eligible `backend` for this call, or None."""
    for rule in PREFERENCES:
        if rule.backend == backend and rule.applies(call):
            return rule
    return None


def slower_than_peer(backend: str, call: AttentionCall) -> Reason | None:
    """The reason to pass over an eligible `backend` for this call, or None."""
    rule = peer_for(backend, call)
    return None if rule is None else rule.reason()


__all__ = ["FUSED_CHOICES", "PREFERENCES", "TINY_FWD_FLOPS", "TINY_KV_BYTES", "FasterPeer", "fwd_flops", "kv_bytes",
           "peer_for", "slower_than_peer"]
