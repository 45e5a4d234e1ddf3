"""Shape files: a GGUF's metadata and tensor table without its weights, and random-weight F16
GGUFs of exactly that shape.

The real GGUFs (98-491 MB) cannot travel to the device machine (64 MiB per call), but llama.cpp
needs a model file of the same architecture and tensors to be measured as a peer. So:

  here   `python -m bench.gguf_shape write SOURCE.gguf OUT.shape.gguf.xz`
         a tensor-less GGUF holding every metadata key of SOURCE with its value type (the
         tokenizer arrays and the chat template included) plus the tensor table under
         `helios.shape.*` keys: each tensor's name, dimensions (GGUF order) and source type.
         xz-compressed (the tokenizer arrays shrink 2-4x).
  there  `python3 -m bench.gguf_shape random OUT.shape.gguf.xz MODEL.gguf --gguf-py TREE/gguf-py`
         an F16 GGUF of the same metadata and tensors (file type F16): norm weights 1, every
         other tensor normal with std 0.02; matrices F16, vectors F32 (as llama.cpp's converter
         stores them). Dense F16 speed does not depend on the values. `--gguf-py` loads llama.cpp's
         own gguf-py (the device has no `gguf` package); without it the installed `gguf` is used.

  here   `python -m bench.gguf_shape layout bench/layouts/NAME.json OUT.shape.gguf.xz`
         the shape file of a layout that has no GGUF (a Hugging Face config.json of the llama or
         qwen2 family: bench/layouts/): llama.cpp's metadata keys and tensor table for those
         dimensions (F16 matrices, F32 vectors, qwen2's q/k/v biases, an output head unless the
         embeddings are tied) and a stand-in vocabulary of the config's size (SentencePiece-style:
         <unk>, <s>, </s>, 256 byte tokens, then numbered pieces), since llama.cpp builds the
         embedding and head from the vocabulary's size. Speed does not depend on the tokens.

Only numpy and gguf are needed: the device side imports nothing of the project.
"""
from __future__ import annotations

import argparse
import importlib.util
import lzma
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np

PREFIX = "helios.shape."
NAMES, NDIMS, DIMS, TYPES, SOURCE = (PREFIX + k for k in ("tensor_names", "tensor_ndims", "tensor_ne",
                                                          "tensor_types", "source"))
STD = 0.02
F16_FILE_TYPE = 1        # LLAMA_FTYPE_MOSTLY_F16
_XZ_MAGIC = b"\xfd7zXZ\x00"


def _gguf(gguf_py: str | None = None) -> Any:
    """The gguf module: llama.cpp's own gguf-py when named (loaded as the `gguf` package from
    that folder, in place of any gguf imported before), else the installed package."""
    try:
        import yaml  # noqa: F401  (gguf-py's metadata module imports it; only model cards use it)
    except ImportError:
        import types
        sys.modules["yaml"] = types.ModuleType("yaml")
    if gguf_py:
        package = Path(gguf_py).resolve() / "gguf"
        spec = importlib.util.spec_from_file_location("gguf", package / "__init__.py",
                                                      submodule_search_locations=[str(package)])
        if spec is None or spec.loader is None:
            raise ImportError(f"--gguf-py {gguf_py}: no gguf package in it")
        for name in [n for n in sys.modules if n == "gguf" or n.startswith("gguf.")]:
            del sys.modules[name]
        module = importlib.util.module_from_spec(spec)
        sys.modules["gguf"] = module
        spec.loader.exec_module(module)
        return module
    import gguf
    return gguf


def _copy_fields(reader: Any, writer: Any, gguf: Any, skip: Any) -> None:
    """Every metadata key of `reader` not matched by `skip`, with its value type (and array
    element type) as stored."""
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or skip(key):
            continue
        main = field.types[0]
        if main == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), main, sub_type=field.types[1])
        else:
            writer.add_key_value(key, field.contents(), main)


