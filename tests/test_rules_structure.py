"""Structural spec rules: one runtime, no model-name dispatch, recipes as declarations,
frontend identifiers that select nothing outside the frontend, serving metadata and cache
contract fields. Checked on the code (AST scans of helios_backend/, gateway/, ignition/) and on
the real recorded SmolLM2 contract: changing what must not matter changes nothing that the
packer, the variant table, the scheduler or completion validation decide."""
from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys
import tomllib

import numpy as np
import pytest
from helios_proto import contract_pb2 as C
from helios_proto import manifest_pb2 as M

from helios_backend.contract import ContractError, PreparedContract
from helios_backend.packing import SlotInitialization, PackedLane, Packer
from helios_backend.sampling_parameters import SamplingParameters
from helios_backend.scheduler.variants import VariantTable
from tests.contract_samples import SAMPLE_RESOURCE_IDS, sample_contract, sample_manifest
from tests.engine_fixtures import ACCEPTANCE, prepared_in_memory

ROOT = pathlib.Path(__file__).resolve().parent.parent
SERVING_TREES = ("helios_backend", "gateway", "model_repository")


def _sources(*trees: str, exclude: tuple[str, ...] = ()) -> dict[str, ast.Module]:
    out = {}
    for tree in trees:
        for path in sorted((ROOT / tree).rglob("*.py")):
            relative = str(path.relative_to(ROOT))
            if any(relative.startswith(e) for e in exclude):
                continue
            out[relative] = ast.parse(path.read_text(), relative)
    return out


def _calls(module: ast.Module) -> list[str]:
    """Dotted names of every call: NativeModel.load, Scheduler, self._runner.run ..."""
    names = []
    for node in ast.walk(module):
        if isinstance(node, ast.Call):
            names.append(ast.unparse(node.func))
    return names


@pytest.fixture(scope="module")
def prepared():
    return prepared_in_memory()


def _decode(contract: C.ServingContract, manifest: M.ExecutionManifest, resources=None) -> PreparedContract:
    return PreparedContract.decode(contract, manifest, resource_ids=resources)


# ---- OWN: one runtime, no per-model code, recipes as declarations -----------------------------

def test_serving_goes_through_one_runtime_and_one_server():
    # spec: OWN-1
    sources = _sources("helios_backend/engine", "helios_backend/triton", "model_repository")
    where: dict[str, list[str]] = {}
    for path, module in sources.items():
        for name in _calls(module):
            for wanted in ("NativeModel.load", "Scheduler", "EngineLoop", "ResponseHub", "Engine.start",
                           "Bootstrap.load"):
                if name == wanted:
                    where.setdefault(wanted, []).append(path)
    runtime = "helios_backend/engine/engine.py"
    for part in ("Scheduler", "EngineLoop", "ResponseHub", "Bootstrap.load"):
        assert where.get(part) == [runtime], (part, where.get(part))
    assert where.get("NativeModel.load") == ["helios_backend/engine/setup.py"]   # setup derived once
    assert where.get("Engine.start") == ["helios_backend/triton/adapter.py"]
    # the Triton model is the adapter and nothing else
    model_py = sources["model_repository/helios/1/model.py"]
    classes = [n for n in model_py.body if isinstance(n, ast.ClassDef)]
    assert [ast.unparse(b) for c in classes for b in c.bases] == ["TritonHeliosModel"]


FAMILY_NAMES = ("smollm", "llama", "qwen", "mistral", "mixtral", "gemma", "phi-", "phi3", "deepseek", "glm-4",
                "gpt-oss", "huggingfacetb", "olmo", "falcon")


def _identity_strings() -> tuple[str, ...]:
    from ignition.recipes import smollm2_135m_instruct as recipe

    return tuple(s.lower() for s in (recipe.NAME, recipe.SERVED_ID, *recipe.ALIASES)) + FAMILY_NAMES


def _decision_strings(module: ast.Module) -> list[tuple[int, str]]:
    """String constants that take part in a decision: comparisons, if/while/match tests,
    startswith/endswith/in, dict keys (dispatch tables), match patterns."""
    found: list[tuple[int, str]] = []

    def strings(node: ast.AST) -> None:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                found.append((sub.lineno, sub.value))

    for node in ast.walk(module):
        if isinstance(node, (ast.Compare, ast.MatchValue)):
            strings(node)
        elif isinstance(node, (ast.If, ast.While, ast.IfExp)):
            strings(node.test)
        elif isinstance(node, ast.Dict):
            for key in node.keys:
                if key is not None:
                    strings(key)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in (
                "startswith", "endswith", "match", "fullmatch", "search", "get"):
            for arg in node.args:
                strings(arg)
    return found


