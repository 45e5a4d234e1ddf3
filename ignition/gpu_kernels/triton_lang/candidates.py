"""Order keys and per-chunk candidate records, shared by sampling.draw.v2 (sampling.py) and
sampling.logprobs.v2 (logprobs.py): both spread a row's vocabulary over programs, each program
leaving its chunk's best tokens as order keys in `partials`, and the last program of the row
merges them.

An order key is an int64 whose signed order is (value descending, token ascending): the value's
order-preserving int32 image in the high word, 0x7FFFFFFF - token below, so one integer sort or
maximum orders candidates exactly as helios_backend/kernel_abi/sampling.py's reference does.
"""
import triton
import triton.language as tl

STAT_WORDS = tl.constexpr(8)
KEY_NONE = tl.constexpr(-(2 ** 63))          # an empty candidate slot: below every order key


@triton.jit
def partial_words(vocab):
    """Row stride of `partials` in words: helios_backend.kernel_abi.sampling.partial_words."""
    return tl.cdiv(tl.maximum(vocab // 8, 1024), 16) * 16


@triton.jit
def order_key(value, token):
    """int64 whose signed order is (value descending, token ascending) in a descending sort:
    the float's order-preserving int32 image in the high word, 0x7FFFFFFF - token below.
    (+ 0.0 turns -0.0 into +0.0, which the reference treats as equal.)"""
    bits = (value + 0.0).to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - token).to(tl.int64)


@triton.jit
def key_value(key):
    ordered = (key >> 32).to(tl.int32)
    return tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def key_token(key):
    return 0x7FFFFFFF - key.to(tl.int32)


@triton.jit
def select_top(value, token, valid, keys, K: tl.constexpr):
    """Store the order keys of the K best valid entries (value descending, token ascending; all
    of them when fewer are valid) at keys[0 .. K) in token order, KEY_NONE in the slots left;
    return the largest valid key left out (KEY_NONE when none): every entry above it is stored.
    value, token, valid: 1-D, in token order.

    Exact radix selection instead of a bitonic top-k (about a third of the instructions):
    four passes over 8 bits of the values' order-preserving image, each a 256-bin shared-memory
    histogram of the entries still tied with the K-th best, find the K-th best value; entries
    above it are taken, entries equal to it lowest token first."""
    bits = (value + 0.0).to(tl.int32, bitcast=True)
    image = tl.where(bits >= 0, bits ^ -2147483648, ~bits).to(tl.uint32, bitcast=True)
    need = tl.minimum(tl.sum(valid.to(tl.int32), axis=0), K)
    digits = tl.arange(0, 256)
    live = valid
    taken = valid & (bits != bits)
    for shift in tl.static_range(24, -8, -8):
        digit = ((image >> shift) & 255).to(tl.int32)
        counts = tl.histogram(digit, 256, mask=live)
        above = tl.sum(counts, axis=0) - tl.cumsum(counts, axis=0)     # entries in higher digits
        pick = tl.max(tl.where((above < need) & (above + counts >= need), digits, -1), axis=0)
        need -= tl.sum(tl.where(digits == pick, above, 0), axis=0)
        taken = taken | (live & (digit > pick))
        live = live & (digit == pick)
    chosen = taken | (live & (tl.cumsum(live.to(tl.int32), axis=0) <= need))
    key = order_key(value, token)
    tl.store(keys + tl.cumsum(chosen.to(tl.int32), axis=0) - 1, key, mask=chosen)
    slots = tl.arange(0, K)
    tl.store(keys + slots, tl.full((K,), KEY_NONE, tl.int64),
             mask=slots >= tl.sum(chosen.to(tl.int32), axis=0))
    return tl.max(tl.where(valid & ~chosen, key, KEY_NONE), axis=0)


@triton.jit
def merge_top(kept, block, bound):
    """(the len(kept) best of kept and block, sorted descending; bound raised to the best key
    left out). kept: sorted descending; block: any order, the same length. The elementwise
    maximum of a descending and an ascending list holds exactly the best half of both."""
    rising = tl.sort(block, descending=False)
    left_out = tl.max(tl.minimum(kept, rising), axis=0)
    return tl.sort(tl.maximum(kept, rising), descending=True), tl.maximum(bound, left_out)
