"""Device-side pieces of the CuTe kernels' TMA-store epilogues (flash_fwd_ws's O, flash_bwd_ws's and flash_bwd_wide's
dK / dV): an accumulator in the input dtype, into a shared-memory tile by stmatrix, and one TMA store of such a tile. The callers order
them (a proxy fence and a barrier between the stmatrix stores and the copy; the issuing warp waits for the copy to
have read shared memory before the CTA may exit)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.nvgpu.warp import StMatrix8x8x16bOp


@cute.jit
def converted(acc: cute.Tensor, dtype: cutlass.Constexpr, factor: Float32 = None) -> cute.Tensor:
    """The accumulator's values (times `factor` where given) in `dtype`, in registers of the same layout."""
    r = cute.make_rmem_tensor(acc.shape, dtype)
    if cutlass.const_expr(factor is not None):
        r.store((acc.load() * factor).to(dtype))
    else:
        r.store(acc.load().to(dtype))
    return r


@cute.jit
def stmatrix_tile(mma: cute.TiledMma, values: cute.Tensor, dst: cute.Tensor, dtype: cutlass.Constexpr, tidx: Int32):
    """Thread tidx's accumulator-ordered `values` (`converted`) of `mma` into the shared-memory tile dst (the
    accumulator's shape, its N mode contiguous: each 8 x 8 matrix row is 16 contiguous bytes, so no transpose) by
    stmatrix, four 8 x 8 matrices per instruction."""
    store = cute.make_tiled_copy_C(cute.make_copy_atom(StMatrix8x8x16bOp(False, 4), dtype), mma)
    thr = store.get_slice(tidx)
    cute.copy(store, thr.retile(values), thr.partition_D(dst))


@cute.jit
def tma_store_tile(tma: cute.CopyAtom, sX: cute.Tensor, gX: cute.Tensor, block: Int32):
    """One TMA store (issued, not committed) of the shared-memory tile sX into tile `block` of gX (tile, blocks), the
    atom's box; rows past the tensor's end are clipped by the copy. Call from one whole warp."""
    tXsX, tXgX = cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(sX, 0, 2),
                                       cute.group_modes(gX, 0, 2))
    cute.copy(tma, tXsX, tXgX[None, block])
