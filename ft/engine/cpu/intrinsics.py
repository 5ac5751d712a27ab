"""LLVM instructions that numba lacks, as numba intrinsics (llvmlite) for the pool's layer
kernel: atomics on an int64 array, x86's spin hint and time-stamp counter, a cache prefetch
hint, raw addresses as pointers, float32 bit casts and the e4m3 decode in 32-bit lanes, the
futex system call, an int8 dot in integer lanes, and a bf16 dot (vdpbf16ps).

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
def cycles(typingctx):
    """The CPU's time-stamp counter (rdtsc): a few cycles to read, so a worker can stamp each
    phase of every call (layer_kernel's STAMPS) without slowing it."""

    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic(
            "llvm.readcyclecounter", fnty=ir.FunctionType(ir.IntType(64), [])
        )
        return builder.call(fn, [])

    return types.int64(), codegen


@intrinsic
def address(typingctx, addr):
    """An int64 address as a pointer, for numba.carray."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], ir.IntType(8).as_pointer())

    return types.voidptr(addr), codegen


@intrinsic
def prefetch(typingctx, addr):
    """Ask for the cache line at int64 address `addr` (prefetcht0): a hint, it never faults."""

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(8).as_pointer())
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [ptr.type, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [ptr.type], fnty)
        builder.call(fn, [ptr, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


@intrinsic
def f32_of_bits(typingctx, bits):
    """The float32 whose bits are `bits` (uint32): decodes vectorise without a buffer."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


def _const(ty, v):
    """The constant v of type ty, every lane of a vector type."""
    return ir.Constant(ty, [v] * ty.count) if isinstance(ty, ir.VectorType) else ir.Constant(ty, v)


def _e4m3_f32(builder, b):
    """float32 (or <n x float>) of e4m3 bytes b, zero-extended to i32 (or <n x i32>) lanes."""
    i32 = b.type
    f32 = ir.FloatType()
    if isinstance(i32, ir.VectorType):
        f32 = ir.VectorType(f32, i32.count)

    def c(v):
        return _const(i32, v)

    mag = builder.and_(b, c(0x7F))
    sign = builder.shl(builder.and_(b, c(0x80)), c(24))
    sub = builder.ashr(builder.sub(mag, c(8)), c(31))  # -1 where subnormal, else 0
    bits = builder.add(builder.shl(mag, c(20)), c(120 << 23))
    bits = builder.add(bits, builder.shl(builder.and_(sub, c(1)), c(23)))
    corr = builder.and_(sub, c(0x3C800000))  # 2^-6 where subnormal
    size = builder.fsub(builder.bitcast(bits, f32), builder.bitcast(corr, f32))
    # the sign set last: a negative zero stays negative, as in torch's float8_e4m3fn
    return builder.bitcast(builder.or_(builder.bitcast(size, i32), sign), f32)


@intrinsic
def e4m3_value(typingctx, byte):
    """float32 of an e4m3 byte (sign, 4 exponent bits of bias 7, 3 mantissa bits), in 32-bit
    integer arithmetic (numba's own would widen every lane to 64 bits and halve the vectors).
    A normal: its bits moved into a float32's, exponent rebiased by +120. A subnormal m x 2^-9:
    built as the normal 2^-6 (1 + m/8), less 2^-6, so no float32 denormal is ever touched."""

    def codegen(context, builder, signature, args):
        return _e4m3_f32(builder, builder.zext(args[0], ir.IntType(32)))

    return types.float32(types.uint8), codegen


@intrinsic
def bits_of_f32(typingctx, value):
    """The bits of a float32, as uint32 (a value exact in bf16 is its upper 16)."""

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


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


@intrinsic
def sched_yield(typingctx):
    """sched_yield(): the core to another thread runnable on it, if any (libc's symbol, as
    futex's)."""

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(32), [])
        builder.call(cgutils.get_or_insert_function(builder.module, fnty, "sched_yield"), [])
        return context.get_dummy_value()

    return types.void(), codegen


@intrinsic
def current_cpu(typingctx):
    """sched_getcpu(): the CPU this thread runs on now, -1 if unknown (libc's symbol, as
    futex's; glibc answers it from the vDSO or rseq, no system call)."""

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(32), [])
        cpu = builder.call(cgutils.get_or_insert_function(builder.module, fnty, "sched_getcpu"), [])
        return builder.sext(cpu, ir.IntType(64))

    return types.int64(), codegen


Q8_BLOCK = 32  # elements per activation scale in q8_dot_rows (llama.cpp's Q8_0 block)
DOT_TOKENS = 4  # tokens dotted with one pass over a row (the integer and the bf16 dots)


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
AVX512VNNI = bool(_TARGET.get("avx512vnni") and _TARGET.get("avx512bw"))  # 64 bytes a vpdpbusd


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


def _signed_weights(builder, wv):
    """What _block_sums needs of a <32 x i8> weight block, made once for every token: x86
    multiplies unsigned by signed bytes, so |w| and w (its sign moves onto x)."""
    if AVX2:
        ax = _call(builder, "llvm.abs.v32i8", wv.type, [wv, ir.Constant(ir.IntType(1), 0)])
        return ax, wv
    return None, wv


def _block_sums(builder, weights, xv):
    """<8 x i32> whose lanes sum to the dot of two <32 x i8> (values in [-127, 127]), each lane
    the sum of 4 neighbouring products; weights from _signed_weights. |w| times x with w's sign
    (llama.cpp's AVX2 Q8_0 dot); no 16-bit sum saturates (2 * 127 * 127 < 2^15)."""
    v32i8, v8i32 = ir.VectorType(ir.IntType(8), 32), ir.VectorType(ir.IntType(32), 8)
    ax, wv = weights
    if AVX2:
        sx = _call(builder, "llvm.x86.avx2.psign.b", v32i8, [xv, wv])
        return _quad_sums(builder, _const(v8i32, 0), ax, sx)
    wide = ir.VectorType(ir.IntType(32), 32)
    return _sum_quads(builder, builder.mul(builder.sext(wv, wide), builder.sext(xv, wide)))


def _quad_sums(builder, start, u, s):
    """start (<n/4 x i32>) plus, per lane, the sum of 4 neighbouring products of the unsigned
    bytes u and the signed bytes s (<n x i8>, n 32 or 64): vpdpbusd (AVX512-VNNI; AVX-VNNI at
    32), else AVX2's vpmaddubsw + vpmaddwd (a pair's 16-bit sum must not saturate: callers keep
    2 |u s| < 2^15), else generic IR."""
    lanes, count = start.type, u.type.count
    if AVX512VNNI and count == 64:
        return _call(builder, "llvm.x86.avx512.vpdpbusd.512", lanes, [start, u, s])
    if VNNI and count == 32:
        return _call(builder, "llvm.x86.avx512.vpdpbusd.256", lanes, [start, u, s])
    if AVX2 and count == 32:
        v16i16 = ir.VectorType(ir.IntType(16), 16)
        pairs = _call(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [u, s])
        quads = _call(builder, "llvm.x86.avx2.pmadd.wd", lanes, [pairs, _const(v16i16, 1)])
        return builder.add(start, quads)
    wide = ir.VectorType(ir.IntType(32), count)
    return builder.add(start, _sum_quads(builder, builder.mul(builder.zext(u, wide),
                                                              builder.sext(s, wide))))  # fmt: skip


