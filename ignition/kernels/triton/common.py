"""Device helpers shared by the kernel sources."""
import triton
import triton.language as tl

L2_LINE_BYTES = tl.constexpr(128)
# Tensor-core precision of every dot: "tf32x3" splits f32 operands into tf32 hi + lo parts
# (3 MMAs), giving ~f32 products, so logits track the f32 numpy executor closely enough for
# identical greedy tokens; f16 weights/cache widen to f32 exactly. Decode is memory-bound,
# so the extra MMAs are free there.
DOT_PRECISION = tl.constexpr("tf32x3")


@triton.jit
def prefetch_l2(base, nbytes, LINES: tl.constexpr):
    """Prefetch the byte range [base, base + nbytes) into L2, one 128-byte line per lane.

    Issued before griddepcontrol.wait for data no earlier node writes (weights), so under
    programmatic dependent launch the weight stream of node N+1 overlaps node N and the
    main loop then reads L2 instead of DRAM. Compiled path only (no interpreter form).
    """
    for first in range(0, nbytes, LINES * L2_LINE_BYTES):
        offsets = tl.minimum(first + tl.arange(0, LINES) * L2_LINE_BYTES, nbytes - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [base.to(tl.pointer_type(tl.int8)) + offsets],
                                  dtype=tl.int32, is_pure=False, pack=1)
