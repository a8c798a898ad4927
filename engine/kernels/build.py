"""The engine's CPU kernels as a build artefact: each C source of this package is compiled at
install time into ``engine/kernels/built``, never at run time.

    python -m engine.kernels.build              # this machine's CPU (-march=native): make install
    python -m engine.kernels.build --portable   # x86-64-v3 (AVX2, FMA) or armv8-a: the image

Beside each library a manifest (``<stem>.json``) records the source's sha256, the compiler and
its flags, and the CPU features the library needs: for a native build every feature of the CPU
that built it, for a portable one its target's. ``load`` takes a library only where the
manifest matches the source as it is now and this CPU has every feature the library needs;
otherwise it gives no library and the reason, and the callers fall back to PyTorch's SDPA and
oneDNN's products (the startup event names which ran and why).
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

COMMON_FLAGS = ("-O3", "-shared", "-fPIC", "-fno-math-errno")
SOURCE_DIR = Path(__file__).resolve().parent
BUILT_DIR = SOURCE_DIR / "built"
# Per machine: the portable build's target, and the CPU features (/proc/cpuinfo) it needs.
PORTABLE: dict[str, tuple[str, tuple[str, ...]]] = {
    "x86_64": ("-march=x86-64-v3", ("avx", "avx2", "fma", "bmi2", "f16c")),
    "aarch64": ("-march=armv8-a", ()),
}


@dataclass(frozen=True)
class Built:
    """A loaded library, or why there is none."""

    library: ctypes.CDLL | None
    detail: str


def compiler() -> str | None:
    """The C compiler: ``CC`` if set (an empty ``CC`` means none), else ``cc`` or ``gcc``."""
    if "CC" in os.environ:
        return shutil.which(os.environ["CC"]) if os.environ["CC"] else None
    return shutil.which("cc") or shutil.which("gcc")


def cpu_features() -> frozenset[str]:
    """This CPU's feature flags (x86 ``flags``, Arm ``Features``); empty where unknown."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def source_digest(source: Path) -> str:
    return hashlib.sha256(source.read_bytes()).hexdigest()


def library_path(source_name: str, directory: Path | None = None) -> Path:
    return (directory or BUILT_DIR) / f"{Path(source_name).stem}.so"


def _version(cc: str) -> str:
    done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30)
    return done.stdout.splitlines()[0] if done.stdout else cc


def _compile(cc: str, flags: tuple[str, ...], source: Path, target: Path) -> str | None:
    """Build ``target`` (via a temporary name in its directory); the compiler's complaint
    on failure."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(handle)
    done = subprocess.run(
        [cc, *flags, "-o", partial, str(source)], capture_output=True, text=True, timeout=300
    )
    if done.returncode != 0:
        os.unlink(partial)
        return f"{cc} failed: {done.stderr.strip()[:500]}"
    os.replace(partial, target)
    return None


def build(portable: bool = False, directory: Path | None = None) -> list[Path]:
    """Compile every kernel source into ``directory`` (default ``BUILT_DIR``) with its
    manifest; raises ``SystemExit`` with the reason where it cannot."""
    cc = compiler()
    if cc is None:
        raise SystemExit("no C compiler (cc/gcc, or CC) found")
    if portable:
        target = PORTABLE.get(platform.machine())
        if target is None:
            raise SystemExit(f"no portable target for {platform.machine()}")
        march, needs = target[0], sorted(target[1])
    else:
        march, needs = "-march=native", sorted(cpu_features())
    flags = (*COMMON_FLAGS, march)
    built = []
    for source in sorted(SOURCE_DIR.glob("*.c")):
        library = library_path(source.name, directory)
        failure = _compile(cc, flags, source, library)
        if failure is not None:
            raise SystemExit(failure)
        manifest = {
            "source_sha256": source_digest(source),
            "compiler": _version(cc),
            "flags": list(flags),
            "cpu_features": needs,
        }
        library.with_suffix(".json").write_text(json.dumps(manifest, indent=1) + "\n")
        built.append(library)
    return built


def load(source_name: str, directory: Path | None = None) -> Built:
    """The installed library built from ``engine/kernels/<source_name>``, where it is current
    and this CPU runs it."""
    library = library_path(source_name, directory)
    hint = "run `python -m engine.kernels.build` (make install does)"
    try:
        manifest = json.loads(library.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return Built(None, f"{library.name} is not built; {hint}")
    if manifest.get("source_sha256") != source_digest(SOURCE_DIR / source_name):
        return Built(None, f"{library.name} was built from another {source_name}; {hint}")
    missing = sorted(set(manifest.get("cpu_features", ())) - cpu_features())
    if missing:
        lacking = ", ".join(missing[:8])
        return Built(None, f"{library.name} needs CPU features this CPU lacks: {lacking}")
    try:
        loaded = ctypes.CDLL(str(library))
    except OSError as error:
        return Built(None, f"could not load {library.name}: {error}")
    march = next((flag for flag in manifest.get("flags", ()) if flag.startswith("-march")), "")
    return Built(loaded, f"{library.name} ({march.removeprefix('-march=')})")


def load_function(
    source_name: str,
    symbol: str,
    restype: type | None,
    argtypes: list[type],
    switch: tuple[str, str],
) -> Built:
    """``load(source_name)`` with its function ``symbol`` typed, unless the environment
    variable ``switch[0]`` is set to ``switch[1]`` (the caller's fallback, chosen by hand)."""
    variable, fallback = switch
    if os.environ.get(variable) == fallback:
        return Built(None, f"switched off ({variable}={fallback})")
    built = load(source_name)
    if built.library is not None:
        function = getattr(built.library, symbol)
        function.restype = restype
        function.argtypes = argtypes
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the engine's CPU kernels.")
    parser.add_argument(
        "--portable", action="store_true", help="for any CPU of the machine's family (images)"
    )
    args = parser.parse_args()
    for path in build(portable=args.portable):
        print(path)


if __name__ == "__main__":
    main()
