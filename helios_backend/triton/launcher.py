"""Locating and starting tritonserver with the python backend for *this* environment.

Triton 2.51's python stub (pybind11 2.10, Python >= 3.11) runs an isolated interpreter:
PYTHONPATH is ignored, but CPython's getpath still finds `python3` on PATH and reads the
pyvenv.cfg beside it. So the server starts with the running environment's bin/ first on
PATH, and a backend directory holding libtriton_python.so, the utils module and the stub
built for the running Python (shared/notes/triton-backend.md, section 3).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

SYSTEM_TRITON = Path("/opt/tritonserver")
LOOPBACK = "127.0.0.1"   # tritonserver's ports carry no authentication: local unless asked otherwise


def _model_template() -> Path:
    """model_repository/helios: a package of its own, so a plain (non-editable) install
    ships it too; found without importing it (its directory only holds Triton files)."""
    spec = importlib.util.find_spec("model_repository")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the model_repository package is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "helios"


MODEL_TEMPLATE = _model_template()


class TritonNotFound(Exception):
    """Neither the nvidia-pytriton wheel nor /opt/tritonserver provides tritonserver."""


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    python_backend: Path                 # holds libtriton_python.so and triton_python_backend_utils.py
    stub: Path                           # triton_python_backend_stub for the running Python
    libraries: Path | None               # nvidia_pytriton.libs (the wheel's bundled libraries)


@dataclass(frozen=True)
class Ports:
    http: int = 8000
    grpc: int = 8001
    metrics: int = 8002


def _install_at(root: Path, version: str) -> TritonInstall:
    """The layout under a tritonserver root: the wheel's (stubs per Python version and
    bundled libraries beside the package) or NGC's (/opt/tritonserver, one stub)."""
    python = root / "backends" / "python"
    wheel_stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if wheel_stub.is_file():
        libs = root.parent.parent / "nvidia_pytriton.libs"
        return TritonInstall(root / "bin" / "tritonserver", python, wheel_stub, libs if libs.is_dir() else None)
    return TritonInstall(root / "bin" / "tritonserver", python, python / "triton_python_backend_stub", None)


def locate_tritonserver(binary: Path | None = None) -> TritonInstall:
    """`binary` when given (its root's python backend and stub); else the wheel's
    tritonserver first (it matches this Python), else /opt/tritonserver."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if binary is not None:
        install = _install_at(binary.resolve().parent.parent, version)
        if not (install.binary.is_file() and install.stub.is_file()):
            raise TritonNotFound(f"--tritonserver {binary}: no tritonserver with a python backend stub there "
                                 f"(looked for {install.binary} and {install.stub})")
        return install
    try:
        import pytriton
        install = _install_at(Path(pytriton.__file__).resolve().parent / "tritonserver", version)
        if install.binary.is_file() and install.stub.is_file():
            return install
    except ImportError:
        pass
    system = _install_at(SYSTEM_TRITON, version)
    if system.binary.is_file():
        return system
    raise TritonNotFound(f"no tritonserver: install nvidia-pytriton (stub for Python {version}) "
                         f"or provide {SYSTEM_TRITON}")


def prepare_backend_directory(install: TritonInstall, workdir: Path) -> Path:
    """<workdir>/backends/python with the backend library, utils and the matching stub."""
    target = workdir / "backends" / "python"
    target.mkdir(parents=True, exist_ok=True)
    for source in (install.python_backend / "libtriton_python.so",
                   install.python_backend / "triton_python_backend_utils.py", install.stub):
        link = target / source.name
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(source)
    return workdir / "backends"


def server_environment(install: TritonInstall, base: dict[str, str] | None = None,
                       python_bin: Path | None = None) -> dict[str, str]:
    """PATH with the Python environment's bin first (the stub finds its site-packages there;
    default: this process's environment), and the wheel's bundled libraries plus libpython's
    directory on LD_LIBRARY_PATH."""
    env = dict(os.environ if base is None else base)
    env["PATH"] = f"{python_bin or Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    libdirs = [str(p) for p in (install.libraries, sysconfig.get_config_var("LIBDIR")) if p]
    if env.get("LD_LIBRARY_PATH"):
        libdirs.append(env["LD_LIBRARY_PATH"])
    env["LD_LIBRARY_PATH"] = os.pathsep.join(libdirs)
    env.pop("PYTHONPATH", None)   # ignored by the stub anyway; keep the two processes alike
    return env


def server_command(install: TritonInstall, backends: Path, model_repository: Path, ports: Ports, *,
                   shm_prefix: str, exit_timeout_s: int = 30, log_verbose: int = 0,
                   address: str = LOOPBACK) -> list[str]:
    return [str(install.binary), f"--model-repository={model_repository}",
            f"--backend-directory={backends}",
            f"--http-address={address}", f"--grpc-address={address}", f"--metrics-address={address}",
            f"--http-port={ports.http}", f"--grpc-port={ports.grpc}", f"--metrics-port={ports.metrics}",
            "--allow-metrics=true", "--allow-gpu-metrics=false", "--metrics-interval-ms=500",
            # a model that fails to load stays not ready (its log line names the cause)
            # instead of taking the server down
            "--strict-readiness=true", "--exit-on-error=false", f"--exit-timeout-secs={exit_timeout_s}",
            f"--log-verbose={log_verbose}",
            f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
            "--backend-config=python,shm-default-byte-size=4194304",
            "--backend-config=python,shm-growth-byte-size=1048576"]


def cleanup_shm(shm_prefix: str) -> None:
    """A killed server leaves its python-backend shm regions behind; remove ours."""
    for path in Path("/dev/shm").glob(f"{shm_prefix}*"):
        try:
            path.unlink()
        except OSError:
            pass


def gateway_command() -> list[str] | None:
    """How helios-serve starts the gateway: this interpreter running gateway.cli as a module.
    Not the console script: its gateway worker processes are spawned, and a spawned process
    re-runs the parent's main file; a module keeps its `__main__` guard, a console script
    written without one would start a gateway again in every worker."""
    import importlib.util

    return [sys.executable, "-m", "gateway.cli"] if importlib.util.find_spec("gateway.cli") else None


def write_model_repository(target_root: Path, parameters: dict[str, str], template: Path = MODEL_TEMPLATE) -> Path:
    """A copy of model_repository/helios under target_root with some config parameters
    replaced (each must already be declared in config.pbtxt). Returns the repository."""
    repo = target_root / "model_repository"
    model = repo / template.name
    (model / "1").mkdir(parents=True, exist_ok=True)
    shutil.copy(template / "1" / "model.py", model / "1" / "model.py")
    config = (template / "config.pbtxt").read_text()
    for key, value in parameters.items():
        pattern = re.compile(r'(key: "%s" value: \{ string_value: )"[^"]*"' % re.escape(key))
        if not pattern.search(config):
            raise KeyError(f"config.pbtxt declares no parameter {key!r}")
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        config = pattern.sub(lambda m: f'{m.group(1)}"{escaped}"', config)
    (model / "config.pbtxt").write_text(config)
    return repo