def test_no_dispatch_on_model_name_or_family():
    # spec: OWN-4, FE-2
    identities = _identity_strings()
    hits = []
    for path, module in _sources(*SERVING_TREES).items():
        for line, value in _decision_strings(module):
            if any(name in value.lower() for name in identities):
                hits.append(f"{path}:{line}: {value!r}")
    assert hits == []
    # the served id and aliases are compared only where a request names its model (routing)
    compared = []
    for path, module in _sources(*SERVING_TREES).items():
        for node in ast.walk(module):
            if isinstance(node, ast.Compare):
                text = ast.unparse(node)
                if any(f in text for f in ("served_id", "aliases", "cache_identity", "recipe")):
                    compared.append(path)
    # (and where the startup names join the core's served id and aliases: engine/settings.py)
    assert set(compared) <= {"gateway/served_model.py", "helios_backend/contract/checks_serving.py",
                             "helios_backend/engine/settings.py"}, compared


def test_renaming_the_model_changes_no_serving_decision(prepared):
    # spec: OWN-4, FE-52
    manifest = prepared.manifest
    renamed = C.ServingContract()
    renamed.CopyFrom(prepared.contract)
    renamed.served_id = "unrelated-name"
    del renamed.aliases[:]
    renamed.aliases.append("another")
    renamed.cache_identity.label = "unrelated-name/f16"
    a, b = _decode(prepared.contract, manifest), _decode(renamed, manifest)
    assert (a.graphs, a.cache, a.vocabulary, a.frontend, a.extents) == (b.graphs, b.cache, b.vocabulary, b.frontend,
                                                                          b.extents)
    assert _pack_everything(prepared.contract, manifest) == _pack_everything(renamed, manifest)
    assert _schedule_everything(prepared.contract) == _schedule_everything(renamed)


def test_recipes_live_in_ignition_recipes_and_declare_metadata(prepared):
    # spec: OWN-5
    from ignition.recipes import smollm2_135m_instruct as recipe

    assert pathlib.Path(recipe.__file__).parent == ROOT / "ignition" / "recipes"
    contract = prepared.contract
    # semantic metadata declared by the recipe lands in the contract beside the captured catalog
    assert contract.served_id == recipe.SERVED_ID and tuple(contract.aliases) == recipe.ALIASES
    assert contract.defaults.sampling == recipe.SAMPLING_DEFAULTS
    assert tuple(contract.defaults.eos_token_ids) == recipe.EOS_TOKEN_IDS
    assert contract.model.frontend.template_tokens == recipe.TEMPLATE_TOKENS
    assert contract.model.frontend.tool_parser == recipe.frontend().tool_parser
    assert {g.program for g in contract.model.graphs} == {p.name for p in prepared.manifest.programs}


def test_recipes_reuse_the_shared_declarations():
    # spec: OWN-6
    from ignition.preparation import contract as shared

    # the shared module provides admission, sampling, state transfer and paged-text pieces
    for name in ("initialization_bindings", "generation_bindings", "restoration_bindings", "record_initialization",
                 "record_sampling_epilogue", "record_step_prologue", "state_accesses", "PagedKV", "SLOT_STATE"):
        assert hasattr(shared, name), name
    bindings = {b.source for b in shared.initialization_bindings()}
    assert {C.VALUE_SOURCE_SEED_BITS, C.VALUE_SOURCE_SAMPLING_PARAMETERS, C.VALUE_SOURCE_OUTPUT_LIMIT,
            C.VALUE_SOURCE_EOS_IDS, C.VALUE_SOURCE_PROMPT_HISTOGRAM} <= bindings
    # a recipe declares no bindings, state accesses or transport of its own
    recipes = _sources("ignition/recipes")
    for path, module in recipes.items():
        calls = _calls(module)
        for own in ("C.ValueBinding", "C.StateAccess", "C.StateView", "M.Transport", "M.Destination",
                    "C.GraphContract", "M.CompletionLayout"):
            assert own not in calls, (path, own)
    # the recorded contract's bindings all come from the shared declarations
    prepared = prepared_in_memory()
    shared_bindings = shared.initialization_bindings() + shared.restoration_bindings()
    for operation in C.Operation.values():
        for snapshots in (False, True):
            shared_bindings += shared.generation_bindings(operation, snapshots=snapshots)
    declared = {b.SerializeToString(deterministic=True) for b in shared_bindings}
    checked = 0
    for graph in prepared.contract.model.graphs:
        if graph.operation == C.OPERATION_SPECULATIVE:
            continue                      # ignition/preparation/speculative.py (another shared module)
        for binding in graph.bindings:
            assert binding.SerializeToString(deterministic=True) in declared, (graph.program, binding)
            checked += 1
    assert checked > 50


