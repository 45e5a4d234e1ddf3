"""Prepared cores of checkpoint folders, kept in a cache keyed by the folder's content.

    entry = CoreCache().find_or_prepare(Path("./my-model"), kernels=False, progress=progress)
    entry.path        # the signed core to serve; entry.prepared: False when it was reused

What `helios-serve --model DIR` serves: the first start prepares DIR's core (signed with the
local publisher key, under the checkpoint recipe's namespace) into the cache; a later start with
the same folder content finds it and prepares nothing.

The key (sha256) covers what the core is made of:
  * every top-level *.json and *.jinja file of the folder, byte for byte (config.json,
    generation_config.json, tokenizer.json, tokenizer_config.json, the safetensors index, ...);
  * every *.safetensors file: its name, size and the sha256 of its bytes. A weight file is hashed
    once: its digest is remembered in the cache's weight-digests.json under the file's resolved
    path, size, mtime and inode, so a later start only stats it, and a file that changed in any of
    those (a new download, an edit, a copy) is hashed again. Sampling would read less, but could
    serve a stale core for a file edited where no sample looked;
  * the preparation itself: a digest of the sources that turn a folder into a core (ignition,
    helios_backend/kernel_abi, the generated schema) and the publisher key's public half, so a
    changed preparation or another local key prepares again.

Entries are `<folder name>-<key[:16]>.kernels.core` (with GPU kernel modules) or
`.no-kernels.core`; a core with kernels serves every executor, so a lookup that does not need
kernels takes either. Cores are written atomically (the core writer renames a complete file) and
an exclusive lock per key makes a second start wait for the first one's preparation, then reuse it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import helios_proto

import helios_backend.kernel_abi
import ignition
from helios_backend.core import CoreError, load_or_create_publisher_key, open_core
from helios_backend.core.keys import public_key_bytes
from ignition.progress import HASHING, Progress, ProgressBars

CACHE_ENVIRONMENT = "HELIOS_CORE_CACHE"
DIGESTS_FILE = "weight-digests.json"
HASH_BLOCK = 8 << 20
# the folder's files that make up the core besides the weights: configuration, tokenizer, template
METADATA_SUFFIXES = (".json", ".jinja")
WEIGHT_SUFFIX = ".safetensors"

def default_cache_dir() -> Path:
    """$HELIOS_CORE_CACHE, else ~/.cache/helios/cores."""
    configured = os.environ.get(CACHE_ENVIRONMENT)
    return Path(configured) if configured else Path.home() / ".cache" / "helios" / "cores"


class ModelFolderError(ValueError):
    """The folder given as a model is missing or holds no checkpoint (the message names the file)."""


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    path: Path
    key: str
    prepared: bool            # False: an existing entry was reused
    kernels: bool             # the core holds GPU kernel modules
    namespace: str            # the publisher namespace it is signed under (the recipe's)


def preparation_digest() -> str:
    """sha256 over the sources that turn a folder into a core: a changed preparation is a new key."""
    digest = hashlib.sha256()
    for package in (ignition, helios_backend.kernel_abi, helios_proto):
        root = Path(next(iter(package.__path__)))
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


class WeightDigests:
    """sha256 of weight files, remembered under (resolved path, size, mtime, inode)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._known: dict[str, dict[str, object]] = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            self._known = {}

    @staticmethod
    def _identity(stat: os.stat_result) -> dict[str, object]:
        return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "inode": stat.st_ino}

    def known(self, file: Path) -> str | None:
        """The remembered digest of `file`, if it has not changed since it was hashed."""
        real = file.resolve()        # a Hugging Face snapshot links to its blobs
        known = self._known.get(str(real))
        if known is not None and {k: known.get(k) for k in ("size", "mtime_ns", "inode")} == self._identity(real.stat()):
            return str(known["sha256"])
        return None

    def digest(self, file: Path, progress: Callable[[int], None] | None = None) -> str:
        """The sha256 of `file`'s bytes: remembered, else read once (progress(bytes) per block)."""
        found = self.known(file)
        if found is not None:
            return found
        real = file.resolve()
        stat = real.stat()
        digest = hashlib.sha256()
        with open(real, "rb") as f:
            while block := f.read(HASH_BLOCK):
                digest.update(block)
                if progress is not None:
                    progress(len(block))
        self._known[str(real)] = {**self._identity(stat), "sha256": digest.hexdigest()}
        self._save()
        return digest.hexdigest()

    def _save(self) -> None:
        """Write-then-rename: a concurrent start reads the old or the new table, never half of one
        (a lost update only costs that start a hash)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.tmp{os.getpid()}")
        tmp.write_text(json.dumps(self._known, indent=1, sort_keys=True))
        tmp.replace(self.path)


def _checked_folder(folder: Path) -> Path:
    if not folder.is_dir():
        raise ModelFolderError(f"--model {folder}: no such directory")
    if not (folder / "config.json").is_file():
        raise ModelFolderError(f"--model {folder}: no config.json (a Hugging Face checkpoint folder holds "
                               "config.json, *.safetensors, tokenizer.json and tokenizer_config.json)")
    if not any(folder.glob(f"*{WEIGHT_SUFFIX}")):
        raise ModelFolderError(f"--model {folder}: no *{WEIGHT_SUFFIX} weight file")
    return folder


def entry_name(folder: Path) -> str:
    """The folder's name as a file-name part (a snapshot folder `snapshots/<sha>` keeps its sha)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", folder.name).strip("-.") or "model"


