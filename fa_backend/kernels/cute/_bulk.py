"""Bulk asynchronous copies that the CuTe DSL (4.8) has no op for, written as PTX; the deterministic dQ adds' flags.

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
from cutlass.cutlass_dsl import T, dsl_user_op


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


# The deterministic backward's turn flags: one int32 per (query block, head, batch), a CTA's dQ add to a block waits
# until the flag holds its key-block index, then adds 1 once its add is complete. Acquire / release at gpu scope
# order the flag with the adds; the proxy fences order the generic-proxy flag accesses with the bulk-copy unit's
# (async-proxy) adds to the same global memory.


@dsl_user_op
def load_acquire_i32(ptr: cute.Pointer, *, loc=None, ip=None) -> Int32:
    """*ptr (int32, global), an acquire load at gpu scope."""
    value = llvm.inline_asm(
        T.i32(),
        [ptr.toint(loc=loc, ip=ip).ir_value()],
        "ld.global.acquire.gpu.b32 $0, [$1];",
        "=r,l",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return Int32(value)


@dsl_user_op
def add_release_i32(ptr: cute.Pointer, value: int, *, loc=None, ip=None) -> None:
    """*ptr += value (int32, global), a release reduction at gpu scope."""
    llvm.inline_asm(
        None,
        [ptr.toint(loc=loc, ip=ip).ir_value(), Int32(value).ir_value(loc=loc, ip=ip)],
        "red.release.gpu.global.add.s32 [$0], $1;",
        "l,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


@dsl_user_op
def fence_proxy_async_global(*, loc=None, ip=None) -> None:
    """Orders this thread's generic-proxy and async-proxy (bulk copy) accesses to global memory."""
    llvm.inline_asm(None, [], "fence.proxy.async.global;", "", has_side_effects=True, is_align_stack=False,
                    asm_dialect=llvm.AsmDialect.AD_ATT)