def test_recipes_cannot_install_scheduling_or_state_update_code(prepared):
    # spec: OWN-8
    # recipes import no serving code (scheduler, server, packing, executors)
    for path, module in _sources("ignition/recipes").items():
        for node in ast.walk(module):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(("helios_backend.scheduler", "helios_backend.engine", "helios_backend.triton",
                                                   "helios_backend.packing", "helios_backend.executors",
                                                   "helios_backend.engine.model")), (path, node.module)
    # a core carries data only: the serving side never runs code from it
    for path, module in _sources("helios_backend").items():
        for name in _calls(module):
            assert name not in ("exec", "eval", "compile", "__import__", "importlib.import_module",
                                "pickle.loads", "marshal.loads", "runpy.run_path"), (path, name)
    # every executable resource of the core is a declared kind: weights, tokenizer, template, kernels
    kinds = {r.kind for r in prepared.resources}
    assert kinds <= {v for k, v in _resource_kinds().items() if k != "UNSPECIFIED"}
    # and every program node is a kernel id of the ABI table (no host callbacks)
    from helios_backend.kernel_abi import abi
    for program in prepared.manifest.programs:
        assert all(n.kind == M.NODE_KIND_KERNEL and n.kernel in abi.KERNELS for n in program.nodes), program.name


def _resource_kinds() -> dict[str, int]:
    from helios_proto import core_pb2

    enum = next(e for e in core_pb2.DESCRIPTOR.enum_types_by_name.values() if "RESOURCE_KIND" in e.values[0].name)
    return {v.name.split("RESOURCE_KIND_")[-1]: v.number for v in enum.values}


def test_one_package_whose_extras_select_serving_and_the_cuda_executor():
    # spec: OWN-9
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "helios"
    extras = project["optional-dependencies"]
    assert {"serve", "gpu"} <= set(extras)
    assert any(d.startswith("cuda-bindings") for d in extras["gpu"])
    assert any(d.startswith(("nvidia-pytriton", "tritonclient")) for d in extras["serve"])
    # the runtime core imports none of the optional extras: the numpy executor serves without them
    for path, module in _core_modules().items():
        for node in ast.walk(module):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                for name in names:
                    assert not name.startswith(("cuda", "tritonclient", "fastapi", "triton", "pytriton")), (path, name)


def _core_modules() -> dict[str, ast.Module]:
    out = _sources("helios_backend/core", "helios_backend/contract", "helios_backend/scheduler",
                   "helios_backend/kernel_abi")
    for single in ("helios_backend/packing.py", "helios_backend/sampling_parameters.py", "helios_backend/engine/model.py",
                   "helios_backend/engine/bootstrap.py", "helios_backend/executors/numpy_executor.py"):
        out[single] = ast.parse((ROOT / single).read_text(), single)
    return out


# ---- FE-46..50, FE-52: the frontend selects nothing outside the frontend ----------------------

def test_runtime_reads_no_checkpoint_config_or_model_card(smollm2_core):
    # spec: FE-46
    from helios_backend.engine.bootstrap import Bootstrap

    opened: list[str] = []
    recording = [False]

    def hook(event: str, args: tuple) -> None:
        if recording[0] and event == "open" and isinstance(args[0], (str, bytes, pathlib.Path)):
            opened.append(str(args[0]))

    sys.addaudithook(hook)
    recording[0] = True
    try:
        bootstrap = Bootstrap.load(smollm2_core, ACCEPTANCE)
        try:
            assert bootstrap.tokenizer is not None and bootstrap.contract.model.frontend is not None
        finally:
            bootstrap.close()
    finally:
        recording[0] = False
    data = [p for p in opened if not p.endswith((".py", ".pyc", ".so")) and "__pycache__" not in p
            and not p.startswith(("/proc", "/sys", "/dev"))]
    assert str(smollm2_core) in data
    assert set(data) == {str(smollm2_core)}, data      # the core is the only file read
    for path, module in _sources("helios_backend", "gateway").items():
        for line, value in [(n.lineno, n.value) for n in ast.walk(module)
                            if isinstance(n, ast.Constant) and isinstance(n.value, str)]:
            lowered = value.lower()
            for name in ("config.json", "generation_config", "tokenizer_config", "readme.md", "modelcard",
                         "model_card", "huggingface.co", "hf_hub"):
                assert name not in lowered, f"{path}:{line}: {value!r}"


