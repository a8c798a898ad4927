"""Run every variant on every prompt, interleaved, and collect the timed runs."""

from __future__ import annotations

import functools
import os
import platform
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from rich.progress import Progress
from transformers import PreTrainedModel

from bench.costs import PassCosts, measure_pass_costs, median_costs
from bench.divergences import find_divergences
from bench.report import DivergenceTable, RunTable
from bench.variants import Generator, Run, Variant, hf_variants, specgate_variants
from bench.workload import BenchPrompt
from engine.api.types import Method, SamplingParams
from engine.config import EngineConfig, SpeculativeConfig
from engine.models.loading import load_model, pick_device
from engine.models.versioning import model_version
from engine.serving.service import Engine
from engine.speculation.divergence import ROUNDING_ULPS
from engine.speculation.proposers.vocabulary import load_head_vocabulary, restrict_head
from engine.training.heads.loading import load_heads_for
from engine.training.heads.vocabulary import extra_bytes


@dataclass(frozen=True)
class BenchSetup:
    target: Path
    draft: Path | None
    repeats: int
    fixed_k: int
    # Medusa and/or EAGLE heads directories; each beyond the first gets an engine of its own.
    heads: tuple[Path, ...] = ()


@dataclass
class BenchRun:
    variants: list[Variant]
    runs: RunTable
    costs: PassCosts
    header: dict[str, object]
    divergences: DivergenceTable
    extra_memory: dict[Method, float]


def _engine_config(
    setup: BenchSetup, draft: Path | None, heads: Path | None
) -> EngineConfig:
    # Fallback off: the benchmark measures each method itself, not the fallback policy.
    speculative = SpeculativeConfig(acceptance_threshold=0.0, min_speedup=0.0)
    return EngineConfig(target=setup.target, draft=draft, heads=heads, speculative=speculative)


def run_bench(setup: BenchSetup, prompts: list[BenchPrompt], engines: list[Engine]) -> BenchRun:
    """Each repeat visits every prompt; per prompt the variants run in a rotating order so that
    slow phases of a noisy machine fall on every variant alike. Pass costs are measured before
    each repeat and their medians kept. ``engines``: ``load_engines``'."""
    device = pick_device(None)
    target = load_model(setup.target, device, "auto")
    draft = load_model(setup.draft, device, "auto") if setup.draft else None
    engine_draft = _as_the_engine_runs_it(setup.draft, draft)
    serving = serving_engines(engines)
    methods: tuple[Method, ...] = tuple(serving)
    variants = specgate_variants(methods, setup.fixed_k) + hf_variants(methods)
    generator = Generator(serving, target, draft)
    engine = engines[0]
    context = list(prompts[0].prompt_ids)
    cost_samples = []
    # Each method's proposals as its engine makes them (the heads' are timed per proposal).
    proposers = {
        method: functools.partial(each.new_proposer, method)
        for method, each in serving.items()
        if method != "none"
    }

    def before_repeat(_repeat: int) -> None:
        cost_samples.append(
            measure_pass_costs(target, engine_draft, context, setup.fixed_k, proposers=proposers)
        )

    runs = interleaved_runs(generator, variants, prompts, setup.repeats, before_repeat)
    costs = median_costs(cost_samples)
    memory = extra_memory(setup, target, engine_draft, methods)
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
        "ulps at the logits' magnitude (engine.speculation.divergence)",
        "pass costs": (
            f"target {costs.target_one_ms:.2f} ms for 1 token, {costs.target_verify_ms:.2f} ms "
            f"for {costs.verify_tokens}; draft "
            f"{_fmt_ms(costs.draft_one_ms)} (c = {_fmt_ratio(costs.draft_cost_ratio)})"
        ),
        "heads": ", ".join(
            f"{d} ({_version_of(e.artefacts, k)[:19]}…)"
            for e in engines
            for d, k in _heads_of(e)
        )
        or "none",
        "extra memory": "what a method holds beside the target (draft model, heads, a "
        "draft vocabulary's copied head rows; not the KV cache) over the target's weights",
    }
    return BenchRun(variants, runs, costs, header, divergences, memory)


