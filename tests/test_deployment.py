"""Deployment: the Docker image's command line serves a chat answer from the installed
package, a plain install ships the Triton model template, tritonserver's unauthenticated
ports stay on the loopback, and `EXECUTOR=cuda make` installs what the CUDA executor needs.

No Docker here: the image's ENTRYPOINT is read from docker/Dockerfile and run against a
non-editable install of this tree (a built wheel unpacked into a directory that comes first
on sys.path), with the tritonserver path it names replaced by this machine's.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from helios_backend.triton.launcher import locate_tritonserver
from tests.server_fixtures import default_core  # noqa: F401 - fixture
from tests.triton_server import free_ports

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE_FILES = ("model_repository/helios/config.pbtxt", "model_repository/helios/1/model.py")


def dockerfile_entrypoint() -> list[str]:
    text = (ROOT / "docker" / "Dockerfile").read_text()
    match = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", text, re.M)
    assert match, "docker/Dockerfile has no exec-form ENTRYPOINT"
    return json.loads(match.group(1))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This tree built as a wheel and unpacked (what `pip install .` puts in site-packages)."""
    work = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work), str(ROOT)],
                   check=True, capture_output=True, timeout=600)
    (wheel,) = work.glob("helios-*.whl")
    target = work / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(target)
    return target


def test_the_wheel_ships_the_model_template(installed: Path) -> None:
    for name in TEMPLATE_FILES:
        assert (installed / name).read_bytes() == (ROOT / name).read_bytes(), name


def test_make_installs_the_gpu_extra_for_the_cuda_executor() -> None:
    def install_command(*overrides: str) -> str:
        out = subprocess.run(["make", "-n", "-B", "install", *overrides], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        (line,) = [ln for ln in out.splitlines() if "pip install" in ln and " -e " in ln]
        return line

    assert "'.[serve,prepare,test,gpu]'" in install_command("EXECUTOR=cuda")
    assert "'.[serve,prepare,test]'" in install_command("EXECUTOR=numpy")
    assert "'.[serve,prepare,test]'" in install_command()


def test_make_serve_re_prepares_a_core_older_than_the_sampling_programs(tmp_path: Path) -> None:
    # spec: FMT-8
    # a core from before a new program input (sampling.logit_bias) still loads, but would refuse
    # what the new input serves: `make serve` prepares it again once preparation code changed
    core = tmp_path / "current.core"
    core.write_bytes(b"")
    future = time.time() + 3600                              # newer than every source
    os.utime(core, (future, future))

    def prepares(*extra: str) -> bool:
        # the install stamps count as old: only the preparation sources decide here
        out = subprocess.run(["make", "-n", f"CORE={core}", "-o", ".venv/.installed", "-o", "helios_proto/.generated",
                              *extra, "core"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return "helios-prepare" in out

    assert not prepares()
    for changed in ("ignition/preparation/contract.py", "helios_backend/kernel_abi/sampling.py",
                    "ignition/gpu_kernels/triton_lang/sampling.py", "proto/helios_proto/contract.proto"):
        assert prepares("-W", changed), changed


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) == port and fields[3] == "0A":   # LISTEN
                found.add(address)
    return found


@pytest.fixture(scope="module")
def image_command(installed: Path, default_core: Path, tmp_path_factory: pytest.TempPathFactory  # noqa: F811
                  ) -> Iterator[tuple[int, int, str]]:
    """The ENTRYPOINT with this machine's tritonserver, on the installed package; yields
    (gateway port, grpc port, API key) once the gateway is healthy."""
    entrypoint = dockerfile_entrypoint()
    assert entrypoint[0] == "helios-serve" and "--tritonserver" in entrypoint
    command = list(entrypoint)
    command[command.index("--tritonserver") + 1] = str(locate_tritonserver().binary)
    http, grpc, metrics, gateway = free_ports(4)
    key = "sk-deployment-test"
    work = tmp_path_factory.mktemp("image")
    log = open(work / "serve.log", "wb")
    script = ("import sys; sys.argv[0] = 'helios-serve'; "
              "from helios_backend.cli.serve import main; sys.exit(main())")
    process = subprocess.Popen(
        [sys.executable, "-c", script, *command[1:], "--core", str(default_core), "--workdir", str(work),
         "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
         "--gateway-port", str(gateway), "--host", "127.0.0.1"],
        cwd=work, env={**os.environ, "PYTHONPATH": str(installed), "HELIOS_API_KEY": key},
        stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{gateway}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        assert process.poll() is None, (work / "serve.log").read_text()[-4000:]
        yield gateway, grpc, key
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@pytest.mark.triton
@pytest.mark.slow
def test_the_image_command_line_serves_a_chat_answer(image_command: tuple[int, int, str], installed: Path) -> None:
    gateway, grpc, key = image_command
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key=key, max_retries=0)
    answer = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=8, temperature=0,
                                            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert answer.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):  # HELIOS_API_KEY reached the gateway
        openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="wrong", max_retries=0).models.list()


@pytest.mark.triton
@pytest.mark.slow
def test_tritonserver_listens_on_the_loopback_only(image_command: tuple[int, int, str]) -> None:
    _, grpc, _ = image_command
    addresses = _listening_addresses(grpc)
    # /proc's little-endian hex of 127.0.0.1, ::ffff:127.0.0.1 and ::1; never 0.0.0.0 or ::
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    assert addresses and addresses <= loopback, addresses