def _syntax_variant_contracts(base: C.ServingContract) -> list[C.ServingContract]:
    from ignition.recipes.syntax_variants import VARIANTS, variant_frontend

    out = []
    for variant in VARIANTS:
        contract = C.ServingContract()
        contract.CopyFrom(base)
        contract.model.frontend.CopyFrom(variant_frontend(variant))
        out.append(contract)
    return out


def _pack_everything(contract: C.ServingContract, manifest: M.ExecutionManifest) -> list[bytes]:
    """Frame bytes after packing the same lanes into every program."""
    frames = [np.zeros(manifest.transport.frame_nbytes, np.uint8) for _ in range(2)]
    packer = Packer(list(contract.model.graphs), manifest.transport, manifest.request_slots, frames)
    bins = contract.model.vocabulary.histogram_bins
    admission = SlotInitialization.for_prompt([5, 9, 9], bins, 3, SamplingParameters(0.5), 7, (2,))
    out = []
    for graph in contract.model.graphs:
        if graph.operation == C.OPERATION_SPECULATIVE:
            continue                      # proposal lanes: tests/test_speculative_generation.py
        lanes = [PackedLane(slot=1, generation=2, start=4, page_table=[3], initialization=admission)]
        if graph.operation in (C.OPERATION_PREFILL, C.OPERATION_MIXED):
            lanes.append(PackedLane(slot=0, generation=5, start=0, tokens=np.arange(3, dtype=np.int32), page_table=[6],
                              initialization=admission))
        if graph.operation == C.OPERATION_PREFILL:
            lanes = lanes[1:]
        packer.pack(graph.program, 0, lanes[:graph.capacity.rows])
        out.append(frames[0].tobytes())
    return out


def _schedule_everything(contract: C.ServingContract) -> tuple:
    """The simulated scheduler over this contract's variant table and completion cursors."""
    from helios_backend.scheduler.request import RequestSpec, SamplingSettings
    from helios_backend.scheduler.scheduler import Scheduler, SchedulerConfig
    from tests.scheduler_sim import SimulatedEngine

    cfg = SchedulerConfig(page_tokens=contract.model.cache.page_tokens, num_pages=8, request_slots=4, max_active=4,
                          queue_capacity=8, context_tokens=contract.context_tokens, max_pages_per_row=32,
                          vocab_size=contract.model.vocabulary.sampled_tokens,
                          input_vocab_size=contract.model.input_vocabulary.input_tokens,
                          eos_ids=tuple(contract.defaults.eos_token_ids))
    sched = Scheduler(cfg, VariantTable.from_graphs(contract.model.graphs))
    engine = SimulatedEngine(sched)
    for serial in range(5):
        sched.add(serial, RequestSpec(tuple(range(3 + serial * 7, 3 + serial * 7 + 20 + serial)), 60,
                                      SamplingSettings()))
    for _ in range(2000):
        if not engine.step() and not sched.has_work():
            break
    cursors = tuple(g.cursor.reports_draft_cursor for g in contract.model.graphs)
    return tuple(engine.launched), sched.counters.preemptions, dict(sched.counters.finished), cursors


def test_frontend_identifiers_select_no_scheduling_cache_packing_or_completion(prepared):
    # spec: FE-47, FE-48, FE-49, FE-50
    manifest = prepared.manifest
    base = prepared.contract
    variants = _syntax_variant_contracts(base)
    assert len({(c.model.frontend.tool_parser, c.model.frontend.reasoning_parser) for c in variants}) == len(variants)
    reference = _decode(base, manifest)
    packed = _pack_everything(base, manifest)
    scheduled = _schedule_everything(base)
    assert len(scheduled[0]) > 10 and scheduled[1] > 0          # rounds and preemptions happened
    for contract in variants:
        decoded = _decode(contract, manifest)
        assert decoded.frontend != reference.frontend
        assert decoded.cache == reference.cache                  # FE-48: cache policy
        assert decoded.graphs == reference.graphs                # FE-49/50: bindings, cursors, state
        assert _pack_everything(contract, manifest) == packed    # FE-49: text-graph input packing
        assert _schedule_everything(contract) == scheduled       # FE-47/50: rounds, preemption, finishes
    # and no scheduling, cache, packing or completion module reads a frontend field
    modules = _sources("helios_backend/scheduler", "helios_backend/executors")
    for single in ("helios_backend/packing.py", "helios_backend/engine/model.py", "helios_backend/engine/runner.py",
                   "helios_backend/engine/loop.py"):
        modules[single] = ast.parse((ROOT / single).read_text(), single)
    for path, module in modules.items():
        for node in ast.walk(module):
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("frontend", "tool_parser", "reasoning_parser", "image_layout",
                                         "image_preparation", "tool_syntax", "reasoning_syntax"), (path, node.lineno)


