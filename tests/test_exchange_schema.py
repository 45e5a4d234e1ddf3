"""The exchange's tensors are declared once (helios_backend/exchange.py) and config.pbtxt agrees."""
from __future__ import annotations

import re
from pathlib import Path

from helios_backend import exchange

CONFIG = Path(__file__).resolve().parent.parent / "model_repository" / "helios" / "config.pbtxt"


def _section(text: str, name: str) -> list[tuple[str, str, tuple[int, ...], bool]]:
    body = re.search(rf"^{name} \[(.*?)^\]", text, re.S | re.M)
    assert body is not None, name
    out = []
    for entry in re.findall(r"\{([^}]*)\}", body.group(1)):
        tensor = re.search(r'name: "([^"]+)"', entry)
        dtype = re.search(r"data_type: TYPE_(\w+)", entry)
        dims = re.search(r"dims: \[([^\]]*)\]", entry)
        assert tensor and dtype and dims, entry
        out.append((tensor.group(1), dtype.group(1), tuple(int(d) for d in dims.group(1).split(",")),
                    "optional: true" in entry))
    return out


def test_config_pbtxt_declares_exactly_the_transport_tensors() -> None:
    text = CONFIG.read_text()
    declared = {(t.name, t.dtype, t.dims, t.optional) for t in exchange.INPUTS}
    assert set(_section(text, "input")) == declared
    declared = {(t.name, t.dtype, t.dims, t.optional) for t in exchange.OUTPUT_TENSORS}
    assert set(_section(text, "output")) == declared
    assert f'name: "{exchange.MODEL_NAME}"' in text
    assert {t.name for t in exchange.OUTPUT_TENSORS} == set(exchange.OUTPUTS)


def test_no_message_travels_as_bytes() -> None:
    # the stub of Triton 2.51 cannot carry BYTES tensors under numpy 2 (docs/exchange.md)
    assert all(t.dtype != "STRING" for t in exchange.TENSORS)
    assert "TYPE_STRING" not in CONFIG.read_text()
