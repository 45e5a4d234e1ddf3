"""Session fixtures for the syntax-variant test cores (issue #6 item 5).

`variant_cores` derives one core per syntax pairing of ignition/recipes/syntax_variants.py from
the already-prepared SmolLM2 test core (`smollm2_core`) with ignition/variants.py: same
resources byte for byte, the variant's frontend syntax data, served id `<base>+<suffix>`, newly
signed in the same namespace. Deriving is a verify plus a copy (seconds), not a preparation.

Helpers to serve them: `variant_stack(cores, workdir)` starts ONE tritonserver whose model
repository holds one model directory per variant (`helios_<suffix>`, each with its own
core_path), and one gateway process per variant pointed at its model. Each gateway
process names its Triton model with `helios-gateway --triton-model`.
"""
from __future__ import annotations

import contextlib
import pathlib
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import pytest

from tests.gateway_harness import GatewayProcess
from tests.triton_server import TritonServer, free_ports, metric_value, model_repository

_ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def variant_cores(smollm2_core: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """suffix -> derived core path, for every declared syntax variant."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from ignition.recipes.syntax_variants import VARIANTS, recipe_name, variant_frontend
    from ignition.variants import derive_variant_core

    directory = tmp_path_factory.mktemp("variant-cores")
    key = Ed25519PrivateKey.generate()
    return {v.suffix: derive_variant_core(smollm2_core, directory / f"{v.suffix}.core", variant_frontend(v), key,
                                          served_id=recipe_name(v))
            for v in VARIANTS}


def model_name(suffix: str) -> str:
    return "helios_" + re.sub(r"[^A-Za-z0-9_]", "_", suffix)


def variant_repository(workdir: pathlib.Path, cores: Mapping[str, pathlib.Path], **parameters: str) -> pathlib.Path:
    """One Triton model repository with a `helios_<suffix>` model per core (the helios template,
    renamed, with that core's core_path)."""
    repo = workdir / "model_repository"
    repo.mkdir(parents=True, exist_ok=True)
    for suffix, core in cores.items():
        single = model_repository(workdir / f"single-{suffix}", core_path=str(core), **parameters)
        target = repo / model_name(suffix)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(str(single / "helios"), target)
        config = target / "config.pbtxt"
        text, count = re.subn(r'^name: "helios"$', f'name: "{model_name(suffix)}"', config.read_text(), flags=re.M)
        assert count == 1, "config.pbtxt template changed: no `name: \"helios\"` line"
        config.write_text(text)
    return repo




class VariantGateway(GatewayProcess):
    """`helios-gateway` speaking to one named Triton model."""

    def __init__(self, triton_url: str, model: str, log_path: pathlib.Path) -> None:  # noqa: D107
        self.port = free_ports(1)[0]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "--triton-model", model, "--triton", triton_url, "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning"],
            stdout=self._log, stderr=subprocess.STDOUT, cwd=_ROOT)


@dataclass
class VariantStack:
    server: TritonServer
    gateways: dict[str, VariantGateway]   # suffix -> its gateway

    def backend_metric(self, suffix: str, name: str, **labels: str) -> float:
        return metric_value(self.server.metrics(), name, model=model_name(suffix), **labels)


@contextlib.contextmanager
def variant_stack(cores: Mapping[str, pathlib.Path], workdir: pathlib.Path, **parameters: str) -> Iterator[VariantStack]:
    """One tritonserver serving every core, one gateway per core; both always stopped."""
    repo = variant_repository(workdir, cores, **parameters)
    with TritonServer(repo, workdir) as server:
        for suffix in cores:
            server.wait_ready(model_name(suffix))
        gateways: dict[str, VariantGateway] = {}
        try:
            for suffix in cores:
                gateways[suffix] = VariantGateway(server.grpc_url, model_name(suffix),
                                                  workdir / f"gateway-{model_name(suffix)}.log")
            for gateway in gateways.values():
                gateway.wait_healthy()
            yield VariantStack(server, gateways)
        finally:
            for gateway in gateways.values():
                gateway.stop()
