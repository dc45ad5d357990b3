"""Bulk asynchronous copies that the CuTe DSL (4.8) has no op for, written as PTX.

`cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32` adds a contiguous run of fp32 values from shared
memory into global memory; the bulk-copy unit reads the shared memory asynchronously and the L2 does the adds on
whole lines, where per-value atomics issue one L2 transaction per 32-byte sector per instruction. Both addresses
must be 16-byte aligned and the size a multiple of 16 bytes. The issuing thread commits its copies
(`cute.arch.cp_async_bulk_commit_group`) and waits (`cute.arch.cp_async_bulk_wait_group(n, read=True)`) before the
shared memory is written again.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op


@dsl_user_op
def bulk_reduce_add_f32(src: cute.Pointer, dst: cute.Pointer, nbytes: int | Int32, *, loc=None, ip=None) -> None:
    """dst[0 : nbytes / 4] += src[0 : nbytes / 4] (fp32; src in shared, dst in global memory), asynchronously."""
    llvm.inline_asm(
        None,
        [dst.llvm_ptr, src.toint(loc=loc, ip=ip).ir_value(), Int32(nbytes).ir_value()],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
