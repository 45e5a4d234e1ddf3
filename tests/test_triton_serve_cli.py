"""helios-serve: starts tritonserver on a core, serves, and drains on SIGINT."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests import helios_client as hc
from tests.server_fixtures import default_core  # noqa: F401 - fixture
from tests.triton_server import free_ports

pytestmark = pytest.mark.triton


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/models/helios/ready", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_helios_serve_runs_and_drains(default_core: Path, tmp_path: Path) -> None:  # noqa: F811 # spec: OWN-13
    serve = Path(sys.executable).parent / "helios-serve"
    for _attempt in range(3):      # a port released by free_ports() may be taken by another process
        http, grpc, metrics = free_ports(3)
        log = open(tmp_path / "serve.log", "wb")
        proc = subprocess.Popen([str(serve), "--core", str(default_core), "--no-gateway", "--workdir",
                                 str(tmp_path), "--http-port", str(http), "--grpc-port", str(grpc),
                                 "--metrics-port", str(metrics), "--max-active", "4"],
                                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not _ready(http) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.3)
        if proc.poll() is None or "already in use" not in (tmp_path / "serve.log").read_text():
            break
        log.close()
    try:
        assert _ready(http), (tmp_path / "serve.log").read_text()[-3000:]
        assets = hc.run(hc.assets(f"127.0.0.1:{grpc}"))
        assert assets.limits.max_active == 4                # the explicit option beat the core default
        result = hc.run(hc.generate(f"127.0.0.1:{grpc}", [1, 2, 3, 4], hc.greedy(3)))
        assert result.outcome == "finished"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0, (tmp_path / "serve.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    assert not _ready(http)


def _bare_script(tmp_path: Path) -> Path:
    """helios-serve as a console script without a __main__ guard (as some installers write them):
    the gateway's spawned worker processes must not start gateways again."""
    script = tmp_path / "helios-serve-bare"
    script.write_text(f"#!{sys.executable}\nimport sys\nfrom helios_backend.cli.serve import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("workers", [1, 2])
def test_helios_serve_starts_the_gateway_once_the_model_is_ready(default_core: Path, tmp_path: Path,  # noqa: F811
                                                                 workers: int) -> None:
    http, grpc, metrics, gateway = free_ports(4)
    serve = Path(sys.executable).parent / "helios-serve" if workers == 1 else _bare_script(tmp_path)
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([str(serve), "--core", str(default_core), "--workdir", str(tmp_path),
                             "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
                             "--gateway-port", str(gateway), "--gateway-workers", str(workers)],
                            stdout=log, stderr=subprocess.STDOUT)
    models = None
    try:
        deadline = time.monotonic() + 300
        while models is None and proc.poll() is None and time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{gateway}/v1/models", timeout=2) as r:
                    models = r.read().decode()
            except OSError:
                time.sleep(0.5)
        assert models is not None, (tmp_path / "serve.log").read_text()[-3000:]
        assert "smollm2-135m-instruct" in models            # learned from the served model's assets
        assert (tmp_path / "serve.log").read_text().count("Started server process") == workers
        proc.send_signal(signal.SIGINT)
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_gateway_workers_default_to_several_only_for_the_cuda_executor() -> None:  # spec: HTTP-3
    from helios_backend.cli.serve import MAX_AUTO_GATEWAY_WORKERS, resolve_gateway_workers

    # one process streams about one core's worth of tokens: the cuda executor outruns it
    assert resolve_gateway_workers(None, "cuda", 16) == MAX_AUTO_GATEWAY_WORKERS
    assert resolve_gateway_workers(None, "cuda", 6) == 3
    assert resolve_gateway_workers(None, "cuda", 1) == 1
    assert resolve_gateway_workers(None, "cpu", 64) == 1
    assert resolve_gateway_workers(None, "numpy", 64) == 1
    assert resolve_gateway_workers(4, "cpu", 2) == 4                # asked for: as asked
    with pytest.raises(ValueError, match="--gateway-workers"):
        resolve_gateway_workers(0, "cuda", 16)


def test_helios_serve_refuses_zero_gateway_workers_naming_the_option(default_core: Path) -> None:  # noqa: F811 # spec: HTTP-3
    proc = subprocess.run([sys.executable, "-c", "import sys; sys.argv[0] = 'helios-serve'; "
                           "from helios_backend.cli.serve import main; sys.exit(main())",
                           "--core", str(default_core), "--executor", "numpy", "--gateway-workers", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--gateway-workers must be at least 1" in proc.stderr, proc.stderr


def test_startup_model_names_are_listed_and_served_and_others_404(default_core: Path, tmp_path: Path) -> None:  # noqa: F811 # spec: SRV-1
    """--served-model-name (repeated, or several after one flag) adds model ids through the model
    config: /v1/models lists them after the core's own, a request naming one is served, and a name
    that is neither is OpenAI's 404 naming `model`."""
    import httpx
    import openai

    from tests.serve_process import serve_with_gateway

    extra = ("--served-model-name", "gpt-4o", "--served-model-name", "team/small", "local")
    with serve_with_gateway(default_core, tmp_path, *extra) as url:
        listed = [card["id"] for card in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
        assert listed[0] == "smollm2-135m-instruct" and listed[-3:] == ["gpt-4o", "team/small", "local"]
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for name in ("gpt-4o", "team/small"):
            reply = sdk.chat.completions.create(model=name, max_tokens=2, temperature=0,
                                                messages=[{"role": "user", "content": "Hi"}])
            assert reply.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.NotFoundError) as missing:
            sdk.chat.completions.create(model="gpt-5", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        body = missing.value.body
        assert isinstance(body, dict) and body["param"] == "model" and "gpt-5" in body["message"], body
