"""Small, valid contracts and manifests for contract versions 1, 2 and 3.

Shared by the core and contract tests and by tools/make_golden_cores.py. Each test
that needs an invalid contract starts from one of these and breaks one thing.
"""
from __future__ import annotations

from helios_proto import contract_pb2 as c
from helios_proto import manifest_pb2 as m

REQUEST_SLOTS = 4
MAX_PAGES_PER_ROW = 8
CONFIDENCE_CAPACITY = 4


def _buffer(name: str, kind: int, dtype: int, shape: list[int], nbytes: int, **extra) -> m.Buffer:
    return m.Buffer(name=name, rank=0, kind=kind, dtype=dtype, shape=shape, nbytes=nbytes, alignment=256, **extra)


def sample_manifest(version: int = 3) -> m.ExecutionManifest:
    """The execution manifest matching sample_contract(version)."""
    manifest = m.ExecutionManifest(
        abi="helios-abi6", world_size=1, request_slots=REQUEST_SLOTS, max_pages_per_row=MAX_PAGES_PER_ROW
    )
    manifest.buffers.extend([
        _buffer("weights", m.BUFFER_KIND_WEIGHT, c.DTYPE_U8, [64], 64, weight=m.WeightSource(resource="weights")),
        _buffer("pending", m.BUFFER_KIND_STATE, c.DTYPE_I32, [2 * REQUEST_SLOTS], 8 * REQUEST_SLOTS),  # 2 state rows per request
        _buffer("page_table", m.BUFFER_KIND_STATE, c.DTYPE_I32, [REQUEST_SLOTS, MAX_PAGES_PER_ROW], 4 * REQUEST_SLOTS * MAX_PAGES_PER_ROW),
        _buffer("kv", m.BUFFER_KIND_CACHE, c.DTYPE_F16, [2, 16, 32], 2048),
        _buffer("staging", m.BUFFER_KIND_STAGING, c.DTYPE_U8, [4096], 4096),
        _buffer("scratch", m.BUFFER_KIND_SCRATCH, c.DTYPE_U8, [1024], 1024),
        _buffer("completion", m.BUFFER_KIND_COMPLETION, c.DTYPE_I32, [64], 256),
        _buffer("gemm_config", m.BUFFER_KIND_TUNED, c.DTYPE_I32, [16], 64),
        _buffer("proposal_confidence", m.BUFFER_KIND_STATE, c.DTYPE_F32,
                [2, REQUEST_SLOTS, CONFIDENCE_CAPACITY], 4 * 2 * REQUEST_SLOTS * CONFIDENCE_CAPACITY),
    ])
    destinations = [
        ("slot", c.DTYPE_I32, 4), ("tokens", c.DTYPE_I32, 64), ("positions", c.DTYPE_I32, 64),
        ("query_length", c.DTYPE_I32, 4), ("page_table_entries", c.DTYPE_I32, 32), ("seed", c.DTYPE_U64, 4),
        ("sampling", c.DTYPE_F32, 28), ("prefix_limit", c.DTYPE_I32, 4), ("host_pending", c.DTYPE_I32, 4),
        ("image_features", c.DTYPE_F16, 64), ("query_length_copy", c.DTYPE_I32, 4),
    ]
    offset = 0
    for name, dtype, elements in destinations:
        manifest.transport.destinations.add(name=name, dtype=dtype, byte_offset=offset, elements=elements)
        offset += 8 * elements
    manifest.transport.frames = 2
    manifest.transport.staging_buffer = "staging"
    manifest.transport.frame_nbytes = 4096
    manifest.transport.completion_buffer = "completion"
    manifest.transport.completion_nbytes = 256
    manifest.completion.header_words = 4
    manifest.completion.row_words = 8
    manifest.completion.rows = REQUEST_SLOTS
    manifest.completion.row.add(name="token", word=0, words=1, dtype=c.DTYPE_I32)
    manifest.completion.row.add(name="draft_cursor", word=1, words=1, dtype=c.DTYPE_I32)
    manifest.modules.add(resource="kernels", arch="sm_90a", toolchain="triton 3.4")
    manifest.modules[0].kernels.add(id="noop", symbol="noop_kernel", params=[m.PARAM_KIND_POINTER, m.PARAM_KIND_I32])
    programs = [("prefill_r1", c.OPERATION_PREFILL, 1, 64), ("decode_r4", c.OPERATION_DECODE, 4, 4)]
    if version >= 3:
        programs.append(("speculative_r4_w4", c.OPERATION_SPECULATIVE, 4, 16))
    for name, operation, rows, tokens in programs:
        program = manifest.programs.add(name=name, operation=operation, rank=0, capacity=c.Capacity(rows=rows, tokens=tokens))
        program.nodes.add(kind=m.NODE_KIND_KERNEL, kernel="noop", grid=m.Dim3(x=1, y=1, z=1), block=m.Dim3(x=32, y=1, z=1))
    if version >= 2:
        manifest.tuning.add(name="tune_gemm", operation=c.OPERATION_INITIALIZATION, rank=0,
                            capacity=c.Capacity(rows=1, tokens=1), outputs=["gemm_config"])
    return manifest


