"""LLVM vector code for block weights (kernel_abi/blocks.py): one block of 32 weights as one vector.

Layout codes (BlockLayout.code): 0 Q8_0 (34-byte blocks: f16 d, 32 int8), 1 Q4_1 (20-byte blocks:
f16 d, f16 m, 16 bytes of nibbles: low nibble weight j, high nibble weight j + 16).
Written as LLVM vector code because numba's loops over a 32-weight block do not vectorize: the
constant 32-trip loop is unrolled into scalar conversions, and numba promotes the 8-bit integer
arithmetic to int64 (measured 15-25x slower than the f16 loop per weight). The intrinsics here
take raw positions and check no bounds: block_products.py checks its arrays and drives them.

Activations arrive as f32 (each block widened to <32 x float> and multiplied with FMAs) or as q8
blocks (kernel_abi/activations.py: an int8 array, 40 bytes per 32 activations): then each block
product is an integer dot product of the weights' quants with the activations' (`_integer_dot`:
vpmaddubsw + vpmaddwd on x86, vpdpbusd where the AVX-512 path has VNNI, generic IR on the host
path); a token group's products sum in integers, converted once and scaled by the blocks' scales
in one FMA a row (`_emit_q8_dots`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, cast

from llvmlite import ir  # type: ignore[import-untyped]
from numba.core import types
from numba.extending import intrinsic

from helios_backend.executors.cpu import isa
from helios_backend.executors.cpu.codegen import element_pointer, fma, horizontal_sum, splat
from helios_backend.kernel_abi.activations import Q8_BLOCK_BYTES

BLOCK_Q8_0 = 0
BLOCK_Q4_1 = 1
# Block products of Q8_0, or of 4 and more tokens, prefetch each row's bytes this far ahead: out of
# cache (a decode step streams every weight from memory) the LM head of one token (Q8_0, 30 MB) took
# 5.0 ms on one thread without, 2.1 ms with; [3072, 576] Q4_1 x 8 tokens 325 -> 219 us. A Q4_1 product
# of one token is bound by its arithmetic: prefetching there cost 82 -> 163 us (measured 512 / 1024 /
# 2048 bytes ahead: 1024 the best but for the head of 8 tokens).
PREFETCH_BYTES = 1024
ROWS_AHEAD = 16          # q8 products of one token: each row's block prefetched this many rows ahead (_emit_q8_dots)
_LANES = 32
_F32X32 = ir.VectorType(ir.FloatType(), _LANES)


def _block_weights(builder: Any, code: int, block: Any) -> Any:
    """<32 x float> weights of the block at i8* `block` (kernel_abi/blocks.expand's values)."""
    def half(offset: int) -> Any:
        pointer = builder.bitcast(builder.gep(block, [ir.Constant(ir.IntType(64), offset)]), ir.IntType(16).as_pointer())
        return builder.fpext(builder.bitcast(builder.load(pointer, align=1), ir.HalfType()), ir.FloatType())

    def load(offset: int, lanes: int) -> Any:
        vector = ir.VectorType(ir.IntType(8), lanes)
        pointer = builder.gep(block, [ir.Constant(ir.IntType(64), offset)])
        return builder.load(builder.bitcast(pointer, vector.as_pointer()), align=1)

    if code == BLOCK_Q8_0:
        return builder.fmul(builder.sitofp(load(2, _LANES), _F32X32), splat(builder, half(0), _LANES))
    packed = load(4, _LANES // 2)
    low = builder.and_(packed, ir.Constant(packed.type, [15] * (_LANES // 2)))
    high = builder.lshr(packed, ir.Constant(packed.type, [4] * (_LANES // 2)))
    quants = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(ir.IntType(32), _LANES), list(range(_LANES))))
    scale, minimum = splat(builder, half(0), _LANES), splat(builder, half(2), _LANES)
    return fma(builder, builder.uitofp(quants, _F32X32), scale, minimum)


class _BlockLoop:
    """The loop over the blocks of rows `starts` (i8* each, blocks of `size` bytes) that both
    emitters open at the builder's position: `index` (the block) and `block_at` (its byte offset)
    inside, one phi per type of `kinds` (vectors) starting at zero, each row's bytes PREFETCH_BYTES
    (or the i64 value `ahead`) ahead prefetched where `prefetch`. `close` with the phis' next values
    leaves the builder at the loop's exit."""

    def __init__(self, builder: Any, name: str, starts: list, size: int, kinds: list, prefetch: bool,
                 ahead: Any = None) -> None:
        i64, i32 = ir.IntType(64), ir.IntType(32)
        self.builder = builder
        entry = builder.block
        self.loop = builder.append_basic_block(f"{name}_loop")
        self.done = builder.append_basic_block(f"{name}_done")
        builder.branch(self.loop)
        builder.position_at_end(self.loop)
        self.index = builder.phi(i64)
        self.index.add_incoming(ir.Constant(i64, 0), entry)
        self.phis = []
        for kind in kinds:
            phi = builder.phi(kind)
            phi.add_incoming(ir.Constant(kind, [0.0] * kind.count), entry)
            self.phis.append(phi)
        self.block_at = builder.mul(self.index, ir.Constant(i64, size))
        declared = builder.module.globals.get("llvm.prefetch.p0i8") or ir.Function(
            builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]),
            "llvm.prefetch.p0i8")
        ahead = ir.Constant(i64, PREFETCH_BYTES) if ahead is None else ahead
        for start in (starts if prefetch else ()):
            builder.call(declared, [builder.gep(start, [builder.add(self.block_at, ahead)]),
                                    ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])

    def close(self, values: list, blocks: Any) -> None:
        builder = self.builder
        following = builder.add(self.index, ir.Constant(ir.IntType(64), 1))
        self.index.add_incoming(following, builder.block)
        for phi, value in zip(self.phis, values):
            phi.add_incoming(value, builder.block)
        builder.cbranch(builder.icmp_signed("<", following, blocks), self.loop, self.done)
        builder.position_at_end(self.done)


def _emit_block_dots(builder: Any, code: int, starts: list, inputs: list, blocks: Any, tokens: int, lanes: int,
                     target: Any) -> None:
    """The loop of _block_row_dots_intrinsic for one layout code, from the builder's position; the
    sums stored to `target` (float*), the builder left at the loop's exit."""
    i64 = ir.IntType(64)
    size = 34 if code == BLOCK_Q8_0 else 20
    accumulator_type = ir.VectorType(ir.FloatType(), lanes)
    slices = [ir.Constant(ir.VectorType(ir.IntType(32), lanes), list(range(h * lanes, (h + 1) * lanes)))
              for h in range(_LANES // lanes)]      # a block's lanes in accumulator-wide slices
    blocks_loop = _BlockLoop(builder, f"block_{code}", starts, size, [accumulator_type] * (len(starts) * tokens),
                             prefetch=code == BLOCK_Q8_0 or tokens >= 4)       # (PREFETCH_BYTES: why)
    index, block_at, accumulators = blocks_loop.index, blocks_loop.block_at, blocks_loop.phis
    weights = []
    for start in starts:
        widened = _block_weights(builder, code, builder.gep(start, [block_at]))
        weights.append([widened] if lanes == _LANES else
                       [builder.shuffle_vector(widened, widened, part) for part in slices])
    offset = builder.mul(index, ir.Constant(i64, _LANES))
    summed = list(accumulators)
    for t, token_inputs in enumerate(inputs):
        values = builder.load(builder.bitcast(builder.gep(token_inputs, [offset]), _F32X32.as_pointer()), align=4)
        parts = [values] if lanes == _LANES else [builder.shuffle_vector(values, values, h) for h in slices]
        for r in range(len(starts)):
            for w, part in zip(weights[r], parts):
                summed[r * tokens + t] = fma(builder, w, part, summed[r * tokens + t])
    blocks_loop.close(summed, blocks)
    for j, value in enumerate(summed):
        builder.store(horizontal_sum(builder, value), builder.gep(target, [ir.Constant(i64, j)]))


def integer_dots(path: isa.IsaPath) -> str:
    """How a path multiplies 32 unsigned by 32 signed bytes into <8 x i32>: `vnni` (vpdpbusd: the
    AVX-512 path where the host has AVX512-VNNI), `avx2` (vpmaddubsw into i16 pairs, vpmaddwd by
    ones into i32: the x86 paths otherwise) or `generic` (widening IR, the host path)."""
    if path.name == "avx512" and path.has("avx512vnni"):
        return "vnni"
    return "avx2" if path.name in ("avx512", "avx2") else "generic"


def _declared(builder: Any, name: str, result: Any, arguments: list) -> Any:
    module = builder.module
    return module.globals.get(name) or ir.Function(module, ir.FunctionType(result, arguments), name)


def _integer_dot(builder: Any, unsigned: Any, signed: Any, flavour: str, signed_first: bool = False) -> Any:
    """<8 x i32>: lane l the sum of unsigned[j] * signed[j] over bytes j = 4l .. 4l + 3 (<32 x i8>
    each: the first read as 0..255, the second as -128..127; no pair of products may exceed the
    i16 range, which weights' quants of at most 128 in magnitude times activations' of at most
    127 never do). `signed_first` (generic only): the first read as -128..127 too, so Q8_0
    weights need no sign moved."""
    bytes32 = ir.VectorType(ir.IntType(8), _LANES)
    words16 = ir.VectorType(ir.IntType(16), 16)
    ints8 = ir.VectorType(ir.IntType(32), 8)
    if flavour == "vnni":
        dot = _declared(builder, "llvm.x86.avx512.vpdpbusd.256", ints8, [ints8] * 3)
        return builder.call(dot, [ir.Constant(ints8, [0] * 8), builder.bitcast(unsigned, ints8),
                                  builder.bitcast(signed, ints8)])
    if flavour == "avx2":
        pairs = builder.call(_declared(builder, "llvm.x86.avx2.pmadd.ub.sw", words16, [bytes32] * 2),
                             [unsigned, signed])
        return builder.call(_declared(builder, "llvm.x86.avx2.pmadd.wd", ints8, [words16] * 2),
                            [pairs, ir.Constant(words16, [1] * 16)])
    wide = ir.VectorType(ir.IntType(32), _LANES)
    first = builder.sext(unsigned, wide) if signed_first else builder.zext(unsigned, wide)
    products = builder.mul(first, builder.sext(signed, wide))
    parts = [builder.shuffle_vector(products, products, ir.Constant(ints8, list(range(h, _LANES, 4))))
             for h in range(4)]          # lane l: bytes 4l .. 4l + 3, as the x86 forms sum them
    return builder.add(builder.add(parts[0], parts[1]), builder.add(parts[2], parts[3]))


def _emit_q8_dots(builder: Any, code: int, starts: list, group: Any, blocks: Any, tokens: int, flavour: str,
                  target: Any, row_bytes: Any) -> None:
    """_emit_block_dots for q8 activations (`group`: i8* to a group of T = `tokens` tokens' q8
    blocks, kernel_abi/activations.py: a block's quants are 4-byte (chunk, token) lanes, 8 / T
    chunks of every token per 32 bytes). Per block and row, each 32 bytes of activations meet the
    weight chunks they hold, each repeated T times (a lane permutation of the block's quants, none
    for T = 1), in one integer dot product of 4 bytes a lane (`_integer_dot`); the T products sum
    in integers into one <8 x i32> (lane l token l % T), whose lanes of a token are added (T < 8:
    exact integers) into one i32 per token. Then every (row, token) takes the block's term in one
    fixed order of f32 steps, whatever T and the path (activations.block_product, the reference):

        term = f32(dot) * (dw * d)   (+ mw * s for Q4_1)      sum = sum + term   (block by block)

    as T-lane vectors (the tokens' d and s one vector load each), no fused multiply-add and no
    reassociation (`multiply`, `add`), so a
    token's product is bit for bit the same alone, in a group of 4 or of 8. The sums stored to
    `target` (row by row), the builder left at the loop's exit."""
    i64, i32, f32 = ir.IntType(64), ir.IntType(32), ir.FloatType()
    size = 34 if code == BLOCK_Q8_0 else 20
    bytes32 = ir.VectorType(ir.IntType(8), _LANES)
    ints8 = ir.VectorType(i32, 8)
    words16 = ir.VectorType(ir.IntType(16), 16)
    scales_type = ir.VectorType(f32, tokens)
    per_vector = 8 // tokens             # chunks of each token in 32 bytes of activations
    # i16 pair sums of Q4_1 (<= 2 * 15 * 127 each) stay within i16 over the 8 chunks of a block, so the
    # vpmaddubsw form adds them before one vpmaddwd; Q8_0's (<= 2 * 128 * 127) do not
    add_words = flavour == "avx2" and code != BLOCK_Q8_0
    # one token and 2 or 4 rows: the rows' block sums reduce together and the f32 steps run on one
    # <R x float> (lane r: row r), one reduction tree and one vector of f32 steps for all the rows
    # of a pass (a row at a time took the AVX2 path's b=1 products of a decode step from 4.6 to
    # 6.1 ms, one thread; docs/cpu-executor.md has the figures of 2 and 4 rows)
    across = tokens == 1 and len(starts) in (2, 4)
    lanes_type = ir.VectorType(f32, len(starts)) if across else scales_type
    # one token's passes of 2 and 4 rows prefetch each row's block ROWS_AHEAD rows on: PREFETCH_BYTES
    # (1.6 to 2.8 rows of 576 weights ahead) missed part of a 4-row pass's next rows, which out of cache
    # took [3072, 576] Q4_1 from 76-85 us (pairs) to 104-110; 16 rows ahead 68-72 (8: 78-83, 32: 72-74),
    # and the LM head [49152, 576] Q8_0 1.47-1.53 ms (pairs, 1024 bytes) -> 0.86-0.89 (pairs 16 rows
    # ahead: 0.91)
    ahead = builder.mul(row_bytes, ir.Constant(i64, ROWS_AHEAD)) if across else None
    blocks_loop = _BlockLoop(builder, f"q8_{code}", starts, size, [lanes_type] * (1 if across else len(starts)),
                             prefetch=True, ahead=ahead)
    index, block_at = blocks_loop.index, blocks_loop.block_at

    def at(pointer: Any, offset: Any, kind: Any) -> Any:
        return builder.bitcast(builder.gep(pointer, [offset]), kind.as_pointer())

    def half(block: Any, offset: int) -> Any:
        bits = builder.load(at(block, ir.Constant(i64, offset), ir.IntType(16)), align=1)
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), f32)

    def per_token(total: Any) -> Any:
        """<T x i32>: the sum of each token's lanes of <8 x i32> `total` (lane l token l % T)."""
        if tokens == 1:
            one = builder.call(_declared(builder, "llvm.vector.reduce.add.v8i32", i32, [ints8]), [total])
            return builder.insert_element(ir.Constant(ir.VectorType(i32, 1), ir.Undefined), one, ir.Constant(i32, 0))
        while total.type.count > tokens:
            lanes = total.type.count // 2
            halves = [builder.shuffle_vector(total, total, ir.Constant(ir.VectorType(i32, lanes),
                                                                      list(range(h * lanes, (h + 1) * lanes))))
                      for h in range(2)]
            total = builder.add(halves[0], halves[1])
        return total

    # The f32 steps carry a flag of their own (arcp: it only concerns divisions) because numba gives
    # every unflagged float operation of a fastmath function its fast-math flags, which let LLVM
    # fuse a product into the sum it feeds and split the loop's sum into interleaved partial sums
    # (measured: 1-ulp differences from the reference on the odd last row of the AVX2 path)
    def multiply(a: Any, b: Any) -> Any:
        return builder.fmul(a, b, flags=("arcp",))

    def add(a: Any, b: Any) -> Any:
        return builder.fadd(a, b, flags=("arcp",))

    x_block = builder.gep(group, [builder.mul(index, ir.Constant(i64, tokens * Q8_BLOCK_BYTES))])
    d = builder.load(at(x_block, ir.Constant(i64, 0), scales_type), align=4)
    s = builder.load(at(x_block, ir.Constant(i64, 4 * tokens), scales_type), align=4)
    activations = [builder.load(at(x_block, ir.Constant(i64, 8 * tokens + 32 * v), bytes32), align=1)
                   for v in range(tokens)]
    summed = list(blocks_loop.phis)
    totals, scales, minimums = [], [], []
    for r, start in enumerate(starts):
        block = builder.gep(start, [block_at])
        if code == BLOCK_Q8_0:
            quants = builder.load(at(block, ir.Constant(i64, 2), bytes32), align=1)
        else:
            packed = builder.load(at(block, ir.Constant(i64, 4), ir.VectorType(ir.IntType(8), _LANES // 2)), align=1)
            low = builder.and_(packed, ir.Constant(packed.type, [15] * (_LANES // 2)))
            high = builder.lshr(packed, ir.Constant(packed.type, [4] * (_LANES // 2)))
            quants = builder.shuffle_vector(low, high, ir.Constant(ir.VectorType(i32, _LANES), list(range(_LANES))))
        chunks = builder.bitcast(quants, ints8)
        total = None
        for v, x in enumerate(activations):
            weights = quants if tokens == 1 else builder.bitcast(builder.shuffle_vector(
                chunks, chunks, ir.Constant(ints8, [v * per_vector + j // tokens for j in range(8)])), bytes32)
            if code == BLOCK_Q8_0 and flavour != "generic":     # |w| unsigned, its sign moved onto x (vpsignb)
                x = builder.call(_declared(builder, "llvm.x86.avx2.psign.b", bytes32, [bytes32] * 2), [x, weights])
                weights = builder.call(_declared(builder, "llvm.abs.v32i8", bytes32, [bytes32, ir.IntType(1)]),
                                       [weights, ir.Constant(ir.IntType(1), 0)])
            if add_words:
                part = builder.call(_declared(builder, "llvm.x86.avx2.pmadd.ub.sw", words16, [bytes32] * 2),
                                    [weights, x])
            else:
                part = _integer_dot(builder, weights, x, flavour,
                                    signed_first=code == BLOCK_Q8_0 and flavour == "generic")
            total = part if total is None else builder.add(total, part)
        if add_words:
            total = builder.call(_declared(builder, "llvm.x86.avx2.pmadd.wd", ints8, [words16] * 2),
                                 [total, ir.Constant(words16, [1] * 16)])
        totals.append(total)
        if code == BLOCK_Q8_0:
            scales.append(half(block, 0))
        else:                            # d and m as one load and one conversion: <2 x float>
            scales.append(builder.fpext(builder.bitcast(builder.load(at(block, ir.Constant(i64, 0), i32), align=1),
                                                        ir.VectorType(ir.HalfType(), 2)), ir.VectorType(f32, 2)))

    def lanes(vector: Any, picks: list) -> Any:
        return builder.shuffle_vector(vector, vector, ir.Constant(ir.VectorType(i32, len(picks)), picks))

    if across:                           # lane r: row r's block sum, a tree of exact integer adds
        dots = [_row_sums(builder, totals)]
        if code == BLOCK_Q8_0:
            gathered = ir.Constant(lanes_type, ir.Undefined)
            for r, scale in enumerate(scales):
                gathered = builder.insert_element(gathered, scale, ir.Constant(i32, r))
            dw = [gathered]
        else:                            # the rows' (d, m) pairs side by side, then every d and every m
            pairs = scales
            while len(pairs) > 1:
                count = 2 * pairs[0].type.count
                pairs = [builder.shuffle_vector(pairs[h], pairs[h + 1], ir.Constant(ir.VectorType(i32, count),
                                                                                    list(range(count))))
                         for h in range(0, len(pairs), 2)]
            dw = [lanes(pairs[0], list(range(0, 2 * len(starts), 2)))]
            minimums = [lanes(pairs[0], list(range(1, 2 * len(starts), 2)))]
        d, s = lanes(d, [0] * len(starts)), lanes(s, [0] * len(starts))
    else:
        dots = [per_token(total) for total in totals]
        if code == BLOCK_Q8_0:
            dw = [splat(builder, scale, tokens) for scale in scales]
        else:
            dw = [lanes(pair, [0] * tokens) for pair in scales]
            minimums = [lanes(pair, [1] * tokens) for pair in scales]
    for j, dot in enumerate(dots):
        term = multiply(builder.sitofp(dot, lanes_type), multiply(dw[j], d))
        if code != BLOCK_Q8_0:
            term = add(term, multiply(minimums[j], s))
        summed[j] = add(summed[j], term)
    blocks_loop.close(summed, blocks)
    for j, value in enumerate(summed):
        for lane in range(lanes_type.count):     # (row, token) r * tokens + t: row j, or row lane across rows
            builder.store(builder.extract_element(value, ir.Constant(i32, lane)),
                          builder.gep(target, [ir.Constant(i64, j * tokens + lane)]))


def _row_sums(builder: Any, totals: list) -> Any:
    """<R x i32>: lane r the sum of the 8 lanes of <8 x i32> totals[r] (R a power of 2), in exact
    integer adds: the rows' vectors folded pairwise (each add halves every row's lanes) until one
    vector holds them all, then folded within it."""
    i32 = ir.IntType(32)
    width, vectors = 8, list(totals)

    def fold(first: Any, second: Any, width: int) -> Any:
        count = first.type.count if second is first else 2 * first.type.count
        rows = count // width
        picks = [[row * width + half * width // 2 + j for row in range(rows) for j in range(width // 2)]
                 for half in (0, 1)]
        low, high = (builder.shuffle_vector(first, second, ir.Constant(ir.VectorType(i32, len(p)), p)) for p in picks)
        return builder.add(low, high)

    while len(vectors) > 1:
        vectors = [fold(vectors[h], vectors[h + 1], width) for h in range(0, len(vectors), 2)]
        width //= 2
    total = vectors[0]
    while width > 1:
        total = fold(total, total, width)
        width //= 2
    return total


def passes(rows: int, tokens: int, vector_bits: int) -> tuple[int, int]:
    """How a (rows, tokens) block product is shaped for vectors of `vector_bits`: (row groups, the
    lanes of each accumulator); every group is one loop over the blocks with rows / groups rows.

    512 bits (32 registers): one loop; up to 8 (row, token) pairs keep <32 x float> accumulators
    (one FMA chain of 4 cycles per block), more fold each block's two halves into one <16 x float>
    accumulator, so 2 rows x 8 tokens (16 accumulators) stay in the registers with the widened
    blocks. 256 bits (16 registers, and 128-bit targets): a <16 x float> accumulator is 2 of them,
    so 2 x 8 pairs held 32 registers' worth and spilled (the loop's body: 272 instructions, 145
    of them vector moves, for 72 FMAs). There 4 and 8 tokens keep <8 x float> accumulators (one register each)
    and 8 tokens take one row a loop (8 accumulators, the widened slice and an input). The AVX2
    path on a Zen 5 core, one thread, CPU time, [3072, 576] Q4_1 x 8 tokens: 370 us as 2 x 8 at 16
    lanes, 265-270 one row a loop at 8 lanes, 325 as 2 rows x 4 tokens twice (AVX-512: 185). One
    token keeps <32 x float> (4 registers a row, chains long enough for the FMA latency)."""
    if vector_bits >= 512:
        return 1, _LANES if rows * tokens <= 8 else _LANES // 2
    return (rows if tokens >= 8 else 1), (8 if tokens >= 4 else _LANES)


def _block_row_dots_intrinsic(rows: int, tokens: int, flavour: Optional[str] = None) -> Callable[..., Any]:
    """sums[r * tokens + t] = sum over `blocks` consecutive blocks from byte at + r * row_bytes of
    w . x[x_at + t * x_stride:] for r < rows, t < tokens, blocks of layout `code` (BLOCK_*): each
    block widened once into registers and multiplied into one vector accumulator per (row,
    token), so every loaded input feeds the rows of a loop and every widened block `tokens`
    products; one horizontal sum each at the end. One loop per layout code (and row group,
    `passes`: shaped by the vector width of the process's ISA path, isa.py), chosen once per call.
    x of int8: q8 activation blocks (kernel_abi/activations.py), x_at the byte of the token group's
    first block (x_stride unused), multiplied as integers (`_emit_q8_dots`, the integer dot
    product `flavour`: by default the path's, `integer_dots`)."""
    def typer(typingctx: Any, data: Any, code: Any, at: Any, row_bytes: Any, x: Any, x_at: Any, x_stride: Any,
              blocks: Any, sums: Any) -> Any:
        quantized = x.dtype == types.int8
        groups, lanes = (1, 8) if quantized else passes(rows, tokens, isa.active().vector_bits)   # q8: one accumulator a row
        dots = flavour or integer_dots(isa.active())

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            i64 = ir.IntType(64)
            starts = [element_pointer(context, builder, signature.args[0], args[0],
                                       builder.add(args[2], builder.mul(args[3], ir.Constant(i64, r))))
                      for r in range(rows)]
            inputs = [element_pointer(context, builder, signature.args[4], args[4],
                                       builder.add(args[5], builder.mul(args[6], ir.Constant(i64, t))))
                      for t in range(tokens)]
            target = context.make_array(signature.args[8])(context, builder, value=args[8]).data
            per_group = rows // groups
            for group in range(groups):
                group_starts = starts[group * per_group:(group + 1) * per_group]
                group_target = builder.gep(target, [ir.Constant(i64, group * per_group * tokens)])
                with builder.if_else(builder.icmp_signed("==", args[1], ir.Constant(args[1].type, BLOCK_Q8_0))) as (
                        q8_0, q4_1):
                    for layout, branch in ((BLOCK_Q8_0, q8_0), (BLOCK_Q4_1, q4_1)):
                        with branch:
                            if quantized:
                                _emit_q8_dots(builder, layout, group_starts, inputs[0], args[7], tokens, dots,
                                              group_target, args[3])
                            else:
                                _emit_block_dots(builder, layout, group_starts, inputs, args[7], tokens, lanes,
                                                 group_target)
            return context.get_dummy_value()
        return types.none(data, types.intp, types.intp, types.intp, x, types.intp, types.intp, types.intp,
                          sums), codegen
    return typer


def _block_store_intrinsic(code: int) -> Callable[..., Any]:
    def typer(typingctx: Any, out: Any, out_at: Any, data: Any, at: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            weights = _block_weights(builder, code, element_pointer(context, builder, signature.args[2], args[2], args[3]))
            target = element_pointer(context, builder, signature.args[0], args[0], args[1])
            builder.store(weights, builder.bitcast(target, _F32X32.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.none(out, types.intp, data, types.intp), codegen
    return typer


def _q8_values(builder: Any, x: Any) -> tuple[Any, Any]:
    """(d, the quants as <32 x float>) of the 32 f32 activations at float* x (activations.quantize:
    d = max |x| / 127, q = round-to-nearest-even(x * (1 / d)), 0 where d is 0). Exact IEEE steps
    (a max, one division, products, a rounding), so the values are the reference's bit for bit."""
    f32 = ir.FloatType()
    values = builder.load(builder.bitcast(x, _F32X32.as_pointer()), align=4)
    magnitudes = builder.call(_declared(builder, "llvm.fabs.v32f32", _F32X32, [_F32X32]), [values])
    largest = builder.call(_declared(builder, "llvm.vector.reduce.fmax.v32f32", f32, [_F32X32]), [magnitudes])
    d = builder.fdiv(largest, ir.Constant(f32, 127.0))
    inverse = builder.select(builder.fcmp_ordered(">", d, ir.Constant(f32, 0.0)),
                             builder.fdiv(ir.Constant(f32, 1.0), d), ir.Constant(f32, 0.0))
    quants = builder.call(_declared(builder, "llvm.roundeven.v32f32", _F32X32, [_F32X32]),
                          [builder.fmul(values, splat(builder, inverse, _LANES))])
    return d, quants


def _q8_block_intrinsic(typingctx: Any, out: Any, at: Any, size: Any, j: Any, x: Any, source: Any) -> Any:
    """q8_block(out, at, size, j, x, source): token j's q8 block of x[source:source + 32] into the
    block of a group of `size` tokens at byte `at` of int8 `out` (activations.py's layout: d at
    at + 4 j, s = d * sum q at at + 4 size + 4 j, quant chunk c at at + 8 size + 4 size c + 4 j)."""
    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        i64, i32, f32 = ir.IntType(64), ir.IntType(32), ir.FloatType()
        d, quants = _q8_values(builder, element_pointer(context, builder, signature.args[4], args[4], args[5]))
        ints = builder.fptosi(quants, ir.VectorType(i32, _LANES))
        total = builder.call(_declared(builder, "llvm.vector.reduce.add.v32i32", i32, [ir.VectorType(i32, _LANES)]),
                             [ints])
        chunks = builder.bitcast(builder.trunc(ints, ir.VectorType(ir.IntType(8), _LANES)), ir.VectorType(i32, 8))
        at, size, j = args[1], args[2], args[3]

        def byte(offset: Any) -> Any:
            return element_pointer(context, builder, signature.args[0], args[0], builder.add(at, offset))

        four_j = builder.mul(j, ir.Constant(i64, 4))
        builder.store(d, builder.bitcast(byte(four_j), f32.as_pointer()), align=4)
        s = builder.fmul(d, builder.sitofp(total, f32))
        builder.store(s, builder.bitcast(byte(builder.add(builder.mul(size, ir.Constant(i64, 4)), four_j)),
                                         f32.as_pointer()), align=4)
        first = builder.add(builder.mul(size, ir.Constant(i64, 8)), four_j)
        for c in range(8):
            offset = builder.add(first, builder.mul(size, ir.Constant(i64, 4 * c)))
            builder.store(builder.extract_element(chunks, ir.Constant(i32, c)),
                          builder.bitcast(byte(offset), i32.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.none(out, types.intp, types.intp, types.intp, x, types.intp), codegen


q8_block = cast(Callable[..., Any], intrinsic(_q8_block_intrinsic))


# (rows, tokens) shapes of one pass over blocks (block_products.block_linear_rows: 2 rows x 8 / 4 / 1
# tokens, 4 rows x 1 token of q8 activations, and 1 row for an odd last row)
dots1x1, dots2x1, dots4x1, dots1x4, dots2x4, dots1x8, dots2x8 = (
    cast(Callable[..., Any], intrinsic(_block_row_dots_intrinsic(r, t)))
    for r, t in ((1, 1), (2, 1), (4, 1), (1, 4), (2, 4), (1, 8), (2, 8)))
"""dotsRxT(data, code, at, row_bytes, x, x_at, x_stride, blocks, sums): sums[r * T + t] = row r . x[x_at + t *
x_stride:] for r < R, t < T over the `blocks` (>= 1) blocks of each row (no bounds checks: the callers check)."""
q8_0_store = cast(Callable[..., Any], intrinsic(_block_store_intrinsic(BLOCK_Q8_0)))
"""out[out_at:out_at + 32] = the weights of the Q8_0 block at data[at:] (no bounds checks)."""
q4_1_store = cast(Callable[..., Any], intrinsic(_block_store_intrinsic(BLOCK_Q4_1)))