def test_contract_fields_carry_no_model_identity():
    # spec: FE-52
    identity_words = ("family", "architecture", "model_type", "model_name", "arch", "vendor", "quirk", "legacy",
                      "hack", "compat_mode")

    def walk(descriptor, seen: set[str]) -> list[str]:
        names = []
        if descriptor.full_name in seen:
            return names
        seen.add(descriptor.full_name)
        for field in descriptor.fields:
            names.append(f"{descriptor.name}.{field.name}")
            if field.message_type is not None:
                names += walk(field.message_type, seen)
        return names

    fields = walk(C.ModelContract.DESCRIPTOR, set())
    assert len(fields) > 50
    for name in fields:
        assert not any(w in name.split(".")[-1] for w in identity_words), name
    # the only identity strings of a contract (served id, aliases, cache label) sit outside the
    # ModelContract, and renaming them changes no serving decision (test above)
    assert "served_id" not in {n.split(".")[-1] for n in fields}
    # every enum value of the ModelContract subtree names a mechanism, never a model
    identities = _identity_strings()
    for enum in C.DESCRIPTOR.enum_types_by_name.values():
        for value in enum.values:
            lowered = value.name.lower()
            generic = ("qwen_coder_function_tags", "glm_argument_tags")   # syntax names (FE-3, FE-4)
            stripped = lowered
            for g in generic:
                stripped = stripped.replace(g, "")
            assert not any(i.replace("-", "_") in stripped for i in identities), value.name


# ---- SRV-2, SRV-4, SRV-8, SRV-11, SRV-14 ----------------------------------------------------

def test_cache_identity_is_held_and_keys_the_prefix_cache(prepared):
    # spec: SRV-2
    from helios_backend.scheduler.prefix_hash import chain_keys, chain_seed

    decoded = _decode(prepared.contract, prepared.manifest)
    identity = prepared.contract.cache_identity
    assert identity.label and len(identity.fingerprint) == 32
    assert decoded.cache_identity.label == identity.label and decoded.cache_identity.fingerprint == identity.fingerprint
    tokens = list(range(64))
    same = chain_keys(chain_seed(identity.fingerprint), tokens, 16, 4)
    other = chain_keys(chain_seed(bytes(32)), tokens, 16, 4)
    assert same == chain_keys(chain_seed(identity.fingerprint), tokens, 16, 4)
    assert not set(same) & set(other)          # another identity never matches these pages


def test_prepared_page_and_snapshot_capacities_are_held(prepared):
    # spec: SRV-4
    decoded = _decode(sample_contract(3), sample_manifest(3), SAMPLE_RESOURCE_IDS)
    assert (decoded.extents.prepared_pages, decoded.extents.prepared_snapshots) == (32, 4)
    assert prepared.contract.prepared_pages == 96          # engine_test_options(prepared_pages=96)
    from helios_backend.executors.factory import ModelOptions, host_pages
    assert host_pages(prepared.contract, ModelOptions()) == 96   # preparation's count, until load replaces it
    snapshots = prepared_in_memory(snapshot_rows=2).contract
    assert snapshots.prepared_snapshots == 2


def _startup(**options: object):
    from helios_backend.engine.settings import StartupOptions, resolve

    return resolve(StartupOptions(pathlib.Path("/x.core"), **options), sample_contract(3))  # type: ignore[arg-type]


def test_speculative_width_may_be_reduced_never_raised():
    # spec: SRV-8
    from helios_backend.engine.settings import SettingsError

    assert sample_contract(3).speculative_widths == [4]
    assert _startup().speculative_width == 4
    assert _startup(speculative_width=2).speculative_width == 2
    assert _startup(speculative_width=1).speculative_width == 1
    with pytest.raises(SettingsError) as info:
        _startup(speculative_width=5)
    assert info.value.option == "speculative_width"


