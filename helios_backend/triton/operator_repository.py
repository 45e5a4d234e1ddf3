"""The helios model for a tritonserver the operator runs: `helios-serve --write-repository DIR`.

Triton is often run once per host with several models in one repository. This writes the
helios model directory into such a repository (DIR/helios: config.pbtxt with core_path,
acceptance, executor and the other startup options, and 1/model.py; every other model in DIR
is left alone), lays out the Python backend for this environment beside it (DIR/../backends/
python: the backend library, its utils and the stub built for the running Python, which the
nvidia-pytriton wheel keeps per Python version where tritonserver does not look), and returns
the shell lines that start tritonserver on it: the environment's bin/ first on PATH, so the
stub's isolated interpreter finds this environment's site-packages, and the wheel's bundled
libraries on LD_LIBRARY_PATH (launcher.server_environment, the same as helios-serve uses).
"""
from __future__ import annotations

import shlex
import shutil
import tempfile
from pathlib import Path

from helios_backend.triton.launcher import (
    MODEL_TEMPLATE, TritonInstall, prepare_backend_directory, server_environment, write_model_repository)

# the Python backend's shared memory as helios-serve sizes it (launcher.server_command)
BACKEND_CONFIG = ("--backend-config=python,shm-default-byte-size=4194304",
                  "--backend-config=python,shm-growth-byte-size=1048576")


def write_model(repository: Path, parameters: dict[str, str]) -> Path:
    """repository/helios from the packaged template with these config parameters (the
    launcher's own rendering); returns the model directory."""
    target = repository / MODEL_TEMPLATE.name
    with tempfile.TemporaryDirectory(prefix="helios-model-") as staging:
        written = write_model_repository(Path(staging), parameters) / MODEL_TEMPLATE.name
        repository.mkdir(parents=True, exist_ok=True)
        shutil.copytree(written, target, dirs_exist_ok=True)
    return target


def write_operator_layout(repository: Path, install: TritonInstall, parameters: dict[str, str]) -> str:
    """Write the model and the backend directory; return a shell script that starts
    `install`'s tritonserver on `repository` (ports and other flags are the operator's)."""
    repository = repository.resolve()
    write_model(repository, parameters)
    backends = prepare_backend_directory(install, repository.parent)
    env = server_environment(install, base={"PATH": "${PATH}", "LD_LIBRARY_PATH": "${LD_LIBRARY_PATH}"})
    command = [str(install.binary), f"--model-repository={repository}", f"--backend-directory={backends}",
               *BACKEND_CONFIG]
    return "\n".join([
        "#!/bin/sh",
        f"# tritonserver with the helios model of {repository} (helios-serve --write-repository)",
        f'export PATH="{env["PATH"]}"',
        f'export LD_LIBRARY_PATH="{env["LD_LIBRARY_PATH"]}"',
        'exec ' + " ".join(shlex.quote(part) for part in command) + ' "$@"',
    ]) + "\n"
