"""Run every variant on every prompt, interleaved, and collect the timed runs."""

from __future__ import annotations

import os
import platform
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import Progress
from transformers import PreTrainedModel

from bench.costs import PassCosts, measure_pass_costs, median_costs
from bench.divergences import find_divergences
from bench.report import DivergenceTable, RunTable
from bench.variants import Generator, Variant, hf_variants, specgate_variants
from bench.workload import BenchPrompt
from engine.config import EngineConfig, SpeculativeConfig
from engine.divergence import ROUNDING_ULPS
from engine.loading import load_model, pick_device
from engine.proposers.vocabulary import load_head_vocabulary, restrict_head
from engine.service import Engine
from engine.types import Method


@dataclass(frozen=True)
class BenchSetup:
    target: Path
    draft: Path | None
    repeats: int
    fixed_k: int
    heads: Path | None = None


@dataclass
class BenchRun:
    variants: list[Variant]
    runs: RunTable
    costs: PassCosts
    header: dict[str, object]
    divergences: DivergenceTable


def _engine_config(setup: BenchSetup) -> EngineConfig:
    # Fallback off: the benchmark measures each method itself, not the fallback policy.
    speculative = SpeculativeConfig(acceptance_threshold=0.0, min_speedup=0.0)
    return EngineConfig(
        target=setup.target, draft=setup.draft, heads=setup.heads, speculative=speculative
    )


def run_bench(setup: BenchSetup, prompts: list[BenchPrompt], engine: Engine) -> BenchRun:
    """Each repeat visits every prompt; per prompt the variants run in a rotating order so that
    slow phases of a noisy machine fall on every variant alike. Pass costs are measured before
    each repeat and their medians kept."""
    device = pick_device(None)
    target = load_model(setup.target, device, "auto")
    draft = load_model(setup.draft, device, "auto") if setup.draft else None
    engine_draft = _as_the_engine_runs_it(setup.draft, draft)
    methods: tuple[Method, ...] = engine.available_methods
    variants = specgate_variants(methods, setup.fixed_k) + hf_variants(methods)
    generator = Generator(engine, target, draft)
    context = list(prompts[0].prompt_ids)
    cost_samples = []

    runs: RunTable = defaultdict(list)
    total = setup.repeats * len(prompts) * len(variants)
    with Progress() as progress:
        task = progress.add_task("benchmark", total=total)
        for repeat in range(setup.repeats):
            cost_samples.append(
                measure_pass_costs(target, engine_draft, context, setup.fixed_k)
            )
            for index, prompt in enumerate(prompts):
                shift = (repeat + index) % len(variants)
                for variant in variants[shift:] + variants[:shift]:
                    run = generator.run(variant, prompt.prompt_ids, prompt.max_tokens)
                    runs[(prompt.workload, prompt.name, variant)].append(run)
                    progress.advance(task)
    costs = median_costs(cost_samples)
    divergences = find_divergences(
        target, runs, prompts, Variant("specgate", "none", None), setup.fixed_k + 1
    )
    header: dict[str, object] = {
        "target": f"{setup.target} ({engine.target_version[:19]}…, {target.dtype})",
        "draft": (
            f"{setup.draft} ({_version_of(engine.artefacts, 'draft_model')[:19]}…, "
            f"{draft.dtype})"
            if draft is not None
            else "none"
        ),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads "
        f"{torch.get_num_threads()}, torch {torch.__version__}",
        "prompts": f"{len(prompts)} ({', '.join(sorted({p.workload for p in prompts}))})",
        "repeats": setup.repeats,
        "decoding": "greedy; medians over repeats; methods interleaved per prompt",
        "divergences": "first token differing from plain decoding; logit gap there as plain "
        f"decoding computed it, within rounding if at most {ROUNDING_ULPS:g} "
        f"{str(target.dtype).removeprefix('torch.')} "
        "ulps at the logits' magnitude (engine.divergence)",
        "pass costs": (
            f"target {costs.target_one_ms:.2f} ms for 1 token, {costs.target_verify_ms:.2f} ms "
            f"for {costs.verify_tokens}; draft "
            f"{_fmt_ms(costs.draft_one_ms)} (c = {_fmt_ratio(costs.draft_cost_ratio)})"
        ),
    }
    return BenchRun(variants, dict(runs), costs, header, divergences)


def _as_the_engine_runs_it(
    draft_dir: Path | None, draft: PreTrainedModel | None
) -> PreTrainedModel | None:
    """The draft with its head cut to its vocabulary subset, if it has one, as the engine
    serves it (Hugging Face's assisted generation runs the full-vocabulary head)."""
    if draft_dir is None or draft is None:
        return draft
    vocabulary = load_head_vocabulary(draft_dir, draft.config.vocab_size)
    if vocabulary is None:
        return draft
    restricted = load_model(draft_dir, draft.device, "auto")
    restrict_head(restricted, vocabulary)
    return restricted


def _fmt_ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} ms"


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def load_engine(setup: BenchSetup) -> Engine:
    return Engine.load(_engine_config(setup))


def _version_of(artefacts: tuple[dict[str, str | None], ...], kind: str) -> str:
    return next((a["version"] or "" for a in artefacts if a["kind"] == kind), "")
