"""LLVM instructions that numba lacks, as numba intrinsics (llvmlite) for the pool's layer
kernel: atomics on an int64 array, x86's spin hint, raw addresses as pointers, float32 bit casts
and the e4m3 decode in 32-bit lanes, the futex system call, an int8 dot in integer lanes, and a
bf16 dot (vdpbf16ps).

Linux x86-64 only, as the pool's pinning already assumes.
"""

from __future__ import annotations

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
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


Q8_BLOCK = 32  # elements per activation scale in q8_dot (llama.cpp's Q8_0 block)


def _target_features() -> dict[str, bool]:
    """The features numba compiles for: the host's, or NUMBA_CPU_NAME / NUMBA_CPU_FEATURES's."""
    if config.CPU_NAME in (None, "host"):
        return dict(llvm.get_host_cpu_features())
    return {f[1:]: f[0] == "+" for f in (config.CPU_FEATURES or "").split(",") if f}


# The integer dot's instructions: VNNI's vpdpbusd (AVX-VNNI, or AVX512-VNNI with 256-bit
# forms), else AVX2's vpmaddubsw + vpmaddwd, else generic vector IR (any x86-64; slower: vpmulld)
_TARGET = _target_features()
VNNI = bool(_TARGET.get("avxvnni") or (_TARGET.get("avx512vnni") and _TARGET.get("avx512vl")))
AVX2 = bool(_TARGET.get("avx2"))


def _lanes(builder, v, which):
    """The vector of v's lanes `which`, in that order."""
    which = list(which)
    mask = ir.Constant(ir.VectorType(ir.IntType(32), len(which)), which)
    return builder.shuffle_vector(v, v, mask)


def _fast(instr):
    instr.flags.append("fast")  # reassociation and contraction: an fma, no ordered sums
    return instr


def _call(builder, name, ret, args):
    fnty = ir.FunctionType(ret, [a.type for a in args])
    return builder.call(builder.module.declare_intrinsic(name, fnty=fnty), args)


def _block_sums(builder, wv, xv):
    """<8 x i32> whose lanes sum to the dot of two <32 x i8> (values in [-127, 127]), each lane
    the sum of 4 neighbouring products. x86 multiplies unsigned by signed bytes: |w| times x
    with w's sign (llama.cpp's AVX2 Q8_0 dot); no 16-bit sum saturates (2 * 127 * 127 < 2^15)."""
    i8, i16, i32 = ir.IntType(8), ir.IntType(16), ir.IntType(32)
    v32i8, v16i16, v8i32 = ir.VectorType(i8, 32), ir.VectorType(i16, 16), ir.VectorType(i32, 8)
    if AVX2:
        ax = _call(builder, "llvm.abs.v32i8", v32i8, [wv, ir.Constant(ir.IntType(1), 0)])
        sx = _call(builder, "llvm.x86.avx2.psign.b", v32i8, [xv, wv])
        if VNNI:
            zero = ir.Constant(v8i32, [0] * 8)
            return _call(builder, "llvm.x86.avx512.vpdpbusd.256", v8i32, [zero, ax, sx])
        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [ax, sx])
        ones = ir.Constant(v16i16, [1] * 16)
        return _call(builder, "llvm.x86.avx2.pmadd.wd", v8i32, [pairs, ones])
    wide = ir.VectorType(i32, 32)
    prod = builder.mul(builder.sext(wv, wide), builder.sext(xv, wide))
    quarters = [_lanes(builder, prod, range(q, 32, 4)) for q in range(4)]
    return builder.add(builder.add(quarters[0], quarters[1]), builder.add(quarters[2], quarters[3]))


# independent float accumulators in q8_dot: each block's multiply-add waits for the previous one
# into the same accumulator (4 cycles), and one chain made T=4 calls ~6x slower per token
Q8_CHAINS = 4


def _dot_blocks(builder, blocks, block):
    """sum over b < blocks of the float32 lanes of block(b) -> (<8 x i32> integer sums, <8 x
    float> their scales), in Q8_CHAINS accumulators (b into b % Q8_CHAINS); one horizontal sum
    at the end."""
    i32, i64, f32x8 = ir.IntType(32), ir.IntType(64), ir.VectorType(ir.FloatType(), 8)
    zero = ir.Constant(f32x8, [0.0] * 8)
    accs = [cgutils.alloca_once_value(builder, zero) for _ in range(Q8_CHAINS)]

    def add_block(b, acc):
        sums, scales = block(b)
        prod = _fast(builder.fmul(builder.sitofp(sums, f32x8), scales))
        builder.store(_fast(builder.fadd(builder.load(acc), prod)), acc)

    chains = ir.Constant(i64, Q8_CHAINS)
    groups = builder.udiv(blocks, chains)
    with cgutils.for_range(builder, groups) as loop:
        first = builder.mul(loop.index, chains)
        for c, acc in enumerate(accs):
            add_block(builder.add(first, ir.Constant(i64, c)), acc)
    with cgutils.for_range(builder, builder.sub(blocks, builder.mul(groups, chains))) as loop:
        add_block(builder.add(builder.mul(groups, chains), loop.index), accs[0])
    total = builder.load(accs[0])
    for acc in accs[1:]:
        total = _fast(builder.fadd(total, builder.load(acc)))
    for width in (4, 2, 1):  # the upper half of the lanes added onto the lower
        hi = _lanes(builder, total, range(width, 2 * width))
        total = _fast(builder.fadd(_lanes(builder, total, range(width)), hi))
    return builder.extract_element(total, ir.Constant(i32, 0))


