"""Two tiny CuTe kernels that show the DSL compiles for a target here, with no GPU needed.

- `compile_vector_add`: c = a + b on fp16 vectors of any length (plain loads and stores).
- `compile_wgmma_tile`: one 64x64 fp16 tile, C = A @ B^T with K = 64: TMA loads A and B into swizzled
  shared memory (one mbarrier), one warpgroup runs the wgmma instructions, fp32 accumulators are
  rounded to fp16 and stored. sm90a only.

Neither is used for attention; they exist for compile-only tests and `doctor`-style checks.
Importing this module imports the DSL.
"""

from __future__ import annotations

from typing import Any

from ._compile_cache import enable_dsl_disk_cache
from ._target import compile_options

enable_dsl_disk_cache()  # before the DSL's first compile in this process

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
import cutlass.utils.hopper_helpers as sm90  # noqa: E402
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup  # noqa: E402
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream  # noqa: E402
from cutlass.memory import SmemAllocator  # noqa: E402
from cutlass.tensor_utils import LayoutEnum  # noqa: E402

_ADD_THREADS = 128
TILE = 64  # the wgmma tile: M = N = K = 64


@cute.kernel
def _vector_add_kernel(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * _ADD_THREADS + tidx
    if i < a.shape[0]:
        c[i] = a[i] + b[i]


@cute.jit
def _vector_add(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream: Any):
    n = a.shape[0]
    _vector_add_kernel(a, b, c).launch(grid=((n + _ADD_THREADS - 1) // _ADD_THREADS, 1, 1),
                                       block=(_ADD_THREADS, 1, 1), stream=stream)


def compile_vector_add(arch: str, dump_dir: str | None = None) -> Any:
    """Compile the vector add for `arch` on symbolic-length fp16 vectors (16-byte aligned)."""
    n = cute.sym_int64(symbol="n")
    a, b, c = (make_fake_compact_tensor(cutlass.Float16, (n,), assumed_align=16) for _ in range(3))
    return cute.compile(_vector_add, a, b, c, make_fake_stream(), options=compile_options(arch, dump_dir))


@cute.kernel
def _wgmma_tile_kernel(tma_a: cute.CopyAtom, mA: cute.Tensor, tma_b: cute.CopyAtom, mB: cute.Tensor,
                       mC: cute.Tensor, tiled_mma: cute.TiledMma, sA_layout: cute.ComposedLayout,
                       sB_layout: cute.ComposedLayout):
    tidx, _, _ = cute.arch.thread_idx()
    smem = SmemAllocator()
    bar = smem.allocate_array(cutlass.Int64, 1)
    # wgmma reads swizzled operands: 1024-byte alignment covers the 128B swizzle pattern
    sA = smem.allocate_tensor(cutlass.Float16, sA_layout.outer, byte_alignment=1024, swizzle=sA_layout.inner)
    sB = smem.allocate_tensor(cutlass.Float16, sB_layout.outer, byte_alignment=1024, swizzle=sB_layout.inner)
    if tidx == 0:
        cute.arch.mbarrier_init(bar, 1)
    cute.arch.mbarrier_init_fence()
    cute.arch.sync_threads()

    gA = cute.local_tile(mA, (TILE, TILE), (0, 0))
    gB = cute.local_tile(mB, (TILE, TILE), (0, 0))
    one_cta = cute.make_layout(1)
    tAsA, tAgA = cpasync.tma_partition(tma_a, 0, one_cta, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2))
    tBsB, tBgB = cpasync.tma_partition(tma_b, 0, one_cta, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2))
    if tidx == 0:
        # one arrival, completed when both tiles' bytes have landed
        cute.arch.mbarrier_arrive_and_expect_tx(bar, 2 * TILE * TILE * 2)
        cute.copy(tma_a, tAgA, tAsA, tma_bar_ptr=bar)
        cute.copy(tma_b, tBgB, tBsB, tma_bar_ptr=bar)
    cute.arch.mbarrier_wait(bar, 0)

    thr_mma = tiled_mma.get_slice(tidx)
    tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
    tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
    tCgC = thr_mma.partition_C(cute.local_tile(mC, (TILE, TILE), (0, 0)))
    acc = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
    tiled_mma.set(warpgroup.Field.ACCUMULATE, False)
    warpgroup.fence()
    for k in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):  # K / 16 wgmma instructions
        cute.gemm(tiled_mma, acc, tCrA[None, None, k], tCrB[None, None, k], acc)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()
    warpgroup.wait_group(0)
    out = cute.make_rmem_tensor(tCgC.shape, cutlass.Float16)
    out.store(acc.load().to(cutlass.Float16))
    cute.autovec_copy(out, tCgC)


@cute.jit
def _wgmma_tile(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, stream: Any):
    tiler = (TILE, TILE, TILE)
    tiled_mma = sm90.make_trivial_tiled_mma(cutlass.Float16, cutlass.Float16, OperandMajorMode.K, OperandMajorMode.K,
                                            cutlass.Float32, (1, 1, 1), (TILE, TILE))
    sA_layout = cute.slice_(sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tiler, cutlass.Float16, 1), (None, None, 0))
    sB_layout = cute.slice_(sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tiler, cutlass.Float16, 1), (None, None, 0))
    tma_a, tma_tensor_a = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), a, sA_layout, (TILE, TILE))
    tma_b, tma_tensor_b = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), b, sB_layout, (TILE, TILE))
    _wgmma_tile_kernel(tma_a, tma_tensor_a, tma_b, tma_tensor_b, c, tiled_mma, sA_layout, sB_layout).launch(
        grid=(1, 1, 1), block=(128, 1, 1), smem=3 * TILE * TILE * 2, stream=stream)


def compile_wgmma_tile(arch: str, dump_dir: str | None = None) -> Any:
    """Compile the one-tile wgmma GEMM for `arch` (row-major 64x64 fp16 A, B and C)."""
    a, b, c = (make_fake_compact_tensor(cutlass.Float16, (TILE, TILE), stride_order=(1, 0), assumed_align=16)
               for _ in range(3))
    return cute.compile(_wgmma_tile, a, b, c, make_fake_stream(), options=compile_options(arch, dump_dir))