def _binding(destination: str, source: int, index: int, **extra) -> c.ValueBinding:
    return c.ValueBinding(destination=destination, source=source, index=index, **extra)


def _pending_access(access: int) -> c.StateAccess:
    view = c.StateView(name="pending_view", buffer="pending", byte_offset=0, row_stride=4, byte_extent=4)
    return c.StateAccess(view=view, access=access)


def sample_contract(version: int = 3) -> c.ServingContract:
    """A valid ServingContract of the given contract version (1, 2 or 3)."""
    contract = c.ServingContract(
        served_id="sample-model",
        aliases=["sample"],
        cache_identity=c.CacheIdentity(label="sample-model/f16", fingerprint=bytes(range(32))),
        context_tokens=256,
        prefill_tokens=64,
        prepared_pages=32,
        prepared_snapshots=4,
        concurrency=REQUEST_SLOTS,
        defaults=c.ServingDefaults(
            sampling=c.SamplingDefaults(temperature=0.7, top_p=0.9, top_k=40, repetition_penalty=1.0),
            eos_token_ids=[2],
            max_output_tokens=128,
        ),
    )
    model = contract.model
    model.version = version
    model.vocabulary.CopyFrom(c.Vocabulary(sampled_tokens=100, histogram_bins=100, mask_words=4))
    model.input_vocabulary.input_tokens = 101 if version >= 2 else 100
    model.cache.page_tokens = 16
    model.cache.regions.add(name="kv", kind=c.HISTORY_KIND_PAGED_KV, planes=[c.CachePlane(buffer="kv", bytes_per_page=2048)],
                            tokens_per_record=1)
    model.cache.page_table_views.add(destination="page_table_entries", page_offset=0, pages_per_row=MAX_PAGES_PER_ROW)
    common = [
        _binding("slot", c.VALUE_SOURCE_SLOT, c.INDEX_MODE_SUBMISSION_ROW, padding=-1),
        _binding("page_table_entries", c.VALUE_SOURCE_PAGE_TABLE, c.INDEX_MODE_ACTIVE_ROW),
        _binding("seed", c.VALUE_SOURCE_SEED_BITS, c.INDEX_MODE_SUBMISSION_ROW),
        _binding("sampling", c.VALUE_SOURCE_SAMPLING_PARAMETERS, c.INDEX_MODE_SUBMISSION_ROW),
    ]
    prefill = model.graphs.add(program="prefill_r1", operation=c.OPERATION_PREFILL, rank=0,
                               capacity=c.Capacity(rows=1, tokens=64), state_rows_per_request=1)
    prefill.bindings.extend(common + [
        _binding("tokens", c.VALUE_SOURCE_PROMPT_TOKENS, c.INDEX_MODE_PACKED_TOKEN),
        _binding("positions", c.VALUE_SOURCE_PROMPT_POSITIONS, c.INDEX_MODE_PACKED_TOKEN),
        _binding("query_length", c.VALUE_SOURCE_QUERY_LENGTH, c.INDEX_MODE_SUBMISSION_ROW),
        # a second destination fed from the same source (OWN-7)
        _binding("query_length_copy", c.VALUE_SOURCE_QUERY_LENGTH, c.INDEX_MODE_SUBMISSION_ROW),
    ])
    prefill.state_accesses.append(_pending_access(c.ACCESS_WRITE))
    prefill.pending_token.device_state_view = "pending_view"
    prefill.resources.extend(["weights", "kernels"])
    decode = model.graphs.add(program="decode_r4", operation=c.OPERATION_DECODE, rank=0,
                              capacity=c.Capacity(rows=4, tokens=4), state_rows_per_request=1)
    decode.bindings.extend(common + [_binding("positions", c.VALUE_SOURCE_PROMPT_POSITIONS, c.INDEX_MODE_ACTIVE_ROW)])
    decode.state_accesses.append(_pending_access(c.ACCESS_READ_WRITE))
    decode.pending_token.device_state_view = "pending_view"
    decode.resources.extend(["weights", "kernels"])
    fe = model.frontend
    fe.tool_parser = c.TOOL_PARSER_QWEN_CODER_FUNCTION_TAGS
    fe.reasoning_parser = c.REASONING_PARSER_THINK_TAGS
    fe.image_preparation = c.IMAGE_PREPARATION_NONE
    fe.image_layout = c.IMAGE_LAYOUT_NONE
    fe.tool_syntax.CopyFrom(c.ToolSyntax(
        block_open="<tool_call>", block_close="</tool_call>", invocation_open_prefix="<function=",
        invocation_open_suffix=">", invocation_close="</function>", parameter_open_prefix="<parameter=",
        parameter_open_suffix=">", parameter_close="</parameter>", tag_separator="\n", wrap_newlines=True,
        argument_encoding=c.ARGUMENT_ENCODING_TAGGED_PARAMETERS,
    ))
    fe.reasoning_syntax.CopyFrom(c.ReasoningSyntax(open="<think>", close="</think>", terminal_marker="<tool_call>"))
    fe.prefix_rules.add(role="assistant", open="<|im_start|>assistant\n", close="<|im_end|>", may_open_reasoning=True)
    fe.template_tokens.CopyFrom(c.TemplateTokens(bos_token="<|im_start|>", eos_token="<|im_end|>"))
    fe.tokenizer_resource = "tokenizer"
    fe.chat_template_resource = "chat_template"
    if version >= 2:
        model.vision.CopyFrom(c.VisionContract(feature_slots=2, features_per_window=16, patches_per_feature=4,
                                               patch_capacities=[64]))
        model.input_vocabulary.image_sentinels.append(100)
        prefill.tuned_bindings.add(buffer="gemm_config", producer="tune_gemm")
        prefill.bindings.append(_binding("image_features", c.VALUE_SOURCE_IMAGE_TENSOR, c.INDEX_MODE_PACKED_TOKEN,
                                         image_output="pixel_features"))
        fe.image_preparation = c.IMAGE_PREPARATION_RESIZE_NORMALIZE
        fe.image_layout = c.IMAGE_LAYOUT_FIXED_SPAN
        fe.image_layout_data.feature_ids.append(100)
        fe.image_preparation_settings.CopyFrom(c.ImagePreparationSettings(
            image_size=224, patch_size=14, mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5]))
    if version >= 3:
        contract.speculative_widths.append(4)
        spec = model.graphs.add(program="speculative_r4_w4", operation=c.OPERATION_SPECULATIVE, rank=0,
                                capacity=c.Capacity(rows=4, tokens=16), state_rows_per_request=2)
        spec.bindings.extend(common + [
            _binding("prefix_limit", c.VALUE_SOURCE_SPECULATIVE_PREFIX_LIMIT, c.INDEX_MODE_SUBMISSION_ROW),
        ])
        spec.state_accesses.append(_pending_access(c.ACCESS_READ_WRITE))
        spec.pending_token.device_state_view = "pending_view"
        spec.resources.extend(["weights", "kernels"])
        spec.speculative.CopyFrom(c.SpeculativeDescriptor(
            batch_capacity=4, draft_tokens=3, token_capacity=4, packed_token_capacity=16,
            confidence_width=3, confidence_buffer="proposal_confidence", confidence_draft_capacity=CONFIDENCE_CAPACITY,
        ))
        spec.cursor.CopyFrom(c.CompletionCursor(reports_draft_cursor=True, lag_tokens=1, state_view="pending_view"))
    return contract


SAMPLE_RESOURCE_IDS = frozenset({"weights", "kernels", "tokenizer", "chat_template"})