def _sum_quads(builder, prod):
    """<n/4 x i32>: each lane the sum of 4 neighbouring lanes of the <n x i32> prod."""
    quarters = [_lanes(builder, prod, range(q, prod.type.count, 4)) for q in range(4)]
    return builder.add(builder.add(quarters[0], quarters[1]), builder.add(quarters[2], quarters[3]))


def _splat(builder, value, lanes):
    """<lanes x float> of the float `value` in every lane."""
    vec = ir.VectorType(value.type, lanes)
    one = builder.insert_element(ir.Constant(vec, None), value, ir.Constant(ir.IntType(32), 0))
    return _lanes(builder, one, [0] * lanes)


def _selected_row(builder, ary, sel_ptr, t0, i):
    """An i8 pointer to row sel[t0 + i] of the 2-D array `ary` (a made array), by its stride: no
    view made (a view in numba code is two atomic reference counts, as much as a short dot)."""
    i64 = ir.IntType(64)
    row = builder.load(builder.gep(sel_ptr, [builder.add(t0, ir.Constant(i64, i))]))
    stride = cgutils.unpack_tuple(builder, ary.strides)[0]
    base = builder.bitcast(ary.data, ir.IntType(8).as_pointer())
    return builder.gep(base, [builder.mul(row, stride)])


def _accumulators(builder, vec, tokens, chains):
    """accs[i][c]: `chains` zeroed float vector accumulators (allocas of type vec) per token."""
    zero = _const(vec, 0.0)
    return [[cgutils.alloca_once_value(builder, zero) for _ in range(chains)]
            for _ in range(tokens)]  # fmt: skip


def _chained_blocks(builder, blocks, chains, add_block):
    """add_block(b, c) for b < blocks (an i64 value), c the accumulator: b % chains for the
    whole rounds of `chains` blocks, 0 for the blocks after them. Independent accumulators, so
    that a block's multiply-add does not wait for the one before it."""
    i64 = ir.IntType(64)
    step = ir.Constant(i64, chains)
    rounds = builder.udiv(blocks, step)
    with cgutils.for_range(builder, rounds) as loop:
        first = builder.mul(loop.index, step)
        for c in range(chains):
            add_block(builder.add(first, ir.Constant(i64, c)), c)
    with cgutils.for_range(builder, builder.sub(blocks, builder.mul(rounds, step))) as lp:
        add_block(builder.add(builder.mul(rounds, step), lp.index), 0)


def _hsum(builder, accs):
    """The sum of every lane of the float vector accumulators `accs` (allocas)."""
    total = builder.load(accs[0])
    for acc in accs[1:]:
        total = _fast(builder.fadd(total, builder.load(acc)))
    width = total.type.count // 2
    while width:  # the upper half of the lanes added onto the lower
        hi = _lanes(builder, total, range(width, 2 * width))
        total = _fast(builder.fadd(_lanes(builder, total, range(width)), hi))
        width //= 2
    return builder.extract_element(total, ir.Constant(ir.IntType(32), 0))


def _add_scaled(builder, acc, values, scales):
    """acc (an alloca) += values * scales, lane by lane (one fma)."""
    new = _fast(builder.fadd(builder.load(acc), _fast(builder.fmul(values, scales))))
    builder.store(new, acc)


def _store_dots(builder, dots_ptr, o, accs):
    """dots[o + i] = the sum of every lane of token i's accumulators accs[i]."""
    for i, token_accs in enumerate(accs):
        out = builder.gep(dots_ptr, [builder.add(o, ir.Constant(ir.IntType(64), i))])
        builder.store(_hsum(builder, token_accs), out)


def _by_token_count(builder, n, dot_rows):
    """dot_rows(tokens) compiled for each count 1 to DOT_TOKENS, the one equal to n (an i64
    value) run: each count's loop keeps its tokens' accumulators in registers."""
    for tokens in range(1, DOT_TOKENS + 1):
        with builder.if_then(builder.icmp_signed("==", n, ir.Constant(ir.IntType(64), tokens))):
            dot_rows(tokens)


# independent float accumulators in the integer dot: each block's multiply-add waits for the
# previous one into the same accumulator (4 cycles), and one chain made T=4 calls ~6x slower
# per token
Q8_CHAINS = 4


