"""LLVM instructions that numba lacks, as numba intrinsics (llvmlite) for the pool's layer
kernel: atomics on an int64 array, x86's spin hint, raw addresses as pointers, float32 bit casts
and the e4m3 decode in 32-bit lanes, and the futex system call.

Linux x86-64 only, as the pool's pinning already assumes.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

SYS_FUTEX = 202  # x86-64


def _element_ptr(context, builder, signature, args):
    ary = context.make_array(signature.args[0])(context, builder, args[0])
    return builder.gep(ary.data, [args[1]])


@intrinsic
def atomic_load(typingctx, arr, i):
    """arr[i] (int64), read with acquire order."""

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_element_ptr(context, builder, signature, args), "acquire", 8)

    return types.int64(arr, i), codegen


@intrinsic
def atomic_store(typingctx, arr, i, value):
    """arr[i] = value (int64), sequentially consistent: a store then a load of another word
    stay in that order (publish, then look for sleepers to wake)."""

    def codegen(context, builder, signature, args):
        builder.store_atomic(args[2], _element_ptr(context, builder, signature, args), "seq_cst", 8)
        return context.get_dummy_value()

    return types.void(arr, i, value), codegen


@intrinsic
def atomic_add(typingctx, arr, i, value):
    """arr[i] += value atomically (int64); returns the old value."""

    def codegen(context, builder, signature, args):
        ptr = _element_ptr(context, builder, signature, args)
        return builder.atomic_rmw("add", ptr, args[2], "acq_rel")

    return types.int64(arr, i, value), codegen


@intrinsic
def spin_pause(typingctx):
    """x86's PAUSE: a spinning core yields its pipeline to its sibling and saves power."""

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic(
            "llvm.x86.sse2.pause", fnty=ir.FunctionType(ir.VoidType(), [])
        )
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def address(typingctx, addr):
    """An int64 address as a pointer, for numba.carray."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(addr), codegen


@intrinsic
def f32_of_bits(typingctx, bits):
    """The float32 whose bits are `bits` (uint32): decodes vectorise without a buffer."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


def _fsub_bits(builder, bits, corr):
    f32 = ir.FloatType()
    return builder.fsub(builder.bitcast(bits, f32), builder.bitcast(corr, f32))


@intrinsic
def e4m3_value(typingctx, byte):
    """float32 of an e4m3 byte (sign, 4 exponent bits of bias 7, 3 mantissa bits), in 32-bit
    integer arithmetic (numba's own would widen every lane to 64 bits and halve the vectors).
    A normal: its bits moved into a float32's, exponent rebiased by +120. A subnormal m x 2^-9:
    built as the normal 2^-6 (1 + m/8), less 2^-6, so no float32 denormal is ever touched."""

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        c = lambda v: ir.Constant(i32, v)  # noqa: E731
        b = builder.zext(args[0], i32)
        mag = builder.and_(b, c(0x7F))
        sign = builder.shl(builder.and_(b, c(0x80)), c(24))
        sub = builder.ashr(builder.sub(mag, c(8)), c(31))  # -1 where subnormal, else 0
        bits = builder.add(builder.shl(mag, c(20)), c(120 << 23))
        bits = builder.or_(builder.add(bits, builder.shl(builder.and_(sub, c(1)), c(23))), sign)
        corr = builder.or_(builder.and_(sub, c(0x3C800000)), sign)  # 2^-6 where subnormal
        return _fsub_bits(builder, bits, corr)

    return types.float32(types.uint8), codegen


@intrinsic
def futex(typingctx, addr, op, value):
    """syscall(SYS_futex, addr, op, value, NULL, NULL, 0), libc's symbol resolved when the
    code is loaded (so numba can cache it, unlike a ctypes function's fixed address)."""

    def codegen(context, builder, signature, args):
        i64, ptr = ir.IntType(64), ir.IntType(8).as_pointer()
        fnty = ir.FunctionType(i64, [i64], var_arg=True)
        fn = cgutils.get_or_insert_function(builder.module, fnty, "syscall")
        null = ir.Constant(ptr, None)
        target = builder.inttoptr(args[0], ptr)
        op32 = builder.trunc(args[1], ir.IntType(32))
        val32 = builder.trunc(args[2], ir.IntType(32))
        call = [ir.Constant(i64, SYS_FUTEX), target, op32, val32, null, null, ir.Constant(i64, 0)]
        return builder.call(fn, call)

    return types.int64(addr, op, value), codegen