class VariantRunner(Protocol):
    """What runs one variant on one prompt: ``Generator``, or another backend's replay
    (``gateway.tune.vllm_pools.PoolReplay``: a vLLM pool over HTTP)."""

    def run(
        self,
        variant: Variant,
        prompt_ids: tuple[int, ...],
        max_tokens: int,
        sampling: SamplingParams | None = None,
    ) -> Run: ...


def interleaved_runs(
    generator: VariantRunner,
    variants: list[Variant],
    prompts: list[BenchPrompt],
    repeats: int,
    before_repeat: Callable[[int], None] | None = None,
    label: str = "benchmark",
) -> RunTable:
    """Every variant on every prompt, ``repeats`` times, keyed by (workload, name, variant).
    Each repeat visits every prompt; per prompt the variants run in a rotating order so that
    slow phases of a noisy machine fall on every variant alike. A prompt's ``sampling`` (none:
    greedy) applies to the Specgate variants."""
    runs: RunTable = defaultdict(list)
    total = repeats * len(prompts) * len(variants)
    with Progress() as progress:
        task = progress.add_task(label, total=total)
        for repeat in range(repeats):
            if before_repeat is not None:
                before_repeat(repeat)
            for index, prompt in enumerate(prompts):
                shift = (repeat + index) % len(variants)
                for variant in variants[shift:] + variants[:shift]:
                    run = generator.run(
                        variant, prompt.prompt_ids, prompt.max_tokens, prompt.sampling
                    )
                    runs[(prompt.workload, prompt.name, variant)].append(run)
                    progress.advance(task)
    return dict(runs)


def serving_engines(engines: list[Engine]) -> dict[Method, Engine]:
    """The engine serving each method: the first that offers it."""
    serving: dict[Method, Engine] = {}
    for engine in engines:
        for method in engine.available_methods:
            serving.setdefault(method, engine)
    return serving


def _heads_of(engine: Engine) -> list[tuple[Path, str]]:
    heads = engine.config.heads
    kinds = [a["kind"] or "" for a in engine.artefacts if (a["kind"] or "").endswith("_heads")]
    return [(heads, kind) for kind in kinds] if heads is not None else []


def extra_memory(
    setup: BenchSetup,
    target: PreTrainedModel,
    draft: PreTrainedModel | None,
    methods: tuple[Method, ...],
) -> dict[Method, float]:
    """Each method's extra memory as a share of the target's weights: the draft as the engine
    runs it, the heads with their draft vocabulary (``extra_bytes``), nothing for n-gram."""
    target_bytes = extra_bytes(target)
    version = model_version(setup.target)
    shares: dict[Method, float] = {}
    for method in methods:
        if method == "ngram":
            shares[method] = 0.0
        elif method == "draft" and draft is not None:
            shares[method] = extra_bytes(draft) / target_bytes
    for directory in setup.heads:
        method, module = load_heads_for(directory, target, version)
        if method in methods:
            shares[method] = extra_bytes(module) / target_bytes
    return shares


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
    """The engine with the draft and the first heads directory."""
    return Engine.load(_engine_config(setup, setup.draft, setup.heads[0] if setup.heads else None))


def load_engines(setup: BenchSetup) -> list[Engine]:
    """``load_engine``'s, and one more for each further heads directory (an engine serves
    one)."""
    engines = [load_engine(setup)]
    try:
        for heads in setup.heads[1:]:
            engines.append(Engine.load(_engine_config(setup, None, heads)))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines


def _version_of(artefacts: tuple[dict[str, str | None], ...], kind: str) -> str:
    return next((a["version"] or "" for a in artefacts if a["kind"] == kind), "")