def _int_dot_rows(context, builder, signature, args, weights, block_scales):
    """codegen of the integer dots of one weight row with up to DOT_TOKENS tokens in one pass:
    args (w, x, xs, sel, t0, n, blocks, ..., dots, o). Per block b: weights(b) -> the
    _signed_weights of its <32 x i8> values, once; per token i (x row sel[t0 + i]):
    _block_sums, to float, times block_scales(b, x_scale) (<8 x float>), into `chains`
    accumulators; dots[o + i] = their horizontal sum."""
    f32x8, v32i8 = ir.VectorType(ir.FloatType(), 8), ir.VectorType(ir.IntType(8), 32)
    x, xs, sel, t0, n, blocks = args[1:7]
    dots, o = args[-2], args[-1]
    x_ary = context.make_array(signature.args[1])(context, builder, x)
    xs_ary = context.make_array(signature.args[2])(context, builder, xs)
    sel_ptr = context.make_array(signature.args[3])(context, builder, sel).data
    dots_ptr = context.make_array(signature.args[-2])(context, builder, dots).data

    def dot_rows(tokens):
        chains = max(1, Q8_CHAINS // tokens)
        xrows, srows = [], []
        for i in range(tokens):
            x_row = _selected_row(builder, x_ary, sel_ptr, t0, i)
            xrows.append(builder.bitcast(x_row, v32i8.as_pointer()))
            s_row = _selected_row(builder, xs_ary, sel_ptr, t0, i)
            srows.append(builder.bitcast(s_row, ir.FloatType().as_pointer()))
        accs = _accumulators(builder, f32x8, tokens, chains)

        def add_block(b, c):
            wts = weights(b)
            for i in range(tokens):
                xv = builder.load(builder.gep(xrows[i], [b]), align=1)
                sums = builder.sitofp(_block_sums(builder, wts, xv), f32x8)
                scale = block_scales(b, builder.load(builder.gep(srows[i], [b])))
                _add_scaled(builder, accs[i][c], sums, scale)

        _chained_blocks(builder, blocks, chains, add_block)
        _store_dots(builder, dots_ptr, o, accs)

    _by_token_count(builder, n, dot_rows)
    return context.get_dummy_value()


def _data(context, builder, signature, args, n):
    """The data pointers of the first n (array) arguments."""
    arrays = zip(signature.args[:n], args[:n], strict=True)
    return [context.make_array(t)(context, builder, a).data for t, a in arrays]


@intrinsic
def quantize_block(typingctx, v, lo, q, at):
    """One Q8_0 block of 32 in vector lanes: d = max |v[lo : lo + 32]| / 127, q[at : at + 32] =
    rint(v / d) as int8 (0 where d is 0), IEEE division and ties to even (the reference's
    torch.round); returns d. As numba loops, the max did not vectorise (32 vmaxss in a chain)
    and a loop of 32 known iterations unrolled to scalar divisions: 2.1 us a row of 2048."""

    def codegen(context, builder, signature, args):
        (v_data,) = _data(context, builder, signature, args, 1)
        q_data = context.make_array(signature.args[2])(context, builder, args[2]).data
        f32 = ir.FloatType()
        vec = ir.VectorType(f32, Q8_BLOCK)
        block = builder.load(builder.bitcast(builder.gep(v_data, [args[1]]), vec.as_pointer()),
                             align=4)  # fmt: skip
        amax = _call(builder, f"llvm.vector.reduce.fmax.v{Q8_BLOCK}f32", f32,
                     [_call(builder, f"llvm.fabs.v{Q8_BLOCK}f32", vec, [block])])  # fmt: skip
        d = builder.fdiv(amax, ir.Constant(f32, 127.0))
        nonzero = builder.fcmp_ordered(">", d, ir.Constant(f32, 0.0))
        divisor = builder.select(nonzero, d, ir.Constant(f32, 1.0))
        ratios = builder.fdiv(block, _splat(builder, divisor, Q8_BLOCK))
        rounded = _call(builder, f"llvm.roundeven.v{Q8_BLOCK}f32", vec, [ratios])
        i8s = ir.VectorType(ir.IntType(8), Q8_BLOCK)
        codes = builder.trunc(builder.fptosi(rounded, ir.VectorType(ir.IntType(32), Q8_BLOCK)),
                              i8s)  # fmt: skip
        codes = builder.select(nonzero, codes, _const(i8s, 0))
        builder.store(codes, builder.bitcast(builder.gep(q_data, [args[3]]), i8s.as_pointer()),
                      align=1)  # fmt: skip
        return d

    return types.float32(v, lo, q, at), codegen


@intrinsic
def q8_dot_rows(typingctx, w, x, xs, sel, t0, n, blocks, dots, o):
    """dots[o + i] = sum over b < blocks of xs[r, b] * (the int32 dot of w and x[r] over
    [32 b, 32 b + 32)), r = sel[t0 + i], float32, for i < n (1 to DOT_TOKENS): every token's dot
    in one pass over the row w (int8 [C]); x int8 [T, C] (values in [-127, 127]), xs float32
    [T, C / 32] its block scales. Vector IR, because numba widens int8 products to int64 lanes:
    per block, the integer sums of _block_sums, converted to float and multiplied by the
    block's scale (the shape of llama.cpp's Q8_0 dot)."""

    def codegen(context, builder, signature, args):
        (w_ptr,) = _data(context, builder, signature, args, 1)
        w_ptr = builder.bitcast(w_ptr, ir.VectorType(ir.IntType(8), Q8_BLOCK).as_pointer())

        def weights(b):
            return _signed_weights(builder, builder.load(builder.gep(w_ptr, [b]), align=1))

        def block_scales(b, x_scale):
            return _splat(builder, x_scale, 8)

        return _int_dot_rows(context, builder, signature, args, weights, block_scales)

    return types.void(w, x, xs, sel, t0, n, blocks, dots, o), codegen


# e2m1 values times 2, by code: integers, so that a byte table (vpshufb) decodes them exactly
E2M1_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _e2m1_x2(builder, codes, table):
    """<32 x i8> twice the e2m1 values of codes <32 x i8> (0..15): vpshufb from `table`; without
    AVX2 (the kernel then keeps nvfp4's float path, but this still compiles) in arithmetic:
    magnitude m < 4: m, m < 6: 2m - 4, else 4m - 16; code bit 3 the sign."""
    if AVX2:
        return _call(builder, "llvm.x86.avx2.pshuf.b", codes.type, [table, codes])
    return _e2m1_x2_arithmetic(builder, codes)


def _e2m1_x2_arithmetic(builder, codes):
    """_e2m1_x2 in generic IR, for any number of codes."""
    vec = codes.type

    def c(v):
        return ir.Constant(vec, [v] * vec.count)

    m = builder.and_(codes, c(7))
    twice, four = builder.sub(builder.shl(m, c(1)), c(4)), builder.sub(builder.shl(m, c(2)), c(16))
    big = builder.select(builder.icmp_unsigned("<", m, c(6)), twice, four)
    mag = builder.select(builder.icmp_unsigned("<", m, c(4)), m, big)
    negative = builder.icmp_unsigned("!=", builder.and_(codes, c(8)), c(0))
    return builder.select(negative, builder.sub(c(0), mag), mag)


def _e2m1_codes(builder, packed):
    """<32 x i8> codes of 16 packed bytes (element 2j in byte j's low nibble)."""
    i32, v16i8 = ir.IntType(32), packed.type
    lo, hi = builder.and_(packed, _const(v16i8, 15)), builder.lshr(packed, _const(v16i8, 4))
    order = [j // 2 + 16 * (j % 2) for j in range(32)]  # lo 0, hi 0, lo 1, hi 1, ...
    return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(i32, 32), order))


@intrinsic
def nvfp4_q8_dot_rows(typingctx, w, x, xs, sel, t0, n, blocks, gs, dots, o):
    """q8_dot_rows for an nvfp4 row: dots[o + i] = sum over blocks b < blocks, groups g = 2b,
    2b + 1 of 16 elements: gs[g] * xs[r, b] * (the int32 dot of 2 * e2m1(w) and x[r] over group
    g), float32 (twice the dot of the e2m1 values), r = sel[t0 + i]. w uint8 two e2m1 codes a
    byte (element 2j low nibble), 16 bytes a block, decoded once for every token; gs float32
    [2 b]: w's group scales."""

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        v16i8, v32i8 = ir.VectorType(ir.IntType(8), 16), ir.VectorType(ir.IntType(8), 32)
        (w_ptr,) = _data(context, builder, signature, args, 1)
        gs_ptr = context.make_array(signature.args[7])(context, builder, args[7]).data
        w_ptr = builder.bitcast(w_ptr, v16i8.as_pointer())
        gs_ptr = builder.bitcast(gs_ptr, ir.VectorType(f32, 2).as_pointer())
        table = ir.Constant(v32i8, [v & 0xFF for v in E2M1_X2 * 2])  # both 128-bit lanes

        def weights(b):
            codes = _e2m1_codes(builder, builder.load(builder.gep(w_ptr, [b]), align=1))
            return _signed_weights(builder, _e2m1_x2(builder, codes, table))

        def block_scales(b, x_scale):
            groups = builder.load(builder.gep(gs_ptr, [b]), align=4)  # <2 x float>
            pair = _fast(builder.fmul(groups, _splat(builder, x_scale, 2)))
            return _lanes(builder, pair, [0] * 4 + [1] * 4)

        return _int_dot_rows(context, builder, signature, args, weights, block_scales)

    return types.void(w, x, xs, sel, t0, n, blocks, gs, dots, o), codegen


