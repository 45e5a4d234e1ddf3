"""Bytes and FLOPs of a recorded program, per node and per step, from its manifest alone.

The roofline of a step is max(bytes / copy bandwidth, FLOPs / fp16 tensor-core peak), both
measured on the device in the same run (bench/kernels.py). What a node must move is read off its
arguments through the kernel ABI (helios_backend/kernel_abi/abi.py: each pointer's name and access):

  * weights: a matrix is read whole once per launch; an embedding table (`table`) and a RoPE
    table only at the live tokens' rows;
  * the paged KV cache: a store (qkv_*_store) writes each live token's K and V; attention reads
    every position each row attends to (decode: `context` positions a row; prefill from position
    0: the chunk's own keys, once per chunk);
  * activations (scratch rows of `tokens` capacity): the live tokens' rows read and/or written;
    logits: each row's vocabulary in f32 (in a whole step: written once, whatever reads them).

FLOPs: 2 x rows x weight elements for each matrix (the LM head only at each row's last token),
4 x query-key pairs x query heads x head dim for attention. A whole step's minimal bytes count
each weight buffer once and leave out activations (a fused step need not move them); a node's
bytes include its activations (what that node itself has to move).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from helios_proto import manifest_pb2 as M

from helios_backend.kernel_abi import abi

MATRIX_PARAMS = ("qkv_weight", "gate_up", "weight", "head")    # FLOPs: 2 x rows x elements
ROW_TABLES = ("table", "rope_table")                            # read at the live tokens' rows only
ATTENTION_PREFIX = "attention.paged"
LOGITS_BUFFER = "scratch.logits"


@dataclass(frozen=True)
class Step:
    """What one launch of a program processes: live rows, live tokens, and each decode row's context."""

    rows: int
    tokens: int
    context: int      # positions a decode row attends to; prefill chunks start at position 0


@dataclass
class Cost:
    nbytes: float = 0.0          # bytes the node must move (its activations included)
    flops: float = 0.0
    weights: dict[str, float] = field(default_factory=dict)      # weight buffer -> bytes (once per step)
    cache_bytes: float = 0.0
    output_bytes: float = 0.0    # logits

    def roofline_us(self, copy_gbps: float, tflops: float, nbytes: float | None = None) -> float:
        moved = self.nbytes if nbytes is None else nbytes
        return max(moved / (copy_gbps * 1e3), self.flops / (tflops * 1e6))


def _int_args(spec: abi.KernelSpec, node: M.Node) -> dict[str, int]:
    values = {}
    for param, arg in zip(spec.params, node.args):
        kind = arg.WhichOneof("value")
        if kind in ("i32", "i64"):
            values[param.name] = getattr(arg, kind)
    return values


def node_cost(node: M.Node, buffers: Mapping[str, M.Buffer], step: Step, capacity_tokens: int) -> Cost:
    """Bytes and FLOPs of one kernel node at `step` (capacity_tokens: the program's token capacity)."""
    cost = Cost()
    if node.kind != M.NODE_KIND_KERNEL or node.kernel not in abi.KERNELS:
        return cost
    spec = abi.KERNELS[node.kernel]
    ints = _int_args(spec, node)
    kv_row = 2 * ints.get("kv_heads", 0) * ints.get("head_dim", 0)     # f16 bytes of one position of K (or V)
    attention = node.kernel.startswith(ATTENTION_PREFIX)
    rows, tokens = step.rows, step.tokens
    for param, arg in zip(spec.params, node.args):
        if arg.WhichOneof("value") != "pointer":
            continue
        buffer = buffers.get(arg.pointer.buffer)
        if buffer is None:
            continue
        if buffer.kind == M.BUFFER_KIND_WEIGHT:
            if param.name in ROW_TABLES:
                moved = tokens * buffer.nbytes / max(1, buffer.shape[0])
            else:
                moved = float(buffer.nbytes)
            if param.name in MATRIX_PARAMS:
                elements = buffer.nbytes / 2
                cost.flops += 2 * (rows if param.name == "head" else tokens) * elements
            cost.weights[buffer.name] = max(cost.weights.get(buffer.name, 0.0), moved)
            cost.nbytes += moved
        elif buffer.kind == M.BUFFER_KIND_CACHE:
            if param.access == abi.Access.READ and attention:
                positions = rows * step.context if step.context else tokens
                moved = positions * kv_row
            else:
                moved = tokens * kv_row
            cost.cache_bytes += moved
            cost.nbytes += moved
        elif param.name == "logits" or arg.pointer.buffer == LOGITS_BUFFER:
            # the product path writes the logits as a product's `out` of width out_dim
            moved = rows * ints.get("vocab", ints.get("out_dim", 0)) * 4
            cost.output_bytes += moved
            cost.nbytes += moved
        elif buffer.shape and buffer.shape[0] == capacity_tokens:     # activation rows
            passes = 2 if param.access == abi.Access.READ_WRITE else 1
            cost.nbytes += passes * tokens * buffer.nbytes / buffer.shape[0]
    if attention:
        head_dim, q_heads = ints.get("head_dim", 0), ints.get("q_heads", 0)
        pairs = rows * step.context if step.context else tokens * (tokens + 1) / 2
        cost.flops += 4 * pairs * q_heads * head_dim
    return cost


def program_costs(manifest: M.ExecutionManifest, program: M.Program, step: Step
                  ) -> tuple[Cost, list[tuple[M.Node, Cost]]]:
    """(the step's minimal cost, each node's own cost) of `program` at `step`."""
    buffers = {b.name: b for b in manifest.buffers if b.rank == program.rank}
    capacity = max((b.shape[0] for b in buffers.values() if b.name == "scratch.hidden"), default=0)
    nodes = [(node, node_cost(node, buffers, step, capacity)) for node in program.nodes]
    total = Cost()
    for _node, cost in nodes:
        for name, moved in cost.weights.items():
            total.weights[name] = max(total.weights.get(name, 0.0), moved)
        total.flops += cost.flops
        total.cache_bytes += cost.cache_bytes
        total.output_bytes = max(total.output_bytes, cost.output_bytes)     # logits written once
    total.nbytes = sum(total.weights.values()) + total.cache_bytes + total.output_bytes
    return total, nodes