def test_history_drafting_is_a_startup_option_that_export_never_records(prepared):
    # spec: SRV-11, SRV-14
    from helios_backend.engine.settings import StartupOptions

    assert "history_drafting" in {f.name for f in dataclasses.fields(StartupOptions)}
    assert StartupOptions.from_parameters({"history_drafting": "true"}, ROOT).history_drafting is True
    assert _startup().history_drafting is False                      # off unless the operator asks
    assert _startup(history_drafting=True).history_drafting is True

    def fields(descriptor, seen: set[str]) -> list[str]:
        if descriptor.full_name in seen:
            return []
        seen.add(descriptor.full_name)
        out = []
        for field in descriptor.fields:
            out.append(field.name)
            if field.message_type is not None:
                out += fields(field.message_type, seen)
        return out

    from helios_proto import core_pb2
    names = fields(C.ServingContract.DESCRIPTOR, set())
    for message in core_pb2.DESCRIPTOR.message_types_by_name.values():
        names += fields(message, set())
    assert not [n for n in names if "history" in n], "the schema has no history-drafting preference"
    exported = prepared.contract.SerializeToString()
    assert b"history" not in exported


# ---- CON-4, CON-9 ------------------------------------------------------------------------

def test_input_vocabulary_covers_declared_nonsampled_sentinels():
    # spec: CON-4
    decoded = _decode(sample_contract(3), sample_manifest(3), SAMPLE_RESOURCE_IDS)
    vocab = decoded.vocabulary
    assert (vocab.sampled_tokens, vocab.input_tokens, vocab.image_sentinels) == (100, 101, frozenset({100}))
    assert vocab.is_input(100) and not vocab.is_sampled(100) and not vocab.is_input(101)
    for bad in (99, 101):                      # inside the sampled range, or outside the input range
        contract = sample_contract(3)
        contract.model.input_vocabulary.image_sentinels[0] = bad
        with pytest.raises(ContractError) as info:
            _decode(contract, sample_manifest(3), SAMPLE_RESOURCE_IDS)
        assert info.value.field == "model.input_vocabulary.image_sentinels[0]"
    contract = sample_contract(3)
    contract.model.input_vocabulary.input_tokens = 99
    with pytest.raises(ContractError):
        _decode(contract, sample_manifest(3), SAMPLE_RESOURCE_IDS)
    # the scheduler admits ids of the input range (sentinels included), nothing beyond it
    from helios_backend.scheduler.errors import InvalidSpecError
    from helios_backend.scheduler.request import RequestSpec, SamplingSettings
    from helios_backend.scheduler.scheduler import Scheduler, SchedulerConfig
    from tests.scheduler_sim import variants

    cfg = SchedulerConfig(page_tokens=4, num_pages=8, request_slots=2, max_active=2, queue_capacity=4,
                          context_tokens=32, max_pages_per_row=8, vocab_size=vocab.sampled_tokens,
                          input_vocab_size=vocab.input_tokens, eos_ids=())
    sched = Scheduler(cfg, VariantTable(variants()))
    sched.add(0, RequestSpec((1, 100, 3), 2, SamplingSettings()))
    with pytest.raises(InvalidSpecError):
        sched.add(1, RequestSpec((1, 101, 3), 2, SamplingSettings()))


def test_frontend_selectors_are_independent_with_their_own_data():
    # spec: CON-9
    decoded = _decode(sample_contract(2), sample_manifest(2), SAMPLE_RESOURCE_IDS).frontend
    assert (decoded.tool_parser, decoded.reasoning_parser, decoded.image_preparation, decoded.image_layout) == (
        C.TOOL_PARSER_QWEN_CODER_FUNCTION_TAGS, C.REASONING_PARSER_THINK_TAGS, C.IMAGE_PREPARATION_RESIZE_NORMALIZE,
        C.IMAGE_LAYOUT_FIXED_SPAN)
    assert decoded.tool_syntax.block_open == "<tool_call>" and decoded.reasoning_syntax.open == "<think>"
    # image selectors change without touching the parsers, and the reverse
    contract = sample_contract(2)
    fe = contract.model.frontend
    fe.image_preparation, fe.image_layout = C.IMAGE_PREPARATION_NONE, C.IMAGE_LAYOUT_NONE
    fe.ClearField("image_layout_data")
    fe.ClearField("image_preparation_settings")
    contract.model.ClearField("vision")
    del contract.model.input_vocabulary.image_sentinels[:]
    del contract.model.graphs[0].bindings[-1]          # the image tensor binding
    other = _decode(contract, sample_manifest(2), SAMPLE_RESOURCE_IDS).frontend
    assert (other.tool_parser, other.reasoning_parser) == (decoded.tool_parser, decoded.reasoning_parser)
    assert other.tool_syntax == decoded.tool_syntax and other.reasoning_syntax == decoded.reasoning_syntax
    contract = sample_contract(2)
    contract.model.frontend.image_layout = C.IMAGE_LAYOUT_UNSPECIFIED
    with pytest.raises(ContractError) as info:
        _decode(contract, sample_manifest(2), SAMPLE_RESOURCE_IDS)
    assert "image_layout" in info.value.field


