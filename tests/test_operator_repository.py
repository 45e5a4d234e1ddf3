"""`helios-serve --write-repository DIR` without starting anything: the helios model goes into a
repository that holds another model (left untouched), with the options given, the Python backend
for this environment beside it, and a script that starts tritonserver on both."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helios_backend.triton.launcher import locate_tritonserver
from tests.server_fixtures import default_core  # noqa: F401 - fixture


def test_write_repository_adds_the_model_beside_others_and_prints_the_start_script(
        default_core: Path, tmp_path: Path) -> None:  # noqa: F811
    models = tmp_path / "models"
    other = models / "other" / "config.pbtxt"
    other.parent.mkdir(parents=True)
    other.write_text('name: "other"\n')
    done = subprocess.run([sys.executable, "-m", "helios_backend.cli.serve", "--core", str(default_core),
                           "--executor", "cpu", "--concurrency", "4", "--write-repository", str(models)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert other.read_text() == 'name: "other"\n'
    config = (models / "helios" / "config.pbtxt").read_text()
    for key, value in (("core_path", str(default_core.resolve())), ("executor", "cpu"), ("concurrency", "4"),
                       ("acceptance", "helios.local/smollm2")):
        assert f'key: "{key}" value: {{ string_value: "{value}" }}' in config, key
    assert (models / "helios" / "1" / "model.py").is_file()
    backend = tmp_path / "backends" / "python"
    install = locate_tritonserver()
    assert (backend / "triton_python_backend_stub").resolve() == install.stub.resolve()
    assert (backend / "libtriton_python.so").exists()
    script = done.stdout
    assert script.startswith("#!/bin/sh\n")
    assert f"--model-repository={models}" in script and f"--backend-directory={tmp_path / 'backends'}" in script
    assert f'export PATH="{Path(sys.executable).parent}:' in script
    assert script.rstrip().endswith('"$@"')
    assert "workdir" not in done.stderr          # nothing served, nothing to report
