"""Initial reasoning state from the rendered prompt (FE-14..17, FE-34, FE-35)."""

from __future__ import annotations

from helios_proto import contract_pb2 as pb

from helios_backend.syntax.prompt_state import ReasoningStart, initial_state
from helios_backend.syntax.tables import FrontendSyntax, chatml_prefix_rules, preset
from tests.syntax_cases import A, FRAMES, Q, THINK

THINKING = preset(Q, THINK)
SYSTEM = "<|im_start|>system\nYou help.<|im_end|>\n"
USER = "<|im_start|>user\nHi <think> there<|im_end|>\n"


def test_open_assistant_envelope_with_open_think_starts_in_reasoning():
    # spec: FE-14
    state = initial_state(SYSTEM + USER + "<|im_start|>assistant\n<think>\n", THINKING)
    assert state.start is ReasoningStart.OPEN
    assert state.newline_consumed


def test_open_envelope_without_think_may_open_reasoning():
    # spec: FE-14
    assert initial_state(SYSTEM + USER + "<|im_start|>assistant\n", THINKING).start is ReasoningStart.MAY_OPEN


def test_closed_think_in_the_open_envelope_means_the_answer_follows():
    # spec: FE-14
    prompt = SYSTEM + USER + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert initial_state(prompt, THINKING).start is ReasoningStart.CLOSED


def test_completed_messages_do_not_open_reasoning():
    # spec: FE-15
    done = "<|im_start|>assistant\n<think>\nold thoughts<|im_end|>\n"
    prompt = SYSTEM + USER + done + "<|im_start|>user\n<think><|im_end|>\n<|im_start|>assistant\n"
    assert initial_state(prompt, THINKING).start is ReasoningStart.MAY_OPEN


def test_after_an_embedded_tool_response_only_text_after_the_last_end_marker_counts():
    # spec: FE-16
    resumed = (
        "<|im_start|>assistant\n<think>\nplan<|im_end|>\n"
        "<|im_start|>tool\n<tool_response>{\"t\": 1} <think></tool_response><|im_end|>\n"
    )
    assert initial_state(SYSTEM + USER + resumed + "<|im_start|>assistant\n", THINKING).start is ReasoningStart.MAY_OPEN
    assert initial_state(SYSTEM + USER + resumed + "<|im_start|>assistant\n<think>", THINKING).start is ReasoningStart.OPEN


def test_prefix_rules_declare_which_envelope_may_open_reasoning():
    # spec: FE-17
    rules = chatml_prefix_rules()
    assert {r.role: r.may_open_reasoning for r in rules} == {"system": False, "user": False, "assistant": True, "tool": False}
    # an open *user* envelope cannot open reasoning even if it contains the open delimiter
    assert initial_state(SYSTEM + "<|im_start|>user\n<think>", THINKING).start is ReasoningStart.CLOSED
    only_system = FrontendSyntax(Q, THINK, THINKING.tool, THINKING.reasoning,
                                 (pb.PrefixBoundaryRule(role="assistant", open="<|im_start|>assistant\n", close="<|im_end|>",
                                                        may_open_reasoning=False),))
    assert initial_state("<|im_start|>assistant\n<think>", only_system).start is ReasoningStart.CLOSED


def test_syntax_without_reasoning_always_starts_in_the_answer():
    plain = preset(Q, pb.REASONING_PARSER_NONE)
    assert initial_state("<|im_start|>assistant\n<think>", plain).start is ReasoningStart.CLOSED


FRAMED = preset(A, FRAMES)


def test_open_header_accepts_the_generated_recipient():
    # spec: FE-34
    state = initial_state("<|start|>user<|message|>hi<|end|><|start|>assistant", FRAMED)
    assert state.start is ReasoningStart.FRAME_HEADER_OPEN
    assert state.header_prefix == "assistant"


def test_prepared_body_continues_inside_it():
    # spec: FE-35
    state = initial_state("<|start|>user<|message|>hi<|end|><|start|>assistant to=self<|message|>", FRAMED)
    assert (state.start, state.recipient) == (ReasoningStart.FRAME_BODY, "self")


def test_completed_frames_leave_the_output_at_a_header():
    # spec: FE-15, FE-31
    prompt = "<|start|>assistant to=functions.f<|message|>x<|eom|><|start|>tool<|message|>{}<|end|>"
    assert initial_state(prompt, FRAMED).start is ReasoningStart.FRAME_EXPECT_HEADER
