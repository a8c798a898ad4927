"""The container image, checked without a Docker engine: hadolint, the paths the Dockerfile
copies, the entry point it names, and that those paths alone build an installable wheel."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
HADOLINT = Path(sys.executable).parent / "hadolint"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

Instruction = tuple[str, str]


def instructions() -> list[Instruction]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    parsed: list[Instruction] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, arguments = full.partition(" ")
        parsed.append((keyword.upper(), arguments.strip()))
    return parsed


def stages() -> list[list[Instruction]]:
    result: list[list[Instruction]] = []
    for instruction in instructions():
        if instruction[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(instruction)
    return result


def only(stage: list[Instruction], keyword: str) -> str:
    (arguments,) = [args for key, args in stage if key == keyword]
    return arguments


def context_copies() -> list[tuple[list[str], str]]:
    """COPY instructions that read the build context: (sources, destination)."""
    copies = []
    for keyword, arguments in instructions():
        if keyword != "COPY":
            continue
        words = shlex.split(arguments)
        if any(word.startswith("--from=") for word in words):
            continue
        paths = [word for word in words if not word.startswith("--")]
        copies.append((paths[:-1], paths[-1]))
    return copies


def test_hadolint_reports_nothing() -> None:
    result = subprocess.run(
        [
            str(HADOLINT),
            "--format",
            "json",
            "--failure-threshold",
            "style",
            "--disable-ignore-pragma",
            str(DOCKERFILE),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert json.loads(result.stdout) == []
    assert result.returncode == 0


def test_build_is_multi_stage_with_a_torch_variant_argument() -> None:
    builder, runtime = stages()
    assert only(builder, "FROM") == "${BASE_IMAGE} AS builder"
    assert only(runtime, "FROM") == "${BASE_IMAGE} AS runtime"
    arguments = {
        args.split("=", 1)[0]: args.split("=", 1)[1]
        for key, args in builder
        if key == "ARG" and "=" in args
    }
    assert arguments["TORCH_VARIANT"] == "cpu"
    assert "${TORCH_VARIANT}" in arguments["TORCH_INDEX_URL"]
    # The pinned torch satisfies the project's own constraint.
    (torch_requirement,) = [
        d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch")
    ]
    assert arguments["TORCH_VERSION"] in SpecifierSet(torch_requirement.removeprefix("torch"))
    # The runtime stage takes the virtual environment only: no sources, no build tools.
    assert [args for key, args in runtime if key == "COPY"] == [
        "--from=builder /opt/venv /opt/venv"
    ]
    assert not any(
        key == "RUN" and any(tool in args for tool in ("apt-get", "gcc", "pip install"))
        for key, args in runtime
    )


def test_every_copied_path_exists_and_is_in_the_build_context() -> None:
    included = {
        line.removeprefix("!").rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    }
    copies = context_copies()
    assert copies
    for sources, _ in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
            assert source.rstrip("/") in included, f"COPY {source}: excluded by .dockerignore"


def test_entrypoint_is_the_console_script_and_runs_the_server() -> None:
    runtime = stages()[-1]
    entrypoint = json.loads(only(runtime, "ENTRYPOINT"))
    assert entrypoint == ["specgate"]
    assert PYPROJECT["project"]["scripts"]["specgate"] == "gateway.cli:app"
    assert "\napp = typer.Typer(" in (ROOT / "gateway" / "cli.py").read_text()
    assert json.loads(only(runtime, "CMD")) == ["serve", "--host", "0.0.0.0", "--port", "8000"]
    assert only(runtime, "EXPOSE") == "8000"
    assert '"/models"' in only(runtime, "VOLUME")


def test_runtime_user_is_the_non_root_uid_the_chart_expects() -> None:
    runtime = stages()[-1]
    assert only(runtime, "ARG") == "SPECGATE_UID=10001"
    assert only(runtime, "USER") == "${SPECGATE_UID}:${SPECGATE_UID}"
    helpers = (ROOT / "deploy" / "helm" / "specgate" / "templates" / "_helpers.tpl").read_text()
    assert "runAsUser: 10001" in helpers


def test_healthcheck_probes_healthz_with_python() -> None:
    healthcheck = only(stages()[-1], "HEALTHCHECK")
    options, _, command = healthcheck.partition(" CMD ")
    assert "--start-period=600s" in options
    probe = json.loads(command)
    assert probe[:2] == ["python", "-c"]
    assert "http://127.0.0.1:8000/healthz" in probe[2]


def test_healthcheck_command_fails_when_nothing_answers() -> None:
    probe = json.loads(only(stages()[-1], "HEALTHCHECK").partition(" CMD ")[2])
    result = subprocess.run(
        [sys.executable, "-c", probe[2].replace("127.0.0.1:8000", "127.0.0.1:9")],
        capture_output=True,
        check=False,
        timeout=30,
    )
    assert result.returncode != 0


@pytest.mark.timeout(300)
def test_copied_sources_build_a_wheel_with_the_cli_and_migrations(tmp_path: Path) -> None:
    """What the builder stage copies is enough for `pip install .`: the wheel names the console
    script and carries every migration, so `specgate db upgrade` works in the image."""
    context = tmp_path / "context"
    context.mkdir()
    for sources, _ in context_copies():
        for source in sources:
            origin = ROOT / source
            if origin.is_dir():
                shutil.copytree(
                    origin, context / source, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
                )
            else:
                shutil.copy2(origin, context / source)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path / "dist"),
            str(context),
        ],
        check=True,
        capture_output=True,
        timeout=240,
    )
    (wheel,) = (tmp_path / "dist").glob("specgate-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        assert "specgate = gateway.cli:app" in archive.read(entry_points).decode()
    migrations = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "migrations").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    assert migrations and migrations <= names
    assert "gateway/cli.py" in names


def test_no_model_weights_enter_the_build_context() -> None:
    """Models are mounted at /models, never copied into the image."""
    weight_suffixes = {".safetensors", ".bin", ".pt", ".gguf"}
    ignored = ROOT / "bench" / "results"  # excluded by .dockerignore
    for sources, _ in context_copies():
        for source in sources:
            origin = ROOT / source
            files = [origin] if origin.is_file() else list(origin.rglob("*"))
            weights = [f for f in files if f.suffix in weight_suffixes and ignored not in f.parents]
            assert weights == [], source