# ---- STA-11, STA-12 -----------------------------------------------------------------------

def test_state_rows_per_request_is_storage_not_a_capability(prepared):
    # spec: STA-11
    # a storage requirement: the sample's pending buffer holds two rows per request
    for graph_rows, ok in ((1, True), (2, True), (3, False)):
        contract = sample_contract(3)
        contract.model.graphs[1].state_rows_per_request = graph_rows
        if ok:
            decoded = _decode(contract, sample_manifest(3), SAMPLE_RESOURCE_IDS)
            assert decoded.state_rows_per_request() == 2        # the maximum among the graphs (STA-10)
        else:
            with pytest.raises(ContractError) as info:
                _decode(contract, sample_manifest(3), SAMPLE_RESOURCE_IDS)
            assert "state_accesses" in info.value.field
    # it selects no behaviour: packing and scheduling are identical whatever it says
    changed = C.ServingContract()
    changed.CopyFrom(prepared.contract)
    for graph in changed.model.graphs:
        graph.state_rows_per_request = 4
    assert _pack_everything(changed, prepared.manifest) == _pack_everything(prepared.contract, prepared.manifest)
    assert _schedule_everything(changed) == _schedule_everything(prepared.contract)
    readers = [path for path, module in _sources("helios_backend", "gateway").items()
               if any(isinstance(n, ast.Attribute) and n.attr == "state_rows_per_request" for n in ast.walk(module))]
    assert set(readers) <= {"helios_backend/contract/prepared.py", "helios_backend/contract/checks_graphs.py"}, readers


def test_state_is_updated_by_captured_programs_only(smollm2_model):
    # spec: STA-12
    model = smollm2_model
    state = [b.name for b in model.execution_manifest.buffers if b.kind == M.BUFFER_KIND_STATE]
    snapshot = lambda: {name: model.executor.read_buffer(name) for name in state}  # noqa: E731
    before = snapshot()
    init = model.program(C.OPERATION_INITIALIZATION, 1)
    bins = model.contract.model.vocabulary.histogram_bins
    lane = PackedLane(slot=2, generation=77,
                initialization=SlotInitialization.for_prompt([1, 9690, 253, 28], bins, 0, SamplingParameters(), 3, (49151,)))
    model.packer.pack(init, 0, [lane])
    assert all(np.array_equal(before[n], b) for n, b in snapshot().items())   # host packing: no state change
    model.submissions.take()                               # a submission of the model's executor
    model.executor.launch(init, 0)
    model.executor.wait(0)
    after = snapshot()
    changed = {n for n in state if not np.array_equal(before[n], after[n])}
    graph = next(g for g in model.graphs if g.program == init)
    declared = {a.view.buffer for a in graph.state_accesses if a.access in (C.ACCESS_WRITE, C.ACCESS_READ_WRITE)}
    assert changed and changed <= declared                 # the program wrote only what it declares
    # the serving host code never writes device state: no arena or buffer access outside executors
    for path, module in _sources("helios_backend/scheduler", "helios_backend/engine", "helios_backend/triton").items():
        for node in ast.walk(module):
            if isinstance(node, ast.Attribute):
                assert node.attr not in ("arena", "buffer_view", "read_buffer"), (path, node.lineno)


# ---- CACHE-2, CACHE-6, CACHE-8 ---------------------------------------------------------------

@pytest.mark.parametrize("kind, fields", [
    (C.HISTORY_KIND_PAGED_KV, dict(planes=True, tokens_per_record=1)),
    (C.HISTORY_KIND_PAGED_LATENT, dict(planes=True, tokens_per_record=4)),
    (C.HISTORY_KIND_SLIDING_WINDOW, dict(planes=True, tokens_per_record=1, window_tokens=128)),
    (C.HISTORY_KIND_RECURRENT, dict(bytes_per_row=4096)),
    (C.HISTORY_KIND_CONTINUATION, dict(bytes_per_row=4096)),
])
def test_each_history_kind_decodes_with_its_own_fields(kind, fields):
    # spec: CACHE-2
    def region(**extra: object) -> C.HistoryRegion:
        r = C.HistoryRegion(name="extra", kind=kind)
        if extra.pop("planes", False):
            r.planes.add(buffer="kv", bytes_per_page=2048)
        for key, value in extra.items():
            setattr(r, key, value)
        return r

    contract = sample_contract(3)
    contract.model.cache.regions.append(region(**fields))
    decoded = _decode(contract, sample_manifest(3), SAMPLE_RESOURCE_IDS)
    assert decoded.cache.regions[-1].kind == kind
    # a field of another kind is refused (no meaning smuggled into unused fields)
    foreign = "bytes_per_row" if "planes" in fields else "window_tokens"
    contract = sample_contract(3)
    contract.model.cache.regions.append(region(**fields, **{foreign: 7}))
    with pytest.raises(ContractError) as info:
        _decode(contract, sample_manifest(3), SAMPLE_RESOURCE_IDS)
    assert info.value.field == f"model.cache.regions[1].{foreign}"