def _close(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()


def write_shape(source: Path, out: Path, gguf_py: str | None = None) -> Path:
    """The shape file of `source` at `out` (xz-compressed when `out` ends with .xz)."""
    gguf = _gguf(gguf_py)
    reader = gguf.GGUFReader(str(source))
    arch = reader.fields["general.architecture"].contents()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        plain = Path(scratch) / out.name.removesuffix(".xz")
        writer = gguf.GGUFWriter(str(plain), arch)
        _copy_fields(reader, writer, gguf, lambda key: False)
        _write_table(writer, gguf, [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in reader.tensors],
                     f"{source.name} ({source.stat().st_size} bytes)")
        return _finish(writer, plain, out)


def _write_table(writer: Any, gguf: Any, table: list[tuple[str, tuple[int, ...], int]], source: str) -> None:
    """The helios.shape.* keys: each tensor's name, dimensions (GGUF order) and type."""
    writer.add_array(NAMES, [name for name, _, _ in table])
    writer.add_key_value(NDIMS, [len(ne) for _, ne, _ in table], gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.UINT32)
    writer.add_key_value(DIMS, [int(d) for _, ne, _ in table for d in ne], gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.UINT64)
    writer.add_key_value(TYPES, [int(t) for _, _, t in table], gguf.GGUFValueType.ARRAY,
                         sub_type=gguf.GGUFValueType.UINT32)
    writer.add_string(SOURCE, source)


def _finish(writer: Any, plain: Path, out: Path) -> Path:
    _close(writer)
    writer.close()
    if out.suffix == ".xz":
        with open(plain, "rb") as f, lzma.open(out, "wb", preset=9) as z:
            shutil.copyfileobj(f, z)
    else:
        os.replace(plain, out)
    return out


# ---- layouts: a config.json alone ---------------------------------------------------------------

# per Hugging Face model_type: llama.cpp's architecture and whether q/k/v carry biases
LAYOUT_FAMILIES: dict[str, dict[str, Any]] = {"llama": {"arch": "llama", "qkv_bias": False},
                                              "qwen2": {"arch": "qwen2", "qkv_bias": True}}
# (GGUF name, dims in GGUF order as a function of the config's sizes); "{i}" is the block
_BLOCK_TENSORS = (("attn_norm.weight", lambda d, q, kv, f: (d,)),
                  ("attn_q.weight", lambda d, q, kv, f: (d, q)),
                  ("attn_k.weight", lambda d, q, kv, f: (d, kv)),
                  ("attn_v.weight", lambda d, q, kv, f: (d, kv)),
                  ("attn_output.weight", lambda d, q, kv, f: (q, d)),
                  ("ffn_norm.weight", lambda d, q, kv, f: (d,)),
                  ("ffn_gate.weight", lambda d, q, kv, f: (d, f)),
                  ("ffn_up.weight", lambda d, q, kv, f: (d, f)),
                  ("ffn_down.weight", lambda d, q, kv, f: (f, d)))
_BIASES = (("attn_q.bias", lambda d, q, kv, f: (q,)), ("attn_k.bias", lambda d, q, kv, f: (kv,)),
           ("attn_v.bias", lambda d, q, kv, f: (kv,)))
GGML_F32, GGML_F16 = 0, 1


def attention_sizes(config: dict) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dimension) of a config (head_dim defaults to hidden / heads)."""
    heads = config["num_attention_heads"]
    return heads, config.get("num_key_value_heads", heads), config.get("head_dim") or config["hidden_size"] // heads


def layout_table(config: dict) -> tuple[str, list[tuple[str, tuple[int, ...], int]]]:
    """(llama.cpp architecture, [(tensor, GGUF dims, GGML type)]) of a llama- or qwen2-family config."""
    family = LAYOUT_FAMILIES.get(config.get("model_type", ""))
    if family is None:
        raise ValueError(f"model_type {config.get('model_type')!r}: a layout shape needs one of {sorted(LAYOUT_FAMILIES)}")
    d, vocab, ffn = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    heads, kv_heads, head_dim = attention_sizes(config)
    q, kv = heads * head_dim, kv_heads * head_dim
    per_block = _BLOCK_TENSORS + (_BIASES if family["qkv_bias"] else ())
    table: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (d, vocab))]
    for i in range(config["num_hidden_layers"]):
        table += [(f"blk.{i}.{name}", dims(d, q, kv, ffn)) for name, dims in per_block]
    table.append(("output_norm.weight", (d,)))
    if not config.get("tie_word_embeddings", False):
        table.append(("output.weight", (d, vocab)))
    return family["arch"], [(name, ne, GGML_F16 if len(ne) > 1 else GGML_F32) for name, ne in table]


def stand_in_vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) of a SentencePiece-style vocabulary of `size` entries: <unk>, <s>,
    </s> (ids 0-2), the 256 byte tokens, then numbered pieces."""
    specials = [("<unk>", 2), ("<s>", 3), ("</s>", 3)]           # UNKNOWN, CONTROL
    pieces = specials + [(f"<0x{b:02X}>", 6) for b in range(256)]  # BYTE
    pieces += [(f"\u2581t{i}", 1) for i in range(size - len(pieces))]   # NORMAL
    return [p for p, _ in pieces], [-float(i) for i in range(size)], [t for _, t in pieces]


