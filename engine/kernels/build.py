"""Compile a C source of this package once per machine into a shared library and load it.

With a C compiler, the library is built with ``-O3 -march=native`` (the kernels are written
for the compiler to vectorise for the CPU it runs on) into ``SPECGATE_KERNEL_DIR`` (default
``~/.cache/specgate/kernels``), named by a hash of the source, the compiler's version, the
flags and the CPU's model and feature flags, so a changed source, compiler or CPU builds anew
and concurrent processes share one build (written to a temporary name, then renamed).

Without one (the container's runtime stage has no build tools), a portable build made at
image build time (``python -m engine.kernels.build``: x86-64-v3, i.e. AVX2 and FMA, on x86)
is loaded from ``engine/kernels/prebuilt`` where the CPU has what it was built for. Otherwise,
or when a build or load fails, ``load`` gives ``None`` and the reason; callers fall back.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

COMMON_FLAGS = ("-O3", "-shared", "-fPIC", "-fno-math-errno")
FLAGS = (*COMMON_FLAGS, "-march=native")
SOURCE_DIR = Path(__file__).resolve().parent
PREBUILT_DIR = SOURCE_DIR / "prebuilt"
# Per machine: the portable build's target, and the CPU flags (/proc/cpuinfo) it needs.
PORTABLE: dict[str, tuple[str, tuple[str, ...]]] = {
    "x86_64": ("-march=x86-64-v3", ("avx", "avx2", "fma", "bmi2", "f16c")),
    "aarch64": ("-march=armv8-a", ()),
}


@dataclass(frozen=True)
class Built:
    """A loaded library, or why there is none."""

    library: ctypes.CDLL | None
    detail: str


def kernel_dir() -> Path:
    configured = os.environ.get("SPECGATE_KERNEL_DIR")
    if configured:
        return Path(configured)
    return Path.home() / ".cache" / "specgate" / "kernels"


def compiler() -> str | None:
    """The C compiler: ``CC`` if set (an empty ``CC`` means none), else ``cc`` or ``gcc``."""
    if "CC" in os.environ:
        return shutil.which(os.environ["CC"]) if os.environ["CC"] else None
    return shutil.which("cc") or shutil.which("gcc")


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    seen = {line.split(":")[0].strip(): line for line in lines if ":" in line}
    return "\n".join(seen[key] for key in wanted if key in seen) or platform.machine()


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


def prebuilt_path(source_name: str) -> Path:
    return PREBUILT_DIR / f"{Path(source_name).stem}-{platform.machine()}.so"


def _load_prebuilt(source_name: str, why: str) -> Built:
    """The image's portable build where this CPU runs it; else None with ``why``."""
    path = prebuilt_path(source_name)
    portable = PORTABLE.get(platform.machine())
    if not path.exists() or portable is None:
        return Built(None, why)
    flags = _cpu_identity().split()
    missing = [flag for flag in portable[1] if flag not in flags]
    if missing:
        return Built(None, f"{why}; the prebuilt {path.name} needs {', '.join(missing)}")
    try:
        return Built(ctypes.CDLL(str(path)), f"{path.name} (prebuilt, {portable[0]})")
    except OSError as error:
        return Built(None, f"{why}; could not load {path.name}: {error}")


def load(source_name: str) -> Built:
    """The library compiled from ``engine/kernels/<source_name>``, built if not cached."""
    cc = compiler()
    if cc is None:
        return _load_prebuilt(source_name, "no C compiler (cc/gcc, or CC) found")
    source = SOURCE_DIR / source_name
    try:
        text = source.read_bytes()
        key = hashlib.sha256(
            b"\0".join([text, _version(cc).encode(), " ".join(FLAGS).encode(),
                        _cpu_identity().encode()])
        ).hexdigest()[:20]
        target = kernel_dir() / f"{source.stem}-{key}.so"
        if not target.exists():
            failure = _compile(cc, FLAGS, source, target)
            if failure is not None:
                return _load_prebuilt(source_name, failure)
        return Built(ctypes.CDLL(str(target)), f"{target.name} ({cc})")
    except (OSError, subprocess.SubprocessError) as error:
        return _load_prebuilt(source_name, f"could not build {source_name}: {error}")


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


def prebuild() -> list[Path]:
    """The portable build of every kernel source, into ``PREBUILT_DIR`` (image build time)."""
    cc = compiler()
    portable = PORTABLE.get(platform.machine())
    if cc is None or portable is None:
        raise SystemExit(f"no compiler or no portable target for {platform.machine()}")
    built = []
    for source in sorted(SOURCE_DIR.glob("*.c")):
        target = prebuilt_path(source.name)
        failure = _compile(cc, (*COMMON_FLAGS, portable[0]), source, target)
        if failure is not None:
            raise SystemExit(failure)
        built.append(target)
    return built


if __name__ == "__main__":
    for path in prebuild():
        print(path)
