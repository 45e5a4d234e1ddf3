"""Step geometry and input ids: the token-level bookkeeping at the start of a step.

Step geometry (int32, drawn in helios_backend/kernel_abi/state.py):
    geometry = [ n | token_row[0 .. tokens) | row_start[0 .. rows] ]
Every kernel here handles BLOCK_T packed tokens per program on grid x = cdiv(tokens, BLOCK_T)
(the embedding also splits dim over grid y); row-level quantities (rows <= MAX_ROWS) are
recomputed per program from query_length, which is cheaper than another node.
"""
import triton
import triton.language as tl

from ignition.gpu_kernels.triton_lang.common import wait_for_predecessors


@triton.jit
def step_geometry(geometry, query_length, rows, tokens,
                  BLOCK_T: tl.constexpr, MAX_ROWS: tl.constexpr, PDL: tl.constexpr):
    """n, token -> row map and row starts from query_length i32 [rows] (negative = 0)."""
    wait_for_predecessors(PDL)
    r = tl.arange(0, MAX_ROWS)
    r_mask = r < rows
    lengths = tl.maximum(tl.load(query_length + r, mask=r_mask, other=0), 0)
    ends = tl.cumsum(lengths, axis=0)               # row_start[r + 1]
    n = tl.sum(lengths, axis=0)
    if tl.program_id(0) == 0:
        tl.store(geometry, n)
        tl.store(geometry + 1 + tokens, 0)
        tl.store(geometry + 2 + tokens + r, ends, mask=r_mask)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    # the row of token t is the number of rows that end at or before t
    ends_live = tl.where(r_mask, ends, 0x7FFFFFFF)
    row = tl.sum((ends_live[None, :] <= t[:, None]).to(tl.int32), axis=1)
    tl.store(geometry + 1 + t, tl.where(t < n, row, -1), mask=t < tokens)


@triton.jit
def select_input_ids(ids, prompt_tokens, pending, row_slot, prefill_row, geometry, rows, tokens,
                     BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """ids[t] = prompt_tokens[t] for the prefill row's tokens, else pending[row_slot[row]].
    Three dependent loads: (n, token rows, prefill row, prompt tokens), slots, pending tokens."""
    wait_for_predecessors(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_capacity = t < tokens
    n = tl.load(geometry)
    row = tl.load(geometry + 1 + t, mask=in_capacity, other=-1)     # -1 past n
    prefill = tl.load(prefill_row)
    prompt = tl.load(prompt_tokens + t, mask=in_capacity, other=0)
    live = (t < n) & (row >= 0)
    from_host = row == prefill
    slot = tl.load(row_slot + row, mask=live & ~from_host, other=0)
    device = tl.load(pending + slot, mask=live & ~from_host, other=0)
    tl.store(ids + t, tl.where(from_host, prompt, device), mask=live)


@triton.jit
def select_input_ids_by_token(ids, prompt_tokens, pending, row_slot, geometry, rows, tokens,
                              BLOCK_T: tl.constexpr, PDL: tl.constexpr):
    """ids[t] = prompt_tokens[t] where the host fed one (>= 0), else pending[row_slot[row]]:
    any number of host-fed rows (the prompt tokens' padding, -1, marks a pending-token lane)."""
    wait_for_predecessors(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_capacity = t < tokens
    n = tl.load(geometry)
    row = tl.load(geometry + 1 + t, mask=in_capacity, other=-1)     # -1 past n
    prompt = tl.load(prompt_tokens + t, mask=in_capacity, other=-1)
    live = (t < n) & (row >= 0)
    from_host = prompt >= 0
    slot = tl.load(row_slot + row, mask=live & ~from_host, other=0)
    device = tl.load(pending + slot, mask=live & ~from_host, other=0)
    tl.store(ids + t, tl.where(from_host, prompt, device), mask=live)


@triton.jit
def embed_tokens(hidden, table, ids, geometry, tokens, dim,
                 BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """hidden f32 [tokens, dim] = table f16 [vocab, dim] rows ids[t], for live tokens.
    Grid (cdiv(tokens, BLOCK_T), cdiv(dim, BLOCK_D)): one [BLOCK_T, BLOCK_D] tile per program,
    two dependent loads (n and the ids together, then the table rows)."""
    wait_for_predecessors(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.load(geometry)
    token = tl.load(ids + t, mask=t < tokens, other=0)
    live = t < n
    token = tl.where(live & (token >= 0), token, 0).to(tl.int64)
    mask = live[:, None] & (d[None, :] < dim)
    row = tl.load(table + token[:, None] * dim + d[None, :], mask=mask, other=0.0)
    tl.store(hidden + t[:, None] * dim + d[None, :], row.to(tl.float32), mask=mask)
