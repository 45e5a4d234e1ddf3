"""The container files as a builder would read them, without a builder (none runs here): the
build context docker/Dockerfile sees (.dockerignore applied) leaves out what must stay out and
holds every COPY source; the image's ENTRYPOINT and CMD, the compose services' command lines
and the Kubernetes example of docs/deployment.md parse with the commands' own parsers; the
compose files mount the folder `make core` writes; the probes they name are the gateway's.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from gateway.routers.health import LIVENESS_PATH, READINESS_PATHS
from helios_backend.cli.serve import parser as serve_parser
from ignition.cli import _parser as prepare_parser

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE_FILES = ("compose.cpu.yml", "compose.gpu.yml")
# what `make serve` leaves in the tree and must never reach the builder
MUST_STAY_OUT = (".venv", "var", ".git", "helios_proto", "build", "helios.egg-info", "gateway/__pycache__",
                 ".pytest_cache", ".mypy_cache", "var/cores/smollm2-135m-instruct.core")


def _ignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for a context path: a pattern matches the path or one of its parent
    folders (`**` any number of folders; no `!` exceptions are used here)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for pattern in patterns:
        assert not pattern.startswith("!"), "exceptions are not modelled here"
        forms = {pattern, pattern.removeprefix("**/")} if pattern.startswith("**/") else {pattern}
        for prefix in prefixes:
            candidates = [prefix] + (["/".join(prefix.split("/")[i:]) for i in range(1, prefix.count("/") + 1)]
                                     if pattern.startswith("**/") else [])
            if any(fnmatch.fnmatchcase(c, f) for c in candidates for f in forms):
                return True
    return False


def context_files() -> set[str]:
    """Every file of the build context, as the builder would send it."""
    patterns = _ignore_patterns()
    found = set()
    for folder, dirs, files in os.walk(ROOT):
        rel = os.path.relpath(folder, ROOT)
        rel = "" if rel == "." else rel + "/"
        dirs[:] = [d for d in dirs if not ignored(rel + d, patterns)]
        found |= {rel + f for f in files if not ignored(rel + f, patterns)}
    return found


def test_the_build_context_leaves_out_local_and_built_files() -> None:
    patterns = _ignore_patterns()
    for path in MUST_STAY_OUT:
        assert ignored(path, patterns), path
        assert ignored(path + "/anything.py", patterns), path
    files = context_files()
    assert not any(f.startswith((".venv/", "var/", ".git/")) or "__pycache__" in f for f in files)
    assert "docker/Dockerfile" in files and "pyproject.toml" in files


def test_every_copy_source_is_in_the_build_context() -> None:
    files = context_files()
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        match = re.match(r"^COPY\s+(.+)\s+\S+$", line)
        if match:
            sources += match.group(1).split()
    assert {"pyproject.toml", "helios_backend", "gateway", "ignition", "model_repository", "proto"} <= set(sources)
    for source in sources:
        assert source in files or any(f.startswith(source + "/") for f in files), f"COPY {source}: not in the context"
    # the image generates the bindings itself (helios_proto is left out of the context)
    assert "tools/gen_proto.py" in files and any(f.startswith("proto/") and f.endswith(".proto") for f in files)


def _exec_form(instruction: str) -> list[str]:
    match = re.search(rf"^{instruction}\s+(\[.*\])\s*$", DOCKERFILE.read_text(), re.M)
    assert match, f"docker/Dockerfile has no exec-form {instruction}"
    return list(json.loads(match.group(1)))


def test_the_image_entrypoint_and_command_parse_with_helios_serve() -> None:
    entrypoint, command = _exec_form("ENTRYPOINT"), _exec_form("CMD")
    assert entrypoint[0] == "helios-serve"
    args = serve_parser().parse_args(entrypoint[1:] + command)
    assert str(args.tritonserver) == "/opt/tritonserver/bin/tritonserver"
    assert args.executor == "auto"                       # one image: the executor is chosen at start
    # the image can prepare too: the prepare extra is installed
    assert re.search(r"pip install '\.\[[^\]]*prepare[^\]]*\]'", DOCKERFILE.read_text())


def _compose(name: str) -> dict[str, Any]:
    """A compose file with its services' `extends` resolved (one level, as used here)."""
    spec = yaml.safe_load((ROOT / "docker" / name).read_text())
    for service in spec["services"].values():
        extends = service.pop("extends", None)
        if extends:
            base = yaml.safe_load((ROOT / "docker" / extends["file"]).read_text())["services"][extends["service"]]
            service.update({k: v for k, v in base.items() if k not in service})
    return dict(spec)


