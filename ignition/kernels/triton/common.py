"""Device helpers shared by the kernel sources."""
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

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


@triton.jit
def wait_for_predecessors(PDL: tl.constexpr):
    """Programmatic dependent launch: wait until the previous node's writes are visible, then
    let the next node launch (it only runs its own pre-wait prologue until we finish)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@triton.jit
def live_lane(row_slot, live_rows, rows, r):
    """(live rows, slot of row r or -1 past them) for per-row kernels."""
    live = tl.minimum(tl.load(live_rows), rows)
    return live, tl.load(row_slot + r, mask=r < live, other=-1)
