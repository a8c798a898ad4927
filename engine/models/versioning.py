"""Model versions: a SHA-256 over every file of a checkpoint directory.

Hashing 140 GB of weights takes minutes, so the digest is cached beside the model (or, when
the model directory is read-only, in the user cache) keyed by each file's size and
modification time; a changed, added or removed file invalidates it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CACHE_NAME = ".specgate-version.json"
_CHUNK = 8 * 1024 * 1024


def _files(model_dir: Path) -> list[Path]:
    return sorted(
        p
        for p in model_dir.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(model_dir).parts)
    )


def _fingerprint(model_dir: Path, files: list[Path]) -> list[list[object]]:
    out: list[list[object]] = []
    for p in files:
        st = p.stat()
        out.append([p.relative_to(model_dir).as_posix(), st.st_size, st.st_mtime_ns])
    return out


def _fallback_cache(model_dir: Path) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specgate" / "versions"
    key = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:32]
    return base / f"{key}.json"


def _hash_files(model_dir: Path, files: list[Path]) -> str:
    digest = hashlib.sha256()
    for p in files:
        file_hash = hashlib.sha256()
        with p.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                file_hash.update(chunk)
        digest.update(f"{p.relative_to(model_dir).as_posix()}\0{file_hash.hexdigest()}\n".encode())
    return "sha256:" + digest.hexdigest()


def model_version(model_dir: Path) -> str:
    """``sha256:<hex>`` naming exactly the files of ``model_dir`` (weights, config, tokenizer)."""
    files = _files(model_dir)
    if not files:
        raise FileNotFoundError(f"no files in model directory {model_dir}")
    fingerprint = _fingerprint(model_dir, files)
    candidates = [model_dir / CACHE_NAME, _fallback_cache(model_dir)]
    for cache in candidates:
        try:
            cached = json.loads(cache.read_text())
        except (OSError, ValueError):
            continue
        if cached.get("files") == fingerprint and isinstance(cached.get("version"), str):
            return str(cached["version"])
    version = _hash_files(model_dir, files)
    record = json.dumps({"version": version, "files": fingerprint})
    for cache in candidates:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(record)
            break
        except OSError:
            continue
    return version


MANIFEST_NAME = ".specgate-manifest.json"


def write_manifest(model_dir: Path) -> Path:
    """Write ``MANIFEST_NAME`` beside the weights: the model's version (the hash
    ``model_version`` computes, which the built-in engine records) for a gateway that serves
    the model through a remote server and cannot read or hash the weights itself. The name
    starts with a dot, so the manifest is not part of the hash it records."""
    manifest = model_dir / MANIFEST_NAME
    manifest.write_text(json.dumps({"model_version": model_version(model_dir)}, indent=2) + "\n")
    return manifest


def read_manifest(model_dir: Path) -> str:
    """The version a manifest records; ``ValueError`` naming the file when it is missing or
    malformed (the gateway then refuses to start: an unversioned model is not audited)."""
    manifest = model_dir / MANIFEST_NAME
    try:
        version = json.loads(manifest.read_text())["model_version"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(
            f"{manifest}: no readable model manifest ({error}); "
            f"write one with `specgate models hash {model_dir}`"
        ) from None
    if not isinstance(version, str) or not version.startswith("sha256:"):
        raise ValueError(f"{manifest}: model_version must be 'sha256:<hex>'")
    return version
