"""FlashAttention forward for Hopper (sm90a) in the CuTe DSL: fa_backend's first CuTe kernel.

The reference kernel: it passes tests/kernels/cute/test_flash_fwd_gpu.py on the H200 (2026-11-30: fp16 and
bf16, d 64 and 128, both causal alignments, GQA, partial tiles, strided inputs), at 0.39-0.73x of cuDNN's
forward (scripts/bench_cute.py). The dispatcher routes the warp-specialised kernel (flash_fwd_ws.py, op
fa_backend::cute_flash_fwd), not this one.

Deliberately simple, to be correct first (no warp specialisation, no pipelining, no overlap):
- one CTA = one warpgroup (128 threads) = one tile of TILE_M = 64 query rows of one (batch, head);
- TMA loads Q once and, per key block, K and V (TILE_N rows) into swizzled shared memory, one stage,
  completion tracked by an mbarrier; the CTA syncs before the next block overwrites K and V;
- S = Q K^T with wgmma (both operands in shared memory), online softmax in registers (log2 domain),
  O += P V with wgmma taking P from registers (the S accumulator layout is the A-operand layout);
- epilogue: O / l stored to global memory from registers (rows past seqlen_q skipped), LSE (natural
  log, fp32) per row; rows that see no key (bottom-right causal with seqlen_k < seqlen_q) get O = 0
  and LSE = -inf.

Layouts: q, o (b, hq, sq, d); k, v (b, hkv, sk, d): SDPA's layout with any strides whose head_dim
stride is 1 and whose other strides are multiples of 8 elements (TMA needs 16-byte aligned strides);
lse (b, hq, sq) fp32. GQA: query head h reads key/value head h // (hq // hkv).
Causal: top-left (key j visible to query i when j <= i) or bottom-right (j <= i + sk - sq).
The softmax scale must be positive (the row maximum is taken before scaling). Launch needs about
50 KB of shared memory at d = 128, above the 48 KB default: the DSL's launch opts in (it ran on the H200).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from ._compile_cache import CACHE, CompileKey, enable_dsl_disk_cache
from ._target import compile_options

enable_dsl_disk_cache()  # before the DSL's first compile in this process

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90  # noqa: E402
from cutlass import Float32  # noqa: E402
from cutlass.cute.nvgpu import cpasync, warpgroup  # noqa: E402
from cutlass.cute.runtime import make_fake_stream  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402
from cutlass.tensor_utils import LayoutEnum  # noqa: E402

from ._fwd_parts import (  # noqa: E402
    ForwardVariant, make_tiled_mmas, mask_scores, online_softmax, sdpa_views, store_rows)

KERNEL_NAME = "flash_fwd_sm90"
HEAD_DIMS = (64, 96, 128)
TILE_M = 64  # one warpgroup's wgmma M
TILE_N = 64
THREADS = 128
_LOG2E = math.log2(math.e)
_DTYPES = {torch.float16: cutlass.Float16, torch.bfloat16: cutlass.BFloat16}


class FlashForwardSm90(ForwardVariant):
    """Compile-time configuration (dtype, head_dim, causal and its alignment) of one kernel variant."""

    @cute.jit
    def __call__(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
                 scale_log2: Float32, stream: Any):
        d = self.head_dim
        q, k, v, o, lse = sdpa_views(mQ, mK, mV, mO, mLSE)

        mma_qk, mma_pv = make_tiled_mmas(self.dtype, TILE_M, TILE_N, d)
        sQ_layout = cute.slice_(sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (TILE_M, TILE_N, d), self.dtype, 1),
                                (None, None, 0))
        sK_layout = cute.slice_(sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (TILE_M, TILE_N, d), self.dtype, 1),
                                (None, None, 0))
        sV_layout = cute.slice_(sm90.make_smem_layout_b(LayoutEnum.COL_MAJOR, (TILE_M, d, TILE_N), self.dtype, 1),
                                (None, None, 0))
        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_tensor_q = cpasync.make_tiled_tma_atom(load, q, sQ_layout, (TILE_M, d))
        tma_k, tma_tensor_k = cpasync.make_tiled_tma_atom(load, k, sK_layout, (TILE_N, d))
        tma_v, tma_tensor_v = cpasync.make_tiled_tma_atom(load, v, sV_layout, (d, TILE_N))
        smem_bytes = 2 * (TILE_M + 2 * TILE_N) * d + 3 * 1024  # three tiles, alignment padding, barriers
        self.kernel(tma_q, tma_tensor_q, tma_k, tma_tensor_k, tma_v, tma_tensor_v, o, lse, scale_log2,
                    mma_qk, mma_pv, sQ_layout, sK_layout, sV_layout).launch(
            grid=(cute.ceil_div(q.shape[0], TILE_M), q.shape[2], q.shape[3]), block=(THREADS, 1, 1),
            smem=smem_bytes, stream=stream)

    @cute.kernel
    def kernel(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, scale_log2: Float32,
               mma_qk: cute.TiledMma, mma_pv: cute.TiledMma, sQ_layout: cute.ComposedLayout,
               sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout):
        d = self.head_dim
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        head_kv = head // (mQ.shape[2] // mK.shape[2])

        smem = SmemAllocator()
        bar_q = smem.allocate_array(cutlass.Int64, 1)  # Q has landed
        bar_kv = smem.allocate_array(cutlass.Int64, 1)  # K and V of the current key block have landed
        # 1024-byte alignment: the swizzle pattern of the wgmma operand layouts repeats every 1024 bytes
        sQ = smem.allocate_tensor(self.dtype, sQ_layout.outer, byte_alignment=1024, swizzle=sQ_layout.inner)
        sK = smem.allocate_tensor(self.dtype, sK_layout.outer, byte_alignment=1024, swizzle=sK_layout.inner)
        sV = smem.allocate_tensor(self.dtype, sV_layout.outer, byte_alignment=1024, swizzle=sV_layout.inner)
        if tidx == 0:
            cute.arch.mbarrier_init(bar_q, 1)
            cute.arch.mbarrier_init(bar_kv, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        one_cta = cute.make_layout(1)
        gQ = cute.local_tile(mQ[None, None, head, batch], (TILE_M, d), (m_block, 0))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (TILE_N, d), (None, 0))  # (TILE_N, d, key blocks)
        gV = cute.local_tile(mV[None, None, head_kv, batch], (d, TILE_N), (0, None))  # (d, TILE_N, key blocks)
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, one_cta, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one_cta, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one_cta, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        # warp 0 issues the loads: the DSL wraps each TMA copy in elect.sync over all 32 lanes, which a
        # one-thread branch would leave undefined; one elected lane arrives with the expected bytes
        producer_warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0
        if producer_warp:
            with cute.arch.elect_one():
                cute.arch.mbarrier_arrive_and_expect_tx(bar_q, TILE_M * d * 2)
            cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=bar_q)

        thr_qk, thr_pv = mma_qk.get_slice(tidx), mma_pv.get_slice(tidx)
        tSrQ = mma_qk.make_fragment_A(thr_qk.partition_A(sQ))
        tSrK = mma_qk.make_fragment_B(thr_qk.partition_B(sK))
        tOrV = mma_pv.make_fragment_B(thr_pv.partition_B(sV))
        # (row, col) within the tile of every accumulator value this thread holds
        tScS = thr_qk.partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))
        tScS0 = mma_qk.get_slice(0).partition_C(cute.make_identity_tensor((TILE_M, TILE_N)))  # thread 0's: static
        tOcO = thr_pv.partition_C(cute.make_identity_tensor((TILE_M, d)))
        acc_s = cute.make_rmem_tensor(tScS.shape, Float32)
        acc_o = cute.make_rmem_tensor(tOcO.shape, Float32)
        acc_o.fill(0.0)
        p_layout = mma_pv.make_fragment_A(thr_pv.partition_shape_A((TILE_M, TILE_N))).layout
        # two row halves per thread (_fwd_parts' accumulator convention); row_max in log2 units
        row_max = cute.make_rmem_tensor((2,), Float32)
        row_sum = cute.make_rmem_tensor((2,), Float32)
        row_max.fill(-math.inf)
        row_sum.fill(0.0)

        # keys visible to query row i: j < seqlen_k and, when causal, j <= i + offset
        offset = seqlen_k - seqlen_q if cutlass.const_expr(self.bottom_right) else 0
        n_blocks = cute.ceil_div(seqlen_k, TILE_N)
        if cutlass.const_expr(self.causal):
            n_blocks = cutlass.max(cutlass.min(n_blocks, cute.ceil_div((m_block + 1) * TILE_M + offset, TILE_N)), 0)
        cute.arch.mbarrier_wait(bar_q, 0)
        mma_pv.set(warpgroup.Field.ACCUMULATE, True)

        for n_block in cutlass.range(n_blocks, unroll=1):
            if producer_warp:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive_and_expect_tx(bar_kv, 2 * TILE_N * d * 2)
                cute.copy(tma_k, tKgK[None, n_block], tKsK, tma_bar_ptr=bar_kv)
                cute.copy(tma_v, tVgV[None, n_block], tVsV, tma_bar_ptr=bar_kv)
            cute.arch.mbarrier_wait(bar_kv, n_block % 2)

            # S = Q K^T
            mma_qk.set(warpgroup.Field.ACCUMULATE, False)
            warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                cute.gemm(mma_qk, acc_s, tSrQ[None, None, k], tSrK[None, None, k], acc_s)
                mma_qk.set(warpgroup.Field.ACCUMULATE, True)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            mask_scores(acc_s, tScS, tScS0, m_block * TILE_M, n_block * TILE_N, seqlen_k, offset, self.causal)
            online_softmax(acc_s, acc_o, row_max, row_sum, scale_log2)

            # O += P V, P from registers: the S accumulator's value order is the A operand's
            r_p = cute.make_rmem_tensor(acc_s.shape, self.dtype)
            r_p.store(acc_s.load().to(self.dtype))
            t_p = cute.make_tensor(r_p.iterator, p_layout)
            warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(t_p, mode=[2])):
                cute.gemm(mma_pv, acc_o, t_p[None, None, k], tOrV[None, None, k], acc_o)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            cute.arch.sync_threads()  # every warp is done with sK and sV before the next block's TMA

        # epilogue: O / l and the LSE (natural log); a row that saw no key gets O = 0 and LSE = -inf
        gO = cute.local_tile(mO[None, None, head, batch], (TILE_M, d), (m_block, 0))
        store_rows(acc_o, row_max, row_sum, tOcO, gO, mLSE, m_block * TILE_M, seqlen_q, head, batch, tidx % 32)

def _dynamic(t: torch.Tensor, align: int = 16) -> Any:
    """`t` as the compiled kernels take it: every size and stride a runtime value except the last mode's
    unit stride. Both the compile-time example arguments and the runner's arguments go through here: the
    compiled function trusts its callers to pass exactly the signature it was compiled for (a fake tensor
    with a static head_dim, passed dynamic tensors at run time, read Q as K on the H200, 2026-11-30)."""
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)


def compile_flash_fwd(dtype: torch.dtype, head_dim: int, causal: bool, bottom_right: bool = False,
                      arch: str = "sm_90a", dump_dir: str | None = None, pointer_args: bool = False) -> Any:
    """Compile one variant for symbolic shapes and strides (any batch, heads, seqlens; hq % hkv == 0).

    The compiled function takes (q, k, v, o, lse, scale * log2(e), stream); with `pointer_args`, the calling
    convention of _fast_call.PointerForward (pointers, sizes and strides) instead. Cached per variant in
    _compile_cache.CACHE (except with `dump_dir`, which always compiles, to write the PTX and cubin).
    """
    return _compile_variant(FlashForwardSm90, KERNEL_NAME, (TILE_M, TILE_N), dtype, head_dim, causal, bottom_right,
                            arch, dump_dir, pointer_args)


def _compile_variant(kernel_class: type, kernel_name: str, tile: tuple[int, ...], dtype: torch.dtype, head_dim: int,
                     causal: bool, bottom_right: bool, arch: str, dump_dir: str | None,
                     pointer_args: bool = False, key_mask: bool = False,
                     head_dims: tuple[int, ...] = HEAD_DIMS, dropout: bool = False, head_dim_v: int | None = None,
                     head_dim_pairs: frozenset[tuple[int, int]] = frozenset()) -> Any:
    """compile_flash_fwd for any forward kernel class taking (dtype, head_dim, causal, bottom_right) and the
    arguments (q, k, v, o, lse, scale_log2, stream); `kernel_name` and `tile` go into the cache key;
    `pointer_args`: the _fast_call.PointerForward convention, cached as kernel_name + "_ptrargs"; `key_mask`: the
    kernel also takes the packed key-mask words (b, hq, words) int32 after the stream (PointerForwardKeyMask);
    `head_dims`: the kernel class's head dims; `dropout`: the kernel takes dropout's arguments
    (PointerForwardDropout: the pointer convention only); `head_dim_v`: V's and O's head dim where it differs from
    head_dim (the class then takes it as a keyword), one of `head_dim_pairs`."""
    if dropout and not pointer_args:
        raise ValueError("dropout variants are compiled for the pointer calling convention (pointer_args=True)")
    if head_dim not in head_dims:
        raise ValueError(f"head_dim={head_dim} (supported: {', '.join(map(str, head_dims))})")
    dv = head_dim if head_dim_v is None else head_dim_v
    if dv != head_dim and (head_dim, dv) not in head_dim_pairs:
        raise ValueError(f"head_dim={head_dim} with head_dim_v={dv} (supported: equal, or (head_dim, head_dim_v) "
                         f"one of {sorted(head_dim_pairs)})")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype} (supported: torch.float16, torch.bfloat16)")
    cdtype = _DTYPES[dtype]

    def build() -> Any:
        # small host tensors as examples: only their dtype, rank and unit last stride reach the signature
        example = torch.empty(1, 1, 8, head_dim, dtype=dtype)
        q, k, v, o = (_dynamic(example) for _ in range(4))
        lse = _dynamic(torch.empty(1, 1, 8, dtype=torch.float32), align=4)
        kernel = (kernel_class(cdtype, head_dim, causal, bottom_right) if dv == head_dim else
                  kernel_class(cdtype, head_dim, causal, bottom_right, head_dim_v=dv))
        if pointer_args:
            from . import _fast_call

            wrapper = (_fast_call.PointerForwardDropout if dropout else
                       _fast_call.PointerForwardKeyMask if key_mask else _fast_call.PointerForward)
            return cute.compile(wrapper(kernel), *_fast_call.example_args(cdtype, key_mask, dropout),
                                make_fake_stream(), options=compile_options(arch, dump_dir))
        words = (_dynamic(torch.empty(1, 1, 4, dtype=torch.int32), align=4),) if key_mask else ()
        return cute.compile(kernel, q, k, v, o, lse, Float32(1.0), make_fake_stream(), *words,
                            options=compile_options(arch, dump_dir))

    if dump_dir is not None:
        return build()
    name = kernel_name + ("_ptrargs" if pointer_args else "")
    return CACHE.get_or_compile(variant_key(name, tile, dtype, head_dim, causal, bottom_right, arch, dv), build)


def variant_key(kernel_name: str, tile: tuple[int, ...], dtype: torch.dtype, head_dim: int, causal: bool,
                bottom_right: bool, arch: str = "sm_90a", head_dim_v: int | None = None) -> CompileKey:
    """The compile-cache key of one variant (what the dispatcher asks CACHE.failure about)."""
    alignment = ("bottom_right" if bottom_right else "top_left") if causal else "none"
    return CompileKey(kernel_name, dtype, head_dim, head_dim if head_dim_v is None else head_dim_v, causal, alignment,
                      0, tile, arch)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  head_dims: tuple[int, ...] = HEAD_DIMS,
                  head_dim_pairs: frozenset[tuple[int, int]] = frozenset()) -> None:
    """ValueError unless the tensors fit the kernel: what compile_flash_fwd's symbolic signature and TMA assume.
    head_dim_pairs: the (head_dim, head_dim_v) pairs with v's head dim different from q's and k's it takes."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"expected 4-D (batch, heads, seqlen, head_dim) tensors, got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
        raise ValueError(f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (supported: one of torch.float16, torch.bfloat16)")
    b, hq, _, d = q.shape
    dv = v.shape[3]
    if (k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[3] != d or d not in head_dims
            or (dv != d and (d, dv) not in head_dim_pairs)):
        pairs = f", or (head_dim, head_dim_v) one of {sorted(head_dim_pairs)}" if head_dim_pairs else ""
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} (head_dim one of "
                         f"{head_dims}, equal for q, k and v{pairs})")
    if k.shape[1] == 0 or hq % k.shape[1]:
        raise ValueError(f"heads_q={hq} is not a multiple of heads_kv={k.shape[1]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        # TMA: unit stride on head_dim, 16-byte aligned base and strides
        if t.stride(3) != 1 or any(s <= 0 or s % 8 for s in t.stride()[:3]) or t.data_ptr() % 16:
            raise ValueError(f"{name}: head_dim must be contiguous, the other strides positive and they and the "
                             f"data pointer 16-byte aligned, got strides {t.stride()}")
    if not scale > 0:
        raise ValueError(f"scale={scale} (supported: > 0)")


def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None, causal: bool = False,
              bottom_right: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the compiled kernel on CUDA tensors q (b, hq, sq, d), k / v (b, hkv, sk, d): returns out (b, hq, sq, d)
    in q's dtype and the fp32 natural-log LSE (b, hq, sq).

    With _fast_call.ENABLED (the default) the integers of the call are marshalled once per shape; otherwise the
    tensors are converted with `from_dlpack` on every call (17 µs each on the CPU machine).
    """
    return _run(compile_flash_fwd, q, k, v, scale, causal, bottom_right)


def _run(compile_fn: Callable[[torch.dtype, int, bool, bool], Any], q: torch.Tensor, k: torch.Tensor,
         v: torch.Tensor, scale: float | None, causal: bool, bottom_right: bool,
         key_words: torch.Tensor | None = None,
         head_dims: tuple[int, ...] = HEAD_DIMS,
         dropout: tuple | None = None,
         head_dim_pairs: frozenset[tuple[int, int]] = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
    """flash_fwd with the variant compiled by compile_fn(dtype, head_dim, causal, bottom_right); key_words (a
    key-mask variant's packed words, (b, hq, words) int32) go to the kernel after the stream; head_dims: the
    variant's kernel's; dropout (a dropout variant's arguments, which always take the pointer convention): the
    (seed, rng_offset) int64 pair on q's device, the 16-bit keep threshold and 1 / (1 - dropout_p), and for
    keep_bits variants the uint8 buffer of _dropout.keep_bits_bytes they save the keep bits in; head_dim_pairs:
    the (head_dim, head_dim_v) pairs with v's head dim different from q's that compile_fn takes (as head_dim_v=)."""
    from cuda.bindings import driver

    from . import _fast_call

    if key_words is None and dropout is None and _fast_call.ENABLED:  # the plain pointer-convention call
        return prepare_forward(compile_fn, q, k, v, scale, causal, bottom_right, head_dims, head_dim_pairs)(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    _check_inputs(q, k, v, scale, head_dims, head_dim_pairs)
    if v.shape[-1] != q.shape[-1]:
        compile_fn = functools.partial(compile_fn, head_dim_v=v.shape[-1])
    if key_words is not None:
        _check_key_words(key_words, q, k)
    fast = _fast_call.ENABLED or dropout is not None
    compiled = compile_fn(q.dtype, q.shape[-1], causal, bottom_right, pointer_args=True) if fast else \
        compile_fn(q.dtype, q.shape[-1], causal, bottom_right)
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    stream = driver.CUstream(torch.cuda.current_stream(q.device).cuda_stream)
    masked = key_words is not None
    if dropout is not None:
        rng, threshold, drop_scale = dropout[:3]
        _check_rng(rng, q)
        bits = dropout[3] if len(dropout) > 3 else None  # keep_bits variants: the buffer they fill
        if bits is not None:
            from .flash_bwd import check_keep_bits

            check_keep_bits(bits, q, k, causal, bottom_right)
        call = _fast_call.caller(compiled, _fast_call.forward_pointer_types(_DTYPES[q.dtype], dropout=True))
        # unread pointers: the words without a key mask, the bits without keep_bits (q: any 16-byte aligned address)
        call((q, k, v, out, lse, key_words if masked else rng, rng, q if bits is None else bits),
             _fast_call.scalars(q, k, v, out, lse, key_words, threshold), (scale * _LOG2E, drop_scale), stream)
        return out, lse
    if fast:
        call = _fast_call.caller(compiled, _fast_call.forward_pointer_types(_DTYPES[q.dtype], masked))
        call((q, k, v, out, lse) + ((key_words,) if masked else ()),
             _fast_call.scalars(q, k, v, out, lse, key_words), (scale * _LOG2E,), stream)
        return out, lse
    # detach: DLPack refuses tensors that require grad (the op's implementation still sees the flag)
    # a compact copy of the (small) words: the from_dlpack convention mis-read their stride-0 broadcast dims on
    # the H200 (the pointer convention takes them as they are)
    words = (_dynamic(key_words.contiguous(), align=4),) if masked else ()
    compiled(*(_dynamic(t.detach()) for t in (q, k, v, out)), _dynamic(lse, align=4), Float32(scale * _LOG2E), stream,
             *words)
    return out, lse


class _Contiguous:
    """The strides of a contiguous tensor of `shape` as torch gives them (an empty dim counts as 1), where
    _fast_call.scalars reads them (no tensor needed)."""

    def __init__(self, shape: tuple):
        self.shape = tuple(shape)
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        self._strides = tuple(reversed(strides))

    def stride(self) -> tuple:
        return self._strides


class ForwardLaunch:
    """One call signature's forward, prepared (prepare_forward): a compiled pointer-convention variant with its
    integers and scale marshalled. Called with tensors of that signature (shapes, strides, dtype, device; the caller
    keeps to it, and to 16-byte aligned data pointers), it allocates out and lse and launches on the current stream:
    no checks, no compile-cache lookup, no marshalling but the tensors' addresses."""

    __slots__ = ("_fast", "_ints", "_floats", "_out_shape", "_lse_shape")

    def __init__(self, fast: Any, ints: tuple, floats: tuple, out_shape: tuple, lse_shape: tuple):
        self._fast, self._ints, self._floats = fast, ints, floats
        self._out_shape, self._lse_shape = out_shape, lse_shape

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from cuda.bindings import driver

        out = torch.empty(self._out_shape, dtype=q.dtype, device=q.device)
        lse = torch.empty(self._lse_shape, dtype=torch.float32, device=q.device)
        self._fast((q, k, v, out, lse), self._ints, self._floats,
                   driver.CUstream(torch.cuda.current_stream(q.device).cuda_stream))
        return out, lse


def prepare_forward(compile_fn: Callable[..., Any], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float | None, causal: bool, bottom_right: bool, head_dims: tuple[int, ...] = HEAD_DIMS,
                    head_dim_pairs: frozenset[tuple[int, int]] = frozenset()) -> ForwardLaunch:
    """_run's checks (ValueError) and compile (CompileFailedError) for a call without key mask or dropout in the
    pointer convention, as a ForwardLaunch for every later call of the same signature (_run calls it at once)."""
    from . import _fast_call

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    _check_inputs(q, k, v, scale, head_dims, head_dim_pairs)
    if v.shape[-1] != q.shape[-1]:
        compile_fn = functools.partial(compile_fn, head_dim_v=v.shape[-1])
    compiled = compile_fn(q.dtype, q.shape[-1], causal, bottom_right, pointer_args=True)
    out_shape, lse_shape = (*q.shape[:3], v.shape[-1]), tuple(q.shape[:3])
    # out and lse are contiguous: their strides (in the marshalled integers) follow from the shapes
    ints = _fast_call.scalars(q, k, v, _Contiguous(out_shape), _Contiguous(lse_shape))
    fast = _fast_call.caller(compiled, _fast_call.forward_pointer_types(_DTYPES[q.dtype]))
    return ForwardLaunch(fast, ints, (scale * _LOG2E,), out_shape, lse_shape)


def _check_rng(rng: torch.Tensor, q: torch.Tensor) -> None:
    """ValueError unless `rng` is a dropout variant's (seed, rng_offset): int64 (2,) contiguous on q's device."""
    if rng.dtype != torch.int64 or tuple(rng.shape) != (2,) or rng.device != q.device or not rng.is_contiguous():
        raise ValueError(f"the dropout RNG state must be int64 (2,) on {q.device} (seed, offset), got {rng.dtype} "
                         f"{tuple(rng.shape)} on {rng.device}")


def _check_key_words(words: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
    """ValueError unless `words` is a packed key mask for these inputs (ops.cute_flash.key_words): int32 (b, hq,
    ceil(seqlen_k / 32) + 1) on q's device with a unit last stride."""
    expected = (q.shape[0], q.shape[1], -(-k.shape[2] // 32) + 1)
    if (words.dtype != torch.int32 or tuple(words.shape) != expected or words.device != q.device
            or words.stride(2) != 1):
        raise ValueError(f"key_words must be int32 {expected} on {q.device} with a unit last stride, got "
                         f"{words.dtype} {tuple(words.shape)} strides {words.stride()} on {words.device}")