def _prepare(folder: Path, out: Path, key_path: Path | None, kernels: bool, show_progress: bool) -> None:
    """helios-prepare's preparation of `folder` into `out`; ModelFolderError for a folder or option
    it cannot use (the recipes are imported only when a core is prepared)."""
    from ignition.cli import prepare_core
    from ignition.gpu_kernels.specs import GeometryError
    from ignition.gpu_kernels.targets import TargetError
    from ignition.sources.gguf import GGUFError            # a CheckpointError is a GGUFError

    try:
        prepare_core(str(folder), out, key_path=None if key_path is None else str(key_path), kernels=kernels,
                     show_progress=show_progress)
    except (GGUFError, TargetError, GeometryError) as exc:
        raise ModelFolderError(f"--model {folder}: {exc}") from exc


class CoreCache:
    """The cores `helios-serve --model` prepared, under `root` (default: default_cache_dir())."""

    def __init__(self, root: Path | None = None, key_path: Path | None = None) -> None:
        self.root = root if root is not None else default_cache_dir()
        self.key_path = key_path          # None: the default publisher key (helios_backend.core.keys)
        self.digests = WeightDigests(self.root / DIGESTS_FILE)

    def key(self, folder: Path, progress: Progress | None = None) -> str:
        """The cache key of `folder` as it is now (ModelFolderError when it holds no checkpoint)."""
        folder = _checked_folder(folder.resolve())
        digest = hashlib.sha256(b"helios-core-cache-1\0")
        digest.update(preparation_digest().encode())
        digest.update(public_key_bytes(load_or_create_publisher_key(self.key_path)))
        files = sorted(path for path in folder.iterdir() if path.is_file())
        weights = [path for path in files if path.suffix == WEIGHT_SUFFIX]
        unhashed = sum(path.stat().st_size for path in weights if self.digests.known(path) is None)
        hashed = 0

        def hashing(nbytes: int) -> None:
            nonlocal hashed
            hashed += nbytes
            if progress is not None:
                progress(HASHING, hashed, unhashed)

        for path in files:
            if path.suffix in METADATA_SUFFIXES:
                digest.update(b"file\0" + path.name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
            elif path.suffix == WEIGHT_SUFFIX:
                digest.update(b"weights\0" + path.name.encode() + b"\0" + str(path.stat().st_size).encode()
                              + b"\0" + self.digests.digest(path, hashing).encode())
        return digest.hexdigest()

    def _path(self, folder: Path, key: str, kernels: bool) -> Path:
        return self.root / f"{entry_name(folder)}-{key[:16]}.{'kernels' if kernels else 'no-kernels'}.core"

    def _entry(self, path: Path, key: str, prepared: bool, kernels: bool) -> CacheEntry | None:
        """The entry at `path` when it opens and the local publisher key signed it, else None."""
        try:
            with open_core(path) as core:
                if core.public_key != public_key_bytes(load_or_create_publisher_key(self.key_path)):
                    return None
                return CacheEntry(path, key, prepared, kernels, core.namespace)
        except (OSError, CoreError):
            return None

    def lookup(self, folder: Path, key: str, kernels: bool) -> CacheEntry | None:
        """An existing entry for `key`: one with kernels, or (unless `kernels`) one without."""
        for has_kernels in ((True,) if kernels else (True, False)):
            path = self._path(folder, key, has_kernels)
            found = self._entry(path, key, False, has_kernels) if path.is_file() else None
            if found is not None:
                return found
        return None

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{key[:16]}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)       # released when the file closes
            yield

    def find_or_prepare(self, folder: Path, kernels: bool, show_progress: bool = True,
                        log: Callable[[str], None] = lambda line: None) -> CacheEntry:
        """The cached core of `folder`, prepared now when the cache holds none for its content;
        `kernels`: whether the core must carry GPU kernel modules. Progress bars (stderr) for
        hashing and every preparation phase unless `show_progress` is off."""
        folder = folder.resolve()
        bars = ProgressBars(enabled=show_progress)
        key = self.key(folder, bars)
        bars.close()
        with self._locked(key):
            found = self.lookup(folder, key, kernels)
            if found is not None:
                log(f"reusing the prepared core {found.path} (key {key[:16]})")
                return found
            path = self._path(folder, key, kernels)
            log(f"preparing {folder} into {path} ({'with' if kernels else 'without'} GPU kernels)")
            _prepare(folder, path, self.key_path, kernels, show_progress)
            entry = self._entry(path, key, True, kernels)
            if entry is None:
                raise CoreError(f"{path}: the core just prepared does not open")
            return entry