@pytest.mark.parametrize("name", COMPOSE_FILES)
def test_compose_files_serve_and_prepare_on_the_make_core_folder(name: str) -> None:
    services = _compose(name)["services"]
    serve, prepare = services["helios"], services["prepare"]
    entrypoint = _exec_form("ENTRYPOINT")
    args = serve_parser().parse_args(entrypoint[1:] + serve["command"])
    assert args.executor == ("cuda" if "gpu" in name else "cpu")
    core_mount = next(v for v in serve["volumes"] if v.split(":")[1] == "/cores")
    assert (ROOT / "docker" / core_mount.split(":")[0]).resolve() == ROOT / "var" / "cores"   # `make core`'s folder
    assert str(args.core).startswith("/cores/")
    assert prepare["entrypoint"] == ["helios-prepare"]
    prepared = prepare_parser().parse_args(prepare["command"])
    assert str(prepared.out) == str(args.core)             # prepare writes what serve reads
    assert any(v.split(":")[0] == core_mount.split(":")[0] for v in prepare["volumes"])
    assert any(path in " ".join(serve["healthcheck"]["test"]) for path in READINESS_PATHS)


def _kubernetes_documents() -> list[dict[str, Any]]:
    text = (ROOT / "docs" / "deployment.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.S)
    return [doc for block in blocks for doc in yaml.safe_load_all(block) if isinstance(doc, dict) and "kind" in doc]


def test_the_kubernetes_example_probes_the_gateway_and_mounts_the_cores() -> None:
    documents = {doc["kind"]: doc for doc in _kubernetes_documents()}
    assert {"Deployment", "Service"} <= set(documents)
    pod = documents["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = serve_parser().parse_args(_exec_form("ENTRYPOINT")[1:] + container["args"])
    assert container["livenessProbe"]["httpGet"]["path"] == LIVENESS_PATH
    assert container["readinessProbe"]["httpGet"]["path"] in READINESS_PATHS
    port = container["ports"][0]["containerPort"]
    assert port == args.gateway_port
    assert container["livenessProbe"]["httpGet"]["port"] == container["readinessProbe"]["httpGet"]["port"] == port
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"] for v in pod["volumes"]}
    assert any(str(args.core).startswith(path + "/") and name in volumes for name, path in mounts.items())
    service = documents["Service"]["spec"]
    assert service["selector"].items() <= documents["Deployment"]["spec"]["template"]["metadata"]["labels"].items()
    assert service["ports"][0]["targetPort"] in (port, container["ports"][0].get("name"))


def _builder() -> str | None:
    """A container builder whose daemon answers (docker or podman), else None."""
    import shutil
    import subprocess

    for tool in ("docker", "podman"):
        if shutil.which(tool):
            try:
                if subprocess.run([tool, "info"], capture_output=True, timeout=20).returncode == 0:
                    return tool
            except subprocess.TimeoutExpired:
                pass
    return None


@pytest.mark.slow
def test_the_image_builds_where_a_builder_runs() -> None:
    import subprocess

    tool = _builder()
    if tool is None:
        pytest.skip("no container builder with a running daemon here (the checks above stand in)")
    built = subprocess.run([tool, "build", "-f", "docker/Dockerfile", "-t", "helios:test", "."], cwd=ROOT,
                           capture_output=True, text=True, timeout=3600)
    assert built.returncode == 0, built.stderr[-4000:]
    shown = subprocess.run([tool, "run", "--rm", "--entrypoint", "helios-prepare", "helios:test", "--help"],
                           capture_output=True, text=True, timeout=600)
    assert shown.returncode == 0 and "--out" in shown.stdout