@pytest.mark.parametrize("kind", [C.HISTORY_KIND_UNSPECIFIED, 42])
def test_a_region_of_no_declared_kind_is_rejected(kind):
    # spec: CACHE-2
    contract = sample_contract(3)
    contract.model.cache.regions.add(name="odd", kind=kind, bytes_per_row=64)
    with pytest.raises(ContractError):
        _decode(contract, sample_manifest(3), SAMPLE_RESOURCE_IDS)


def test_shifted_page_table_view_is_a_declared_offset(prepared):
    # spec: CACHE-8
    contract = sample_contract(3)
    contract.model.cache.page_table_views.add(destination="page_table_entries", page_offset=1, pages_per_row=4)
    views = _decode(contract, sample_manifest(3), SAMPLE_RESOURCE_IDS).cache.page_table_views
    assert [(v.destination, v.page_offset) for v in views] == [("page_table_entries", 0), ("page_table_entries", 1)]
    contract.model.cache.page_table_views[1].page_offset = -1
    with pytest.raises(ContractError) as info:
        _decode(contract, sample_manifest(3), SAMPLE_RESOURCE_IDS)
    assert info.value.field == "model.cache.page_table_views[1].page_offset"
    # the view carries no family selector: its fields are geometry only
    assert [f.name for f in C.PageTableView.DESCRIPTOR.fields] == ["destination", "page_offset", "pages_per_row"]
    assert [(v.destination, v.page_offset) for v in prepared.contract.model.cache.page_table_views] == [("page_table", 0)]


def test_continuation_rows_hold_the_partial_page_computed_by_the_program():
    # spec: CACHE-6
    from helios_backend.engine.model import ModelOptions, NativeModel
    from helios_backend.lockstep.generator import GenerationRequest
    from helios_backend.lockstep.raw_lanes import RawLanes
    from tests.engine_fixtures import resource_reader

    prepared = prepared_in_memory(snapshot_rows=2)
    cache = prepared.contract.model.cache
    continuation = [r for r in cache.regions if r.kind == C.HISTORY_KIND_CONTINUATION]
    assert len(continuation) == 1
    buffers = {b.name: b for b in prepared.manifest.buffers}
    page_bytes = {p.buffer: p.bytes_per_page for r in cache.regions for p in r.planes}
    assert continuation[0].bytes_per_row == sum(page_bytes.values())
    model = NativeModel.load(prepared.contract, prepared.manifest, resource_reader(prepared),
                             ModelOptions(cache_pages=12, concurrency=2))
    try:
        pt = cache.page_tokens
        prompt = [1, 9690, 253, 28] * 6                                    # 24 tokens: 8 on the second page
        driver = RawLanes(model, page_order=[5, 7, 9, 10])
        [active] = driver.admit([GenerationRequest(prompt, 2, eos_ids=(49151,))], [0])
        driver.ensure_pages(active, len(prompt))
        driver.step(model.program(C.OPERATION_PREFILL, 1, len(prompt)),
                    [PackedLane(slot=0, generation=active.generation, tokens=np.asarray(prompt, np.int32),
                          page_table=list(active.pages), snapshot_row=1)])
        partial = len(prompt) % pt
        for plane, row_name in (("cache.k", "continuation.k"), ("cache.v", "continuation.v")):
            layers = buffers[plane].shape[0]
            page = model.executor.read_buffer(plane).view(np.float16).reshape(-1, layers, pt,
                                                                            *buffers[plane].shape[2:])
            rows = model.executor.read_buffer(row_name).view(np.float16).reshape(buffers[row_name].shape)
            saved, source = rows[1][:, :partial], page[active.pages[1]][:, :partial]
            assert np.abs(source.astype(np.float32)).sum() > 0
            np.testing.assert_array_equal(saved, source)          # every layer's partial page, exactly
            assert not np.array_equal(rows[0][:, :partial], source)   # the other row was not written
    finally:
        model.close()
