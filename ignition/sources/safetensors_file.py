"""Read one `.safetensors` file with numpy alone: f32, f16 and bf16 tensors as float32.

The format (https://huggingface.co/docs/safetensors): 8 bytes little-endian header length N,
N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": ...},
then the tensor bytes (little-endian, row-major), offsets relative to the end of the header.

numpy has no bfloat16 (safetensors' numpy API raises "data type 'bfloat16' not understood"):
a bf16 value is the upper 16 bits of the float32 with the same sign, exponent and leading
mantissa bits, so its uint16 words shifted left by 16 and viewed as float32 are exact.
The file is memory-mapped; a tensor is read when asked for.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import numpy as np

from ignition.sources.gguf import GGUFError

# safetensors dtype -> numpy dtype of the stored words (bf16: its uint16 words)
_STORED: dict[str, np.dtype] = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "BF16": np.dtype("<u2"), "F64": np.dtype("<f8")}
HEADER_LIMIT = 100 * 2**20     # the reference implementation's bound on the JSON header


class SafetensorsError(GGUFError):
    """A file that is not a safetensors file, or a tensor of a dtype that has no float reading here."""


def bf16_to_f32(words: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> the float32 values they denote (exact)."""
    return (np.asarray(words, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


class SafetensorsFile:
    """One memory-mapped safetensors file: its tensor names, dtypes and float32 values."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise SafetensorsError(f"{path}: not a safetensors file (shorter than its header length)")
            (length,) = struct.unpack("<Q", head)
            if length > HEADER_LIMIT:
                raise SafetensorsError(f"{path}: not a safetensors file (header of {length} bytes)")
            try:
                header = json.loads(f.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise SafetensorsError(f"{path}: not a safetensors file (header is not JSON: {exc})") from exc
        if not isinstance(header, dict) or not all(
                isinstance(e, dict) and {"dtype", "shape", "data_offsets"} <= e.keys()
                for k, e in header.items() if k != "__metadata__"):
            raise SafetensorsError(f"{path}: not a safetensors file (header entries lack dtype/shape/data_offsets)")
        header.pop("__metadata__", None)
        self._entries: dict[str, dict[str, Any]] = header
        self._data_start = 8 + length
        self._map = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size > self._data_start else None

    def keys(self) -> list[str]:
        return list(self._entries)

    def dtype(self, name: str) -> str:
        return str(self._entries[name]["dtype"])

    def tensor(self, name: str) -> np.ndarray:
        """The tensor `name` as a float32 array of its shape."""
        entry = self._entries[name]
        stored = _STORED.get(entry["dtype"])
        if stored is None:
            raise SafetensorsError(f"{self.path}: tensor {name!r} has dtype {entry['dtype']}; "
                                   f"readable: {', '.join(sorted(_STORED))}")
        begin, end = (int(o) for o in entry["data_offsets"])
        shape = tuple(int(d) for d in entry["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * stored.itemsize or self._map is None and count:
            raise SafetensorsError(f"{self.path}: tensor {name!r} spans {end - begin} bytes, "
                                   f"not {count} x {entry['dtype']}")
        if count == 0:
            return np.zeros(shape, dtype=np.float32)
        assert self._map is not None
        words = self._map[self._data_start + begin:self._data_start + end].view(stored).reshape(shape)
        if entry["dtype"] == "BF16":
            return bf16_to_f32(words)
        return words.astype(np.float32)