def write_layout_shape(config_path: Path, out: Path, gguf_py: str | None = None) -> Path:
    """The shape file at `out` of the layout a Hugging Face config.json describes."""
    import json

    gguf = _gguf(gguf_py)
    config = json.loads(Path(config_path).read_text())
    arch, table = layout_table(config)
    heads, kv_heads, head_dim = attention_sizes(config)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        plain = Path(scratch) / out.name.removesuffix(".xz")
        writer = gguf.GGUFWriter(str(plain), arch)
        writer.add_name(Path(config_path).stem)
        writer.add_context_length(config.get("max_position_embeddings", 4096))
        writer.add_embedding_length(config["hidden_size"])
        writer.add_block_count(config["num_hidden_layers"])
        writer.add_feed_forward_length(config["intermediate_size"])
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(head_dim)
        writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
        writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
        writer.add_vocab_size(config["vocab_size"])
        writer.add_file_type(F16_FILE_TYPE)
        tokens, scores, types = stand_in_vocabulary(config["vocab_size"])
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        _write_table(writer, gguf, table, f"{Path(config_path).name} (a layout: no weights)")
        return _finish(writer, plain, out)


def tensor_table(reader: Any) -> list[tuple[str, tuple[int, ...]]]:
    """(name, dimensions in GGUF order: fastest first) of every tensor a shape file lists."""
    names = reader.fields[NAMES].contents()
    ndims = reader.fields[NDIMS].contents()
    dims = reader.fields[DIMS].contents()
    table, at = [], 0
    for name, n in zip(names, ndims):
        table.append((name, tuple(int(d) for d in dims[at:at + n])))
        at += n
    return table


def _plain(path: Path, scratch: Path) -> Path:
    """`path` itself, or its xz-decompressed copy in `scratch`."""
    with open(path, "rb") as f:
        if f.read(6) != _XZ_MAGIC:
            return path
    plain = scratch / path.name.removesuffix(".xz")
    with lzma.open(path, "rb") as z, open(plain, "wb") as f:
        shutil.copyfileobj(z, f)
    return plain


def is_norm(name: str) -> bool:
    """RMSNorm weights (attn_norm, ffn_norm, output_norm, attn_q_norm, post_ffw_norm, ...): 1."""
    return name.endswith("norm.weight")


def stored_dtype(ne: tuple[int, ...]) -> type:
    """Vectors (norms, biases) F32, matrices F16, as llama.cpp's converter stores an F16 model."""
    return np.float32 if all(d == 1 for d in ne[1:]) else np.float16


def random_tensors(table: list[tuple[str, tuple[int, ...]]], seed: int = 0) -> Iterator[np.ndarray]:
    """The random value of each tensor, in table order (numpy shape = GGUF dimensions reversed)."""
    rng = np.random.default_rng(seed)
    for name, ne in table:
        shape = tuple(reversed(ne))
        values = np.ones(shape, np.float32) if is_norm(name) else \
            rng.standard_normal(shape, dtype=np.float32) * np.float32(STD)
        yield values.astype(stored_dtype(ne), copy=False)


def write_random(shape_file: Path, out: Path, gguf_py: str | None = None, seed: int = 0) -> Path:
    """An F16 GGUF at `out` with the metadata and tensors of `shape_file`, random weights."""
    gguf = _gguf(gguf_py)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as scratch:
        reader = gguf.GGUFReader(str(_plain(shape_file, Path(scratch))))
        arch = reader.fields["general.architecture"].contents()
        table = tensor_table(reader)
        partial = out.with_name(out.name + ".partial")
        writer = gguf.GGUFWriter(str(partial), arch)
        if "general.alignment" in reader.fields:
            writer.data_alignment = int(reader.fields["general.alignment"].contents())
        _copy_fields(reader, writer, gguf, lambda key: key.startswith(PREFIX) or key == "general.file_type")
        writer.add_file_type(F16_FILE_TYPE)
        for name, ne in table:
            dtype = np.dtype(stored_dtype(ne))
            writer.add_tensor_info(name, tuple(reversed(ne)), dtype, int(np.prod(ne)) * dtype.itemsize)
        _close(writer)
        for values in random_tensors(table, seed):
            writer.write_tensor_data(values)
        writer.close()
        os.replace(partial, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="shape file of a real GGUF")
    w.add_argument("source", type=Path)
    w.add_argument("out", type=Path)
    r = sub.add_parser("random", help="random-weight F16 GGUF of a shape file")
    r.add_argument("shape", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--seed", type=int, default=0)
    for p in (w, r):
        p.add_argument("--gguf-py", default=None, help="llama.cpp's gguf-py folder (default: the installed gguf)")
    args = parser.parse_args()
    started = time.time()
    if args.command == "write":
        path = write_shape(args.source, args.out, args.gguf_py)
    else:
        path = write_random(args.shape, args.out, args.gguf_py, args.seed)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB) in {time.time() - started:.1f} s")


if __name__ == "__main__":
    main()