# nvfp4's wide integer dot: blocks of 64 elements, one instruction's (vpdpbusd) with AVX512-VNNI
# and -BW (Ice Lake, Sapphire Rapids, Zen 4), two halves' with AVX2. The activation is laid out
# for it once per call (layer_kernel._quantize_wide), so that a row needs no shuffle: per block its
# codes' low nibbles (the even elements) then its high nibbles (the odd ones), the activation's
# bytes in that order; the weights are the unsigned twice-e2m1 + WIDE_BIAS (0..24: x86 multiplies
# unsigned by signed bytes, so no sign is moved onto x per token; 2 * 24 * 127 < 2^15, so AVX2's
# 16-bit pair sums hold), and each lane's sum starts from -WIDE_BIAS times the sum of its
# activation bytes, which leaves it exact. A block's 16 quads (4 neighbouring bytes: quad q < 8
# the even elements of 8q .. 8q + 7, quad q + 8 their odd ones) are 16 int32 lanes with
# AVX512-VNNI; with AVX2 the even and odd halves are dotted apart and their sums added in 8 lanes
# (lane l: quads l and l + 8), so each lane's scale serves both halves: one float conversion and
# multiply-add per 64 elements, where blocks of 32 took one per 32 and a shuffle per 32 to split
# the nibbles (one AVX2 EPYC core, a row of 2048: one token 154 -> 106 ns, four 298 -> 250).
WIDE_BLOCK = 64  # elements a block: 32 code bytes
WIDE_LANES = 16 if AVX512VNNI else 8  # int32 lanes of a block's dot
WIDE_BIAS = 12  # -min(twice e2m1)
# lane l's 16-column group and 32-column activation block within its block (elements 8l' ..
# 8l' + 7, l' = l % 8)
WIDE_LANE_GROUP = tuple((lane % 8) // 2 for lane in range(WIDE_LANES))
WIDE_LANE_Q8 = tuple((lane % 8) // 4 for lane in range(WIDE_LANES))


@intrinsic
def wide_layout(typingctx, lin, q, at, c, lanes_at):
    """One block of an activation's int8 codes in the wide layout: q[at : at + WIDE_BLOCK] = the
    block's codes lin [WIDE_BLOCK] (in element order) reordered, its even elements' then its odd
    ones'; c[lanes_at + lane] = -WIDE_BIAS times the sum of the lane's quads (4 bytes of the
    reordered block: quads lane, lane + WIDE_LANES, ...). In vector lanes: as scalar loops, this
    took most of the time an activation row took to quantise (nvfp4, a row of 2048: 4.0 us)."""

    def codegen(context, builder, signature, args):
        lin_data, q_data = _data(context, builder, signature, args, 2)
        c_data = context.make_array(signature.args[3])(context, builder, args[3]).data
        i8, i32 = ir.IntType(8), ir.IntType(32)
        block = ir.VectorType(i8, WIDE_BLOCK)
        codes = builder.load(builder.bitcast(lin_data, block.as_pointer()), align=1)
        order = [*range(0, WIDE_BLOCK, 2), *range(1, WIDE_BLOCK, 2)]
        wide = _lanes(builder, codes, order)
        builder.store(wide, builder.bitcast(builder.gep(q_data, [args[2]]), block.as_pointer()),
                      align=1)  # fmt: skip
        ints = builder.sext(wide, ir.VectorType(i32, WIDE_BLOCK))
        quads = WIDE_BLOCK // 4
        sums = _lanes(builder, ints, range(0, WIDE_BLOCK, 4))
        for b in range(1, 4):
            sums = builder.add(sums, _lanes(builder, ints, range(b, WIDE_BLOCK, 4)))
        lanes = _lanes(builder, sums, range(WIDE_LANES))
        for first in range(WIDE_LANES, quads, WIDE_LANES):
            lanes = builder.add(lanes, _lanes(builder, sums, range(first, first + WIDE_LANES)))
        lanes_i32 = ir.VectorType(i32, WIDE_LANES)
        lanes = builder.mul(lanes, _const(lanes_i32, -WIDE_BIAS))
        ptr = builder.bitcast(builder.gep(c_data, [args[4]]), lanes_i32.as_pointer())
        builder.store(lanes, ptr, align=4)
        return context.get_dummy_value()

    return types.void(lin, q, at, c, lanes_at), codegen


def _wide_weights(builder, packed, table):
    """The unsigned twice-e2m1 + WIDE_BIAS of a block's 32 packed code bytes, as the dot takes
    them: one <64 x i8> (the low nibbles, then the high ones) with AVX512-VNNI, else two <32 x
    i8> (the low nibbles; the high ones); vpshufb from `table` (AVX2 or AVX512-BW), generic
    arithmetic elsewhere (it compiles everywhere; only AVX2 hosts run it)."""
    half = packed.type
    lo = builder.and_(packed, _const(half, 15))
    hi = builder.and_(builder.lshr(packed, _const(half, 4)), _const(half, 15))
    if AVX512VNNI:
        vec = ir.VectorType(ir.IntType(8), 2 * half.count)
        both = ir.Constant(ir.VectorType(ir.IntType(32), vec.count), list(range(vec.count)))
        codes = builder.shuffle_vector(lo, hi, both)
        return [_call(builder, "llvm.x86.avx512.pshuf.b.512", vec, [table, codes])]
    if AVX2:
        return [_call(builder, "llvm.x86.avx2.pshuf.b", half, [table, c]) for c in (lo, hi)]
    return [builder.add(_e2m1_x2_arithmetic(builder, c), _const(half, WIDE_BIAS)) for c in (lo, hi)]


def _wide_sums(builder, start, weights, xvs):
    """start plus a block's dot in its lanes (_wide_weights' weights, the activation's bytes
    alike). With AVX2 and no VNNI the two halves' 16-bit pair sums (vpmaddubsw) are added before
    the one vpmaddwd: |2 * 2 * 24 * 127| < 2^15, so no sum saturates, and one instruction of the
    multiplier's port is spared per block and token."""
    if len(weights) == 2 and AVX2 and not VNNI:
        v16i16 = ir.VectorType(ir.IntType(16), 16)
        pairs = [_call(builder, "llvm.x86.avx2.pmadd.ub.sw", v16i16, [w, x])
                 for w, x in zip(weights, xvs, strict=True)]  # fmt: skip
        quads = _call(builder, "llvm.x86.avx2.pmadd.wd", start.type,
                      [builder.add(pairs[0], pairs[1]), _const(v16i16, 1)])  # fmt: skip
        return builder.add(start, quads)
    for wv, xv in zip(weights, xvs, strict=True):
        start = _quad_sums(builder, start, wv, xv)
    return start


@intrinsic
def nvfp4_q8_dot_rows_wide(typingctx, w, x, xs, xc, sel, t0, n, blocks, gs, dots, o):
    """nvfp4_q8_dot_rows by blocks of WIDE_BLOCK elements: dots[o + i] = sum over blocks b <
    blocks of the twice-e2m1 codes of w times the activation row r = sel[t0 + i], in integers per
    lane, times its group's scale gs[b * WIDE_BLOCK / 16 + WIDE_LANE_GROUP[lane]] and the lane's
    activation scale xs[r, b * WIDE_LANES + lane]. x int8 [T, C], xs float32 and xc int32
    [T, C / WIDE_BLOCK * WIDE_LANES]: the activation in the wide layout
    (layer_kernel._quantize_wide); w uint8 [C / 2], two codes a byte (element 2j low nibble); gs
    float32 [C / 16]."""

    def codegen(context, builder, signature, args):
        i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
        packed = ir.VectorType(i8, WIDE_BLOCK // 2)
        halves = 1 if AVX512VNNI else 2  # the weights' vectors a block (_wide_weights)
        part = ir.VectorType(i8, WIDE_BLOCK // halves)
        lanes_i32, lanes_f32 = ir.VectorType(i32, WIDE_LANES), ir.VectorType(f32, WIDE_LANES)
        t0, n, blocks, o = args[5], args[6], args[7], args[10]
        w, x, xs, xc, sel, gs, dots = (context.make_array(signature.args[j])(context, builder,
                                       args[j]) for j in (0, 1, 2, 3, 4, 8, 9))  # fmt: skip
        w_ptr = builder.bitcast(w.data, packed.as_pointer())
        gs_ptr = builder.bitcast(gs.data, ir.VectorType(f32, WIDE_BLOCK // 16).as_pointer())
        dots_ptr, sel_ptr, arrays = dots.data, sel.data, (x, xs, xc)
        table = ir.Constant(part, [v + WIDE_BIAS for v in E2M1_X2] * (part.count // 16))

        def dot_rows(tokens):
            chains = max(1, Q8_CHAINS // tokens)
            rows = []
            for i in range(tokens):
                x_row, s_row, c_row = (_selected_row(builder, a, sel_ptr, t0, i) for a in arrays)
                rows.append((builder.bitcast(x_row, part.as_pointer()),
                             builder.bitcast(s_row, lanes_f32.as_pointer()),
                             builder.bitcast(c_row, lanes_i32.as_pointer())))  # fmt: skip
            accs = _accumulators(builder, lanes_f32, tokens, chains)

            def add_block(b, c):
                weights = _wide_weights(builder, builder.load(builder.gep(w_ptr, [b]), align=1),
                                        table)  # fmt: skip
                groups = builder.load(builder.gep(gs_ptr, [b]), align=4)
                gsv = _lanes(builder, groups, WIDE_LANE_GROUP)
                for i, (x_row, s_row, c_row) in enumerate(rows):
                    start = builder.load(builder.gep(c_row, [b]), align=4)
                    xvs = []
                    for h in range(halves):
                        at = builder.add(builder.mul(b, ir.Constant(b.type, halves)),
                                         ir.Constant(b.type, h))  # fmt: skip
                        xvs.append(builder.load(builder.gep(x_row, [at]), align=1))
                    sums = _wide_sums(builder, start, weights, xvs)
                    scale = _fast(builder.fmul(gsv, builder.load(builder.gep(s_row, [b]), align=4)))
                    _add_scaled(builder, accs[i][c], builder.sitofp(sums, lanes_f32), scale)

            _chained_blocks(builder, blocks, chains, add_block)
            _store_dots(builder, dots_ptr, o, accs)

        _by_token_count(builder, n, dot_rows)
        return context.get_dummy_value()

    return types.void(w, x, xs, xc, sel, t0, n, blocks, gs, dots, o), codegen


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
AVX512BW = bool(_TARGET.get("avx512bw"))  # vpermw: the bf16 decodes' tables
BF16_BLOCK = 32  # elements per vdpbf16ps (512 bits of bf16)
BF16_CHAINS = 4  # independent accumulators: a vdpbf16ps waits ~5 cycles on its accumulator


def _bf16_block(builder, acc, wv, xv):
    """acc <16 x float> plus the products of wv and xv (<32 x i16> bf16 bits), neighbours
    added: vdpbf16ps with AVX512-BF16, else the same in generic IR (bits shifted to float32)."""
    f32x16 = acc.type
    if AVX512BF16:
        bf = ir.VectorType(_BFloat(), BF16_BLOCK)
        wb, xb = builder.bitcast(wv, bf), builder.bitcast(xv, bf)
        return _call(builder, "llvm.x86.avx512bf16.dpbf16ps.512", f32x16, [acc, wb, xb])
    f32x32, v32i32 = ir.VectorType(ir.FloatType(), 32), ir.VectorType(ir.IntType(32), 32)

    def f32(v):
        return builder.bitcast(builder.shl(builder.zext(v, v32i32), _const(v32i32, 16)), f32x32)

    prod = _fast(builder.fmul(f32(wv), f32(xv)))
    pairs = _fast(builder.fadd(_lanes(builder, prod, range(0, 32, 2)),
                               _lanes(builder, prod, range(1, 32, 2))))  # fmt: skip
    return _fast(builder.fadd(acc, pairs))


# The row dot's scalings: a block's products as they are, times one scale per 4 blocks
# (fp8_block: 128 columns), times one per 16 columns (nvfp4's groups)
PLAIN, PER_128, PER_16 = 0, 1, 2
FP8_BLOCK = 128  # fp8_block's columns per scale


def _row_dot_operands(context, builder, signature, args, w_block, x_block=None):
    """The pointers of a row dot's arguments (w, vb, sel, t0, n, blocks, s, dots, o): w's as
    blocks of the vector type w_block, s's and dots' as they are, and x_row(i): token t0 + i's
    activations (row sel[t0 + i] of vb, by its stride: no view) as blocks of x_block (default:
    <32 x i16>, bf16 bits)."""
    x_block = x_block or ir.VectorType(ir.IntType(16), BF16_BLOCK)
    w_ty, vb_ty, sel_ty, _, _, _, s_ty, dots_ty, _ = signature.args
    w, vb, sel, t0, _, _, s, dots, _ = args
    w_ptr = builder.bitcast(context.make_array(w_ty)(context, builder, w).data,
                            w_block.as_pointer())  # fmt: skip
    vb_ary = context.make_array(vb_ty)(context, builder, vb)
    sel_ptr = context.make_array(sel_ty)(context, builder, sel).data

    def x_row(i):
        return builder.bitcast(_selected_row(builder, vb_ary, sel_ptr, t0, i), x_block.as_pointer())

    s_ptr = context.make_array(s_ty)(context, builder, s).data
    dots_ptr = context.make_array(dots_ty)(context, builder, dots).data
    return w_ptr, x_row, s_ptr, dots_ptr


def _bf16_dot_rows(scaling):
    """codegen of bf16_dot_rows for one scaling."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        f32, f32x16 = ir.FloatType(), ir.VectorType(ir.FloatType(), 16)
        v32i16 = ir.VectorType(ir.IntType(16), BF16_BLOCK)
        n, blocks, o = args[4], args[5], args[8]
        w_ptr, x_row, s_ptr, dots_ptr = _row_dot_operands(context, builder, signature, args, v32i16)

        def scales(b):  # the block's per-lane scales (None: PLAIN)
            if scaling == PER_128:
                per_scale = ir.Constant(i64, FP8_BLOCK // BF16_BLOCK)
                one = builder.load(builder.gep(s_ptr, [builder.udiv(b, per_scale)]))
                return _splat(builder, one, 16)
            if scaling == PER_16:  # vdpbf16ps's lane L sums elements 2L, 2L + 1: lanes 0-7 are
                pairs = builder.bitcast(s_ptr, ir.VectorType(f32, 2).as_pointer())  # group 2b
                pair = builder.load(builder.gep(pairs, [b]), align=4)
                return _lanes(builder, pair, [0] * 8 + [1] * 8)
            return None

        def dot_rows(tokens):
            """dots[o + i] for i < tokens, one pass over w; each token's blocks into `chains`
            accumulators (a vdpbf16ps waits ~5 cycles on its accumulator)."""
            chains = max(1, BF16_CHAINS // tokens)
            xs = [x_row(i) for i in range(tokens)]
            accs = _accumulators(builder, f32x16, tokens, chains)

            def add_block(b, c):
                wv = builder.load(builder.gep(w_ptr, [b]), align=2)
                sv = scales(b)
                for i in range(tokens):
                    xv = builder.load(builder.gep(xs[i], [b]), align=2)
                    acc = accs[i][c]
                    if sv is None:
                        builder.store(_bf16_block(builder, builder.load(acc), wv, xv), acc)
                    else:
                        prod = _bf16_block(builder, _const(f32x16, 0.0), wv, xv)
                        _add_scaled(builder, acc, prod, sv)

            _chained_blocks(builder, blocks, chains, add_block)
            _store_dots(builder, dots_ptr, o, accs)

        _by_token_count(builder, n, dot_rows)
        return context.get_dummy_value()

    return codegen


@intrinsic
def bf16_dot_rows(typingctx, w, vb, sel, t0, n, blocks, s, dots, o):
    """dots[o + i] = sum over b < blocks, j < 32 of w[32 b + j] * vb[sel[t0 + i], 32 b + j],
    float32, for i < n (1 to DOT_TOKENS): every token's dot in one pass over the row w. w, vb
    bf16 bits (vb's rows contiguous); per 32: one vdpbf16ps (AVX512-BF16; generic IR elsewhere)
    a token. s is not read (the scaled variants' argument)."""
    return types.void(w, vb, sel, t0, n, blocks, s, dots, o), _bf16_dot_rows(PLAIN)


@intrinsic
def bf16_dot_rows_per_128(typingctx, w, vb, sel, t0, n, blocks, s, dots, o):
    """bf16_dot_rows with each block's products times s[b // 4]: fp8_block's row, a scale per
    128 columns."""
    return types.void(w, vb, sel, t0, n, blocks, s, dots, o), _bf16_dot_rows(PER_128)


@intrinsic
def bf16_dot_rows_per_16(typingctx, w, vb, sel, t0, n, blocks, s, dots, o):
    """bf16_dot_rows with element j's products times s[j // 16]: nvfp4's group scales."""
    return types.void(w, vb, sel, t0, n, blocks, s, dots, o), _bf16_dot_rows(PER_16)


@intrinsic
def e4m3_dot_rows(typingctx, codes, vb, sel, t0, n, groups, s, dots, o):
    """dots[o + i] = sum over g < groups of s[g] * (the dot of the e4m3 codes [128 g, 128 g +
    128) and vb[sel[t0 + i]] there), float32, for i < n (1 to DOT_TOKENS): fp8_block's row
    decoded in registers (_e4m3_bf16, AVX512-BW) and dotted by vdpbf16ps, its scale applied once
    per 128 columns; no decoded copy of the row is written. codes uint8, vb bf16 bits."""

    def codegen(context, builder, signature, args):
        i64 = ir.IntType(64)
        f32x16, v32i8 = ir.VectorType(ir.FloatType(), 16), ir.VectorType(ir.IntType(8), 32)
        n, groups, o = args[4], args[5], args[8]
        c_ptr, x_row, s_ptr, dots_ptr = _row_dot_operands(context, builder, signature, args, v32i8)
        per_group = FP8_BLOCK // BF16_BLOCK

        def dot_rows(tokens):
            chains = max(1, BF16_CHAINS // tokens)
            xs = [x_row(i) for i in range(tokens)]
            accs = _accumulators(builder, f32x16, tokens, chains)

            def add_group(g, c):
                sums = [_const(f32x16, 0.0)] * tokens
                for j in range(per_group):
                    b = builder.add(builder.mul(g, ir.Constant(i64, per_group)),
                                    ir.Constant(i64, j))  # fmt: skip
                    wv = _e4m3_bf16(builder, builder.load(builder.gep(c_ptr, [b]), align=1))
                    for i in range(tokens):
                        xv = builder.load(builder.gep(xs[i], [b]), align=2)
                        sums[i] = _bf16_block(builder, sums[i], wv, xv)
                scale = _splat(builder, builder.load(builder.gep(s_ptr, [g])), 16)
                for i in range(tokens):
                    _add_scaled(builder, accs[i][c], sums[i], scale)

            _chained_blocks(builder, groups, chains, add_group)
            _store_dots(builder, dots_ptr, o, accs)

        _by_token_count(builder, n, dot_rows)
        return context.get_dummy_value()

    return types.void(codes, vb, sel, t0, n, groups, s, dots, o), codegen


# -- rows decoded 32 elements at a time, to bf16 bits (exact: every value the formats hold fits
# bf16's 8 significant bits) or to float32, by the output array's dtype -----------------------


def _put32(builder, values, out_ptr, b):
    """Block b of out = the <32 x float> values, as out's dtype holds them: bf16 bits (the upper
    half of each float32; exact for the values decoded here) or float32."""
    i16, i32 = ir.IntType(16), ir.IntType(32)
    if out_ptr.type.pointee == i16:
        bits = builder.lshr(builder.bitcast(values, ir.VectorType(i32, 32)),
                            _const(ir.VectorType(i32, 32), 16))  # fmt: skip
        values = builder.trunc(bits, ir.VectorType(i16, 32))
        align = 2
    else:
        align = 4
    ptr = builder.bitcast(out_ptr, values.type.as_pointer())
    builder.store(values, builder.gep(ptr, [b]), align=align)


def _row_decoder(count_arg, decode_block):
    """codegen: for b < args[count_arg]: decode_block(builder, pointers, b) -> <32 x float>,
    stored at block b of the last array argument."""

    def codegen(context, builder, signature, args):
        ptrs = _data(context, builder, signature, args, count_arg)
        with cgutils.for_range(builder, args[count_arg]) as loop:
            _put32(builder, decode_block(builder, ptrs, loop.index), ptrs[-1], loop.index)
        return context.get_dummy_value()

    return codegen


def _load_bytes(builder, ptr, b, n):
    vec = ir.VectorType(ir.IntType(8), n)
    return builder.load(builder.gep(builder.bitcast(ptr, vec.as_pointer()), [b]), align=1)


_F32X32 = ir.VectorType(ir.FloatType(), 32)


def _check_out(out):
    if not (isinstance(out, types.Array) and out.dtype in (types.uint16, types.float32)):
        raise TypeError("the decoded row is uint16 (bf16 bits) or float32")


@intrinsic
def decode_int8(typingctx, src, out, blocks):
    """out[:32 blocks] = the int8 codes src as numbers (bf16 bits or float32)."""
    _check_out(out)

    def block(builder, ptrs, b):
        return builder.sitofp(_load_bytes(builder, ptrs[0], b, 32), _F32X32)

    return types.void(src, out, blocks), _row_decoder(2, block)


# bf16 bits of the e4m3 subnormals m x 2^-9, by m (0: zero), for vpermw
_E4M3_SUBNORMAL_BF16 = [0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60]


def _e4m3_bf16(builder, codes):
    """<32 x i16> bf16 bits of the e4m3 codes <32 x i8>, in 16-bit lanes (32 a vector, against
    16 for _e4m3_f32's float lanes): a normal's exponent and mantissa moved up and rebiased
    (+120), a subnormal's bits from an 8-entry table (vpermw); the sign on top."""
    v32i16 = ir.VectorType(ir.IntType(16), 32)

    def c(v):
        return _const(v32i16, v)

    b = builder.zext(codes, v32i16)
    mag = builder.and_(b, c(0x7F))
    normal = builder.add(builder.shl(mag, c(4)), c(120 << 7))
    if AVX512BW:
        table = ir.Constant(v32i16, _E4M3_SUBNORMAL_BF16 + [0] * 24)
        small = _call(builder, "llvm.x86.avx512.permvar.hi.512", v32i16, [table, mag])
    else:  # generic IR's selects (this compiles everywhere; only AVX512-BW hosts run it)
        small = c(0)
        for m, bits in enumerate(_E4M3_SUBNORMAL_BF16):
            small = builder.select(builder.icmp_unsigned("==", mag, c(m)), c(bits), small)
    bits = builder.select(builder.icmp_unsigned("<", mag, c(8)), small, normal)
    return builder.or_(bits, builder.shl(builder.and_(b, c(0x80)), c(8)))


@intrinsic
def decode_e4m3(typingctx, src, out, blocks):
    """out[:32 blocks] = the e4m3 codes src (uint8) as numbers (bf16 bits or float32). bf16 bits
    on AVX512-BF16 hosts come straight from the codes in 16-bit lanes (_e4m3_bf16)."""
    _check_out(out)
    direct = out.dtype == types.uint16 and AVX512BW

    def codegen(context, builder, signature, args):
        src_ptr, out_ptr = _data(context, builder, signature, args, 2)
        with cgutils.for_range(builder, args[2]) as loop:
            codes = _load_bytes(builder, src_ptr, loop.index, 32)
            if direct:
                ptr = builder.bitcast(out_ptr, ir.VectorType(ir.IntType(16), 32).as_pointer())
                builder.store(_e4m3_bf16(builder, codes), builder.gep(ptr, [loop.index]), align=2)
            else:
                wide = builder.zext(codes, ir.VectorType(ir.IntType(32), 32))
                _put32(builder, _e4m3_f32(builder, wide), out_ptr, loop.index)
        return context.get_dummy_value()

    return types.void(src, out, blocks), codegen


@intrinsic
def decode_e2m1(typingctx, src, groups, out, blocks):
    """out[:32 blocks] = e2m1(code j) * groups[j // 16] (bf16 bits or float32): src uint8 two
    codes a byte (element 2j low nibble), groups float32 [2 blocks] (exact in bf16 for e4m3
    group scales: at most 2 + 4 significant bits). Codes by vpshufb as twice their value."""
    _check_out(out)

    def block(builder, ptrs, b):
        v32i8 = ir.VectorType(ir.IntType(8), 32)
        codes = _e2m1_codes(builder, _load_bytes(builder, ptrs[0], b, 16))
        table = ir.Constant(v32i8, [v & 0xFF for v in E2M1_X2 * 2])
        twice = builder.sitofp(_e2m1_x2(builder, codes, table), _F32X32)
        gptr = builder.bitcast(ptrs[1], ir.VectorType(ir.FloatType(), 2).as_pointer())
        pair = builder.load(builder.gep(gptr, [b]), align=4)
        half = _fast(builder.fmul(pair, _const(pair.type, 0.5)))
        return builder.fmul(twice, _lanes(builder, half, [0] * 16 + [1] * 16))

    return types.void(src, groups, out, blocks), _row_decoder(3, block)


# bf16 bits of the e2m1 values, by code
E2M1_BF16 = (0, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
             0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0)  # fmt: skip


@intrinsic
def decode_e2m1_bf16(typingctx, src, out, blocks):
    """out[:32 blocks] = bf16 bits of the e2m1 codes src (two a byte, element 2j low nibble),
    their group scales not applied (bf16_dot_rows_per_16 applies them): one vpermw per 32 codes
    (AVX512-BW; generic IR's selects elsewhere)."""
    if not (isinstance(out, types.Array) and out.dtype == types.uint16):
        raise TypeError("decode_e2m1_bf16 writes bf16 bits: out is uint16")

    def codegen(context, builder, signature, args):
        v32i16 = ir.VectorType(ir.IntType(16), 32)
        src_ptr, out_ptr = _data(context, builder, signature, args, 2)
        out_ptr = builder.bitcast(out_ptr, v32i16.as_pointer())
        table = ir.Constant(v32i16, list(E2M1_BF16) * 2)
        with cgutils.for_range(builder, args[2]) as loop:
            codes = builder.zext(_e2m1_codes(builder, _load_bytes(builder, src_ptr, loop.index,
                                                                   16)), v32i16)  # fmt: skip
            if AVX512BW:
                bits = _call(builder, "llvm.x86.avx512.permvar.hi.512", v32i16, [table, codes])
            else:
                bits = _const(v32i16, 0)
                for code, value in enumerate(E2M1_BF16):
                    hit = builder.icmp_unsigned("==", codes, _const(v32i16, code))
                    bits = builder.select(hit, _const(v32i16, value), bits)
            builder.store(bits, builder.gep(out_ptr, [loop.index]), align=2)
        return context.get_dummy_value()

    return types.void(src, out, blocks), codegen


# -- float32 activations: bf16 and e4m3 rows decoded in registers and dotted there (AVX2 hosts
# without the bf16 dot) ------------------------------------------------------------------------

F16C = bool(_TARGET.get("f16c"))  # vcvtph2ps: every AVX2 CPU has it
F32_STEP = 16  # weights decoded a step: two 8-float registers on AVX2
F32_CHAINS = 4  # independent accumulators: an fma waits ~4 cycles on its accumulator


def _e4m3_f32_scaled(builder, codes):
    """<16 x float> of the e4m3 codes <16 x i8>, times 2^-8: the code's bits, sign to bit 15 and
    exponent and mantissa to bits 13..7, are an IEEE half of that value exactly (subnormals too:
    e4m3's bias 7 against half's 15); vcvtph2ps (F16C) widens it. Without F16C, _e4m3_f32's
    integer arithmetic (this compiles everywhere; only F16C hosts run it)."""
    v16i16, f32x16 = ir.VectorType(ir.IntType(16), F32_STEP), ir.VectorType(ir.FloatType(), 16)
    if F16C:
        bits = builder.and_(builder.shl(builder.sext(codes, v16i16), _const(v16i16, 7)),
                            _const(v16i16, 0xBF80))  # fmt: skip
        halves = builder.bitcast(bits, ir.VectorType(ir.HalfType(), F32_STEP))
        return builder.fpext(halves, f32x16)
    wide = builder.zext(codes, ir.VectorType(ir.IntType(32), F32_STEP))
    return _fast(builder.fmul(_e4m3_f32(builder, wide), _const(f32x16, 2.0**-8)))


@intrinsic
def e4m3_values16(typingctx, src, dst, at):
    """dst[at : at + 16] = the float32 values of the e4m3 bytes src[at : at + 16] (nvfp4's group
    scales, a row's at a time): by F16C's vcvtph2ps, times 2^8 (exact), where one byte at a time
    in integer arithmetic took a quarter of an nvfp4 row's whole dot (26 of 105 ns a row of 2048,
    one AVX2 core)."""

    def codegen(context, builder, signature, args):
        src_data, dst_data = _data(context, builder, signature, args, 2)
        v16i8, f32x16 = ir.VectorType(ir.IntType(8), 16), ir.VectorType(ir.FloatType(), 16)
        codes = builder.load(builder.bitcast(builder.gep(src_data, [args[2]]),
                                             v16i8.as_pointer()), align=1)  # fmt: skip
        values = builder.fmul(_e4m3_f32_scaled(builder, codes), _const(f32x16, 2.0**8))
        builder.store(values, builder.bitcast(builder.gep(dst_data, [args[2]]),
                                              f32x16.as_pointer()), align=4)  # fmt: skip
        return context.get_dummy_value()

    return types.void(src, dst, at), codegen


def _f32_dot_rows(w_block, weights_of, scaled=False):
    """codegen of a row's dots with up to DOT_TOKENS float32 activation rows in one pass:
    args (w, x, sel, t0, n, steps, s, dots, o) as _row_dot_operands reads them, w in steps of
    the vector type w_block; weights_of(builder, step) -> its <16 x float> weights, fma'd into
    `chains` accumulators per token. `scaled`: a scale s[j // 8] per 8 steps (fp8_block's 128
    columns), applied to each token's sum over them, once, not to every weight."""

    def codegen(context, builder, signature, args):
        i64, f32x16 = ir.IntType(64), ir.VectorType(ir.FloatType(), F32_STEP)
        n, steps, o = args[4], args[5], args[8]
        w_ptr, x_row, s_ptr, dots_ptr = _row_dot_operands(context, builder, signature, args,
                                                          w_block, f32x16)  # fmt: skip

        def weights(j):
            return weights_of(builder, builder.load(builder.gep(w_ptr, [j]), align=1))

        def dot_rows(tokens):
            chains = max(1, F32_CHAINS // tokens)
            xs = [x_row(i) for i in range(tokens)]
            accs = _accumulators(builder, f32x16, tokens, chains)

            def add_step(j, c):
                wv = weights(j)
                for i in range(tokens):
                    xv = builder.load(builder.gep(xs[i], [j]), align=4)
                    _add_scaled(builder, accs[i][c], wv, xv)

            def add_group(g, c):  # 8 steps; two partial sums a token where registers allow
                per, parts = FP8_BLOCK // F32_STEP, 2 if tokens == 1 else 1
                sums = [[_const(f32x16, 0.0)] * parts for _ in range(tokens)]
                for k in range(per):
                    j = builder.add(builder.mul(g, ir.Constant(i64, per)), ir.Constant(i64, k))
                    wv = weights(j)
                    for i in range(tokens):
                        xv = builder.load(builder.gep(xs[i], [j]), align=4)
                        p = sums[i][k % parts]
                        sums[i][k % parts] = _fast(builder.fadd(p, _fast(builder.fmul(wv, xv))))
                scale = builder.load(builder.gep(s_ptr, [g]))
                scale = _splat(
                    builder, _fast(builder.fmul(scale, ir.Constant(ir.FloatType(), 256.0))), 16
                )
                for i in range(tokens):
                    total = sums[i][0] if parts == 1 else _fast(builder.fadd(*sums[i]))
                    _add_scaled(builder, accs[i][c], total, scale)

            if scaled:
                groups = builder.udiv(steps, ir.Constant(i64, FP8_BLOCK // F32_STEP))
                _chained_blocks(builder, groups, chains, add_group)
            else:
                _chained_blocks(builder, steps, chains, add_step)
            _store_dots(builder, dots_ptr, o, accs)

        _by_token_count(builder, n, dot_rows)
        return context.get_dummy_value()

    return codegen


@intrinsic
def bf16_f32_dot_rows(typingctx, w, x, sel, t0, n, steps, s, dots, o):
    """dots[o + i] = the dot of the bf16 row w (bits, [16 steps]) and the float32 row
    x[sel[t0 + i]], float32, for i < n (1 to DOT_TOKENS): each weight widened in registers (a
    shift), no decoded copy written; every token in one pass. s is not read."""
    v16i16, v16i32 = (
        ir.VectorType(ir.IntType(16), F32_STEP),
        ir.VectorType(ir.IntType(32), F32_STEP),
    )

    def weights_of(builder, bits):
        wide = builder.shl(builder.zext(bits, v16i32), _const(v16i32, 16))
        return builder.bitcast(wide, ir.VectorType(ir.FloatType(), F32_STEP))

    return types.void(w, x, sel, t0, n, steps, s, dots, o), _f32_dot_rows(v16i16, weights_of)


@intrinsic
def e4m3_f32_dot_rows(typingctx, codes, x, sel, t0, n, steps, s, dots, o):
    """dots[o + i] = the dot of fp8_block's row (e4m3 codes [16 steps], whole 128-blocks, a
    scale s[j // 128] per 128 columns) and the float32 row x[sel[t0 + i]], for i < n (1 to
    DOT_TOKENS): codes decoded in registers (_e4m3_f32_scaled), once for every token, each
    block's scale applied to its sum."""
    v16i8 = ir.VectorType(ir.IntType(8), F32_STEP)
    return (types.void(codes, x, sel, t0, n, steps, s, dots, o),
            _f32_dot_rows(v16i8, _e4m3_f32_scaled, True))  # fmt: skip