def _data(context, builder, signature, args, n):
    """The data pointers of the first n (array) arguments."""
    arrays = zip(signature.args[:n], args[:n], strict=True)
    return [context.make_array(t)(context, builder, a).data for t, a in arrays]


@intrinsic
def q8_dot(typingctx, w, x, s, blocks):
    """sum over b < blocks of s[b] * (the int32 dot of w and x over [32 b, 32 b + 32)), float32;
    w and x int8 arrays (values in [-127, 127]), s float32. Vector IR, because numba widens int8
    products to int64 lanes: per block, the integer sums of _block_sums, converted to float and
    multiplied by the block's scale (the shape of llama.cpp's Q8_0 dot)."""

    def codegen(context, builder, signature, args):
        i8, i32, f32x8 = ir.IntType(8), ir.IntType(32), ir.VectorType(ir.FloatType(), 8)
        w_ptr, x_ptr, s_ptr = _data(context, builder, signature, args, 3)
        vec = ir.VectorType(i8, Q8_BLOCK).as_pointer()
        w_ptr, x_ptr = builder.bitcast(w_ptr, vec), builder.bitcast(x_ptr, vec)

        def block(b):
            wv = builder.load(builder.gep(w_ptr, [b]), align=1)
            xv = builder.load(builder.gep(x_ptr, [b]), align=1)
            scale = builder.load(builder.gep(s_ptr, [b]))
            one = builder.insert_element(ir.Constant(f32x8, None), scale, ir.Constant(i32, 0))
            return _block_sums(builder, wv, xv), _lanes(builder, one, [0] * 8)

        return _dot_blocks(builder, args[3], block)

    return types.float32(w, x, s, blocks), codegen


# e2m1 values times 2, by code: integers, so that a byte table (vpshufb) decodes them exactly
E2M1_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _e2m1_x2(builder, codes, table):
    """<32 x i8> twice the e2m1 values of codes <32 x i8> (0..15): vpshufb from `table`; without
    AVX2 (the kernel then keeps nvfp4's float path, but this still compiles) in arithmetic:
    magnitude m < 4: m, m < 6: 2m - 4, else 4m - 16; code bit 3 the sign."""
    v32i8 = codes.type
    if AVX2:
        return _call(builder, "llvm.x86.avx2.pshuf.b", v32i8, [table, codes])

    def c(v):
        return ir.Constant(v32i8, [v] * 32)

    m = builder.and_(codes, c(7))
    twice, four = builder.sub(builder.shl(m, c(1)), c(4)), builder.sub(builder.shl(m, c(2)), c(16))
    big = builder.select(builder.icmp_unsigned("<", m, c(6)), twice, four)
    mag = builder.select(builder.icmp_unsigned("<", m, c(4)), m, big)
    negative = builder.icmp_unsigned("!=", builder.and_(codes, c(8)), c(0))
    return builder.select(negative, builder.sub(c(0), mag), mag)


@intrinsic
def nvfp4_q8_dot(typingctx, w, x, xs, gs, blocks):
    """sum over blocks b < blocks, groups g = 2b, 2b + 1 of 16 elements: gs[g] * xs[b] * (the
    int32 dot of 2 * e2m1(w) and x over group g), float32 (half the dot of the e2m1 values).
    w uint8 two e2m1 codes a byte (element 2j low nibble), 16 bytes a block; x int8 [32 b];
    xs float32 [b]: x's block scales; gs float32 [2 b]: w's group scales."""

    def codegen(context, builder, signature, args):
        i8, i32 = ir.IntType(8), ir.IntType(32)
        f32, v16i8, v32i8 = ir.FloatType(), ir.VectorType(ir.IntType(8), 16), ir.VectorType(i8, 32)
        w_ptr, x_ptr, xs_ptr, gs_ptr = _data(context, builder, signature, args, 4)
        w_ptr = builder.bitcast(w_ptr, v16i8.as_pointer())
        x_ptr = builder.bitcast(x_ptr, v32i8.as_pointer())
        gs_ptr = builder.bitcast(gs_ptr, ir.VectorType(f32, 2).as_pointer())
        table = ir.Constant(v32i8, [v & 0xFF for v in E2M1_X2 * 2])  # both 128-bit lanes

        def block(b):
            packed = builder.load(builder.gep(w_ptr, [b]), align=1)
            lo = builder.and_(packed, ir.Constant(v16i8, [15] * 16))
            hi = builder.lshr(packed, ir.Constant(v16i8, [4] * 16))
            order = [j // 2 + 16 * (j % 2) for j in range(32)]  # lo 0, hi 0, lo 1, hi 1, ...
            codes = builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(i32, 32), order))
            wv = _e2m1_x2(builder, codes, table)
            xv = builder.load(builder.gep(x_ptr, [b]), align=1)
            groups = builder.load(builder.gep(gs_ptr, [b]), align=4)  # <2 x float>
            xscale = builder.load(builder.gep(xs_ptr, [b]))
            one = builder.insert_element(ir.Constant(ir.VectorType(f32, 2), None), xscale,
                                         ir.Constant(i32, 0))  # fmt: skip
            pair = _fast(builder.fmul(groups, _lanes(builder, one, [0, 0])))
            return _block_sums(builder, wv, xv), _lanes(builder, pair, [0] * 4 + [1] * 4)

        return _dot_blocks(builder, args[4], block)

    return types.float32(w, x, xs, gs, blocks), codegen


