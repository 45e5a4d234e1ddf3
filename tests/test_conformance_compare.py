"""The conformance harness's comparison (tests/gpu/conformance.compare), which every device
conformance figure rests on: a request row whose input diverged (its preparation broke a near
tie the other way) drops exactly its own logit rows, also where a speculative step packs each
lane's target rows one after another, and a real difference in any other row still fails."""

from __future__ import annotations

import pathlib
import sys

import numpy as np

from helios_proto import manifest_pb2 as M

sys.path.insert(0, str(pathlib.Path(__file__).parent / "gpu"))
import conformance  # noqa: E402

VOCAB = 32
ROWS = 4
TARGETS = {0: range(0, 1), 1: range(1, 3), 2: range(3, 6), 3: range(6, 10)}   # 1 + 0..3 proposals


def _program(rows: int, tokens: int) -> M.Program:
    program = M.Program(name="speculative.r4.w4.t16")
    program.capacity.rows, program.capacity.tokens = rows, tokens
    return program


def _outputs(bad_logit_row: int | None) -> dict:
    rng = np.random.default_rng(7)
    logits = rng.standard_normal((16, VOCAB)).astype(np.float32)
    rows = np.zeros((ROWS, 4), np.int32)
    rows[:, conformance.TOKEN_WORD] = np.arange(ROWS)
    candidate = logits.copy()
    for row in TARGETS[1]:                 # request row 1's input diverged: its targets differ
        candidate[row] = rng.standard_normal(VOCAB)
    if bad_logit_row is not None:
        candidate[bad_logit_row] += 1.0
    return {"cuda": (rows.copy(), candidate, {}), "numpy": (rows, logits, {})}


def _prepared() -> dict:
    return {"cuda": {0: 5, 1: 9, 2: 5, 3: 5}, "numpy": {0: 5, 1: 8, 2: 5, 3: 5}}


def test_a_diverged_lane_drops_its_own_target_rows() -> None:
    result = conformance.compare("speculative.r4.w4.t16", _program(ROWS, 16), _outputs(None), None,
                                 _prepared(), logit_rows=TARGETS)
    assert result["diverged_inputs"] == [1]
    assert result["pass"], result


def test_another_lanes_target_row_still_fails_and_is_named() -> None:
    result = conformance.compare("speculative.r4.w4.t16", _program(ROWS, 16), _outputs(8), None,
                                 _prepared(), logit_rows=TARGETS)
    assert not result["pass"]
    assert result["bad_rows"] == [8]


def test_one_row_per_request_row_by_default() -> None:
    outputs = _outputs(None)
    one_each = {r: range(r, r + 1) for r in range(ROWS)}
    # without the lanes' layout, request row 1's diverged targets (rows 1-2) are compared as others'
    assert not conformance.compare("decode.r4", _program(ROWS, ROWS), outputs, None, _prepared())["pass"]
    assert conformance.compare("decode.r4", _program(ROWS, ROWS), outputs, None, _prepared(),
                               logit_rows={**one_each, 1: range(1, 3)})["pass"]