class _BFloat(ir.Type):
    """LLVM's bfloat (llvmlite's ir has no such type): dpbf16ps's operands are <32 x bfloat> in
    the LLVM numba builds with (22; before LLVM 17 they were <16 x i32>)."""

    def _to_string(self):
        return "bfloat"

    def __eq__(self, other):
        return isinstance(other, _BFloat)

    def __hash__(self):
        return hash(_BFloat)


# bf16 dot: AVX512-BF16's vdpbf16ps (two bf16 products a float lane, fused), else generic IR
AVX512BF16 = bool(_TARGET.get("avx512bf16") and _TARGET.get("avx512f"))
BF16_BLOCK = 32  # elements per vdpbf16ps (512 bits of bf16)
BF16_CHAINS = 4  # independent accumulators: a vdpbf16ps waits ~5 cycles on its accumulator


@intrinsic
def bf16_dot(typingctx, w, x, blocks):
    """sum over j < 32 blocks of w[j] * x[j] in float32; w and x uint16 arrays of bf16 bits.
    Per block of 32: vdpbf16ps (16 float lanes, each += two bf16 products, exact in float32)
    into block b % BF16_CHAINS's accumulator; one horizontal sum at the end. Without
    AVX512-BF16 (the kernel then keeps bf16's float path, but this still compiles) the same in
    generic IR: bits shifted to float32, multiplied, neighbours added."""

    def codegen(context, builder, signature, args):
        i16, i32, i64 = ir.IntType(16), ir.IntType(32), ir.IntType(64)
        f32x16, v32i16 = ir.VectorType(ir.FloatType(), 16), ir.VectorType(i16, BF16_BLOCK)
        w_ptr, x_ptr = _data(context, builder, signature, args, 2)
        w_ptr = builder.bitcast(w_ptr, v32i16.as_pointer())
        x_ptr = builder.bitcast(x_ptr, v32i16.as_pointer())
        zero = ir.Constant(f32x16, [0.0] * 16)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(BF16_CHAINS)]

        def add_block(b, acc):
            wv = builder.load(builder.gep(w_ptr, [b]), align=2)
            xv = builder.load(builder.gep(x_ptr, [b]), align=2)
            if AVX512BF16:
                bf = ir.VectorType(_BFloat(), BF16_BLOCK)
                wb, xb = builder.bitcast(wv, bf), builder.bitcast(xv, bf)
                name = "llvm.x86.avx512bf16.dpbf16ps.512"
                new = _call(builder, name, f32x16, [builder.load(acc), wb, xb])
            else:
                f32x32, v32i32 = ir.VectorType(ir.FloatType(), 32), ir.VectorType(i32, 32)
                sixteen = ir.Constant(v32i32, [16] * 32)

                def f32(v):
                    return builder.bitcast(builder.shl(builder.zext(v, v32i32), sixteen), f32x32)

                prod = _fast(builder.fmul(f32(wv), f32(xv)))
                pairs = _fast(builder.fadd(_lanes(builder, prod, range(0, 32, 2)),
                                           _lanes(builder, prod, range(1, 32, 2))))  # fmt: skip
                new = _fast(builder.fadd(builder.load(acc), pairs))
            builder.store(new, acc)

        chains = ir.Constant(i64, BF16_CHAINS)
        groups = builder.udiv(args[2], chains)
        with cgutils.for_range(builder, groups) as loop:
            first = builder.mul(loop.index, chains)
            for c, acc in enumerate(accs):
                add_block(builder.add(first, ir.Constant(i64, c)), acc)
        with cgutils.for_range(builder, builder.sub(args[2], builder.mul(groups, chains))) as loop:
            add_block(builder.add(builder.mul(groups, chains), loop.index), accs[0])
        total = builder.load(accs[0])
        for acc in accs[1:]:
            total = _fast(builder.fadd(total, builder.load(acc)))
        for width in (8, 4, 2, 1):  # the upper half of the lanes added onto the lower
            hi = _lanes(builder, total, range(width, 2 * width))
            total = _fast(builder.fadd(_lanes(builder, total, range(width)), hi))
        return builder.extract_element(total, ir.Constant(i32, 0))

    return types.float32(w, x, blocks), codegen
