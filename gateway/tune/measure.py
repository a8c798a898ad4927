"""Replay a sample of requests offline through plain decoding and every available method and
k on each configured built-in target (the benchmark's loop, ``bench.runner.interleaved_runs``,
with each engine's fallback off so that every method is measured itself), or on each pool of a
vLLM-served model (``gateway.tune.vllm_pools``), and turn the timed runs into figures per
workload cluster: tokens/s, latency percentiles, acceptance rate, mean accepted length, and
the speedup over plain decoding with a bootstrap interval over requests.

The figures name requests by their `request` event id (or file line) only: no prompt or
completion text, and no token, leaves this module.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from bench.report import RunTable
from bench.variants import Generator, Run, Variant
from bench.workload import BenchPrompt
from engine.api.types import MAX_SPECULATIVE_TOKENS, Method, SamplingParams
from engine.serving.service import Engine
from gateway.settings import Settings
from gateway.tune.sample import TuneRequest

ALL = "all"
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0
DEFAULT_KS = (2, 4, 8)


@dataclass(frozen=True)
class TuneModel:
    """A configured built-in model: the names requests route to it by, its artefacts and the
    method it serves with."""

    name: str
    aliases: tuple[str, ...]
    target: Path
    draft: Path | None
    heads: Path | None
    method: Method

    def serves(self, name: str | None) -> bool:
        return name == self.name or name in self.aliases


@dataclass(frozen=True)
class VllmPool:
    """One pool of a vLLM-served model as measured: the first server configured for it
    (``url``), its speculative configuration (None: the plain pool), and the method and k
    that configuration serves (a running server's k cannot be varied)."""

    url: str
    speculative_config: dict[str, Any] | None
    method: Method
    k: int | None


@dataclass(frozen=True)
class VllmModel:
    """A configured vLLM-served model: the names requests route to it by, the name its
    servers serve it under, its version, context and vocabulary, and its pools (plain first)."""

    name: str
    aliases: tuple[str, ...]
    vllm_name: str
    target: str
    version: str
    max_context: int
    vocab_size: int
    pools: tuple[VllmPool, ...]

    def serves(self, name: str | None) -> bool:
        return name == self.name or name in self.aliases


def configured_models(settings: Settings) -> list[TuneModel]:
    """The built-in (``local``) models the settings serve; vLLM-served models are measured on
    their pools (``gateway.tune.vllm_pools.configured_vllm_models``)."""
    from gateway.settings import engine_config

    found = []
    for model in settings.configured_models():
        if model.settings.backend.kind != "local":
            continue
        config = engine_config(model.settings)
        name = config.served_model_name or config.target.name
        found.append(
            TuneModel(
                name, model.aliases, config.target, config.draft, config.heads,
                config.speculative.method,
            )
        )
    return found


def assign(
    requests: Sequence[TuneRequest], models: Sequence[TuneModel | VllmModel]
) -> tuple[dict[str, list[TuneRequest]], Counter[str]]:
    """Each request to the model it named; with one model configured, every request to it.
    Requests for a model not configured here are counted as ``model_not_configured``."""
    assigned: dict[str, list[TuneRequest]] = {model.name: [] for model in models}
    skipped: Counter[str] = Counter()
    for request in requests:
        if len(models) == 1:
            assigned[models[0].name].append(request)
            continue
        model = next((m for m in models if m.serves(request.model)), None)
        if model is None:
            skipped["model_not_configured"] += 1
        else:
            assigned[model.name].append(request)
    return assigned, skipped


@dataclass(frozen=True)
class PoolVariant(Variant):
    """A vLLM pool as configured, run on its server (``url``); ``k`` is the pool's own."""

    url: str = ""

    @property
    def label(self) -> str:
        return f"{super().label} ({self.url})"


def pool_variants(model: VllmModel) -> list[Variant]:
    """One variant per pool of ``model``, the plain pool first."""
    return [PoolVariant("specgate", pool.method, pool.k, pool.url) for pool in model.pools]


def tune_variants(methods: Sequence[Method], ks: Sequence[int]) -> list[Variant]:
    """Plain decoding, then each method with adaptive k and with every fixed k."""
    variants = [Variant("specgate", "none", None)]
    for method in methods:
        if method == "none":
            continue
        variants.append(Variant("specgate", method, None))
        fixed = sorted(k for k in set(ks) if 1 <= k <= MAX_SPECULATIVE_TOKENS)
        variants += [Variant("specgate", method, k) for k in fixed]
    return variants


@dataclass
class ModelRun:
    """One model's measurement: what was loaded (or, for a vLLM-served model, what its
    servers serve), the variants, the prompts and timed runs."""

    model: TuneModel | VllmModel
    target_version: str
    dtype: str
    methods: list[Method]
    variants: list[Variant]
    prompts: list[BenchPrompt]
    runs: RunTable
    skipped: Counter[str]


def measure_model(
    model: TuneModel,
    requests: Sequence[TuneRequest],
    ks: Sequence[int],
    repeats: int,
    max_tokens: int,
) -> ModelRun:
    """Load ``model``'s engines (one per heads directory, fallback off) and time every
    variant on every request it can take; a request whose prompt does not fit the context, or
    holds tokens the target does not know (recorded with another tokenizer), is counted."""
    from bench.runner import BenchSetup, interleaved_runs, load_engines, serving_engines

    setup = BenchSetup(
        target=model.target,
        draft=model.draft,
        repeats=repeats,
        fixed_k=min(ks, default=4),
        heads=(model.heads,) if model.heads is not None else (),
    )
    engines = load_engines(setup)
    try:
        engine = engines[0]
        serving = serving_engines(engines)
        methods = [m for m in serving if m != "none"]
        variants = tune_variants(methods, ks)
        prompts, skipped = bench_prompts(requests, engine, max_tokens)
        generator = Generator(serving, engine.target_model, None)
        runs = (
            interleaved_runs(generator, variants, prompts, repeats, label=f"tune {model.name}")
            if prompts
            else {}
        )
        return ModelRun(
            model,
            engine.target_version,
            str(engine.target_dtype).removeprefix("torch."),
            methods,
            variants,
            prompts,
            runs,
            skipped,
        )
    finally:
        for each in engines:
            each.close()


def prompt_ids(request: TuneRequest, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...] | None:
    """A request's prompt tokens: as recorded, or its body tokenized by the target's
    tokenizer (chat template for ``messages``); None for a body that is no request."""
    from bench.workload import encode_request

    if request.prompt_ids is not None:
        return request.prompt_ids
    assert request.body is not None
    try:
        return tuple(encode_request(request.body, tokenizer))
    except (ValueError, TypeError, KeyError):
        return None


def bench_prompts(
    requests: Sequence[TuneRequest], engine: Engine, max_tokens: int
) -> tuple[list[BenchPrompt], Counter[str]]:
    """The requests ``engine`` can replay (``replayable``)."""
    return replayable(
        requests,
        lambda request: prompt_ids(request, engine.tokenizer),
        engine.max_context,
        engine.vocab_size,
        max_tokens,
    )


def replayable(
    requests: Sequence[TuneRequest],
    ids_of: Callable[[TuneRequest], tuple[int, ...] | None],
    max_context: int,
    vocab_size: int,
    max_tokens: int,
) -> tuple[list[BenchPrompt], Counter[str]]:
    """The requests a target can replay, as the benchmark's prompts (cluster, id, tokens by
    ``ids_of``, capped sampling); one that is no request (``ids_of`` gives None), whose
    prompt does not fit the context, or that holds tokens the target does not know (recorded
    with another tokenizer), is counted by reason."""
    prompts: list[BenchPrompt] = []
    skipped: Counter[str] = Counter()
    for request in requests:
        ids = ids_of(request)
        if ids is None:
            skipped["not_a_request"] += 1
            continue
        sampling = request.sampling_params(max_tokens)
        if not ids or len(ids) + sampling.max_tokens > max_context:
            skipped["too_long_for_the_context"] += 1
            continue
        if max(ids) >= vocab_size:
            skipped["tokens_unknown_to_the_target"] += 1
            continue
        prompts.append(
            BenchPrompt(request.cluster, request.source_id, ids, sampling.max_tokens, sampling)
        )
    return prompts, skipped


@dataclass(frozen=True)
class ArtefactVariant(Variant):
    """A method served from one of several artefact directories (``artefact`` names which)."""

    artefact: str = ""

    @property
    def label(self) -> str:
        return f"{super().label} ({self.artefact})"


class _ArtefactGenerator(Generator):
    """Runs each variant on the engine that holds its artefact."""

    def __init__(self, engines: dict[Variant, Engine], target: PreTrainedModel):
        super().__init__({}, target, None)
        self.by_variant = engines

    def run(
        self,
        variant: Variant,
        prompt_ids: tuple[int, ...],
        max_tokens: int,
        sampling: SamplingParams | None = None,
    ) -> Run:
        self.engines = {variant.method: self.by_variant[variant]}
        return super().run(variant, prompt_ids, max_tokens, sampling)


def measure_artefacts(
    model: TuneModel,
    method: Method,
    artefacts: dict[str, Path],
    requests: Sequence[TuneRequest],
    k: int,
    repeats: int,
    max_tokens: int,
) -> ModelRun:
    """Plain decoding and ``method`` at ``k`` from each of ``artefacts`` (name: heads or, for
    ``draft``, draft model directory; one engine each, fallback off), interleaved on
    ``requests`` as ``measure_model`` does; the variants are ``ArtefactVariant``s named after
    their artefacts."""
    from bench.runner import interleaved_runs

    engines = _artefact_engines(model.target, method, tuple(artefacts.values()), k, repeats)
    try:
        plain = Variant("specgate", "none", None)
        by_variant: dict[Variant, Engine] = {plain: engines[0]}
        for name, engine in zip(artefacts, engines, strict=True):
            if method not in engine.available_methods:
                raise ValueError(f"the {name} artefact does not serve {method}")
            by_variant[ArtefactVariant("specgate", method, k, name)] = engine
        prompts, skipped = bench_prompts(requests, engines[0], max_tokens)
        generator = _ArtefactGenerator(by_variant, engines[0].target_model)
        variants = list(by_variant)
        runs = (
            interleaved_runs(generator, variants, prompts, repeats, label=f"held out {model.name}")
            if prompts
            else {}
        )
        return ModelRun(
            model,
            engines[0].target_version,
            str(engines[0].target_dtype).removeprefix("torch."),
            [method],
            variants,
            prompts,
            runs,
            skipped,
        )
    finally:
        for each in engines:
            each.close()


def _artefact_engines(
    target: Path, method: Method, directories: tuple[Path, ...], k: int, repeats: int
) -> list[Engine]:
    """One engine per directory: serving it as its heads, or as its draft for ``draft``."""
    from bench.runner import BenchSetup, load_engine, load_engines

    if method != "draft":
        return load_engines(BenchSetup(target, None, repeats, k, heads=directories))
    engines: list[Engine] = []
    try:
        for draft in directories:
            engines.append(load_engine(BenchSetup(target, draft, repeats, k)))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines


# --- figures -------------------------------------------------------------------------------


def _k_label(k: int | None) -> int | str:
    return "auto" if k is None else k


def _percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between order statistics."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class _PerRequest:
    tokens: int
    seconds: float  # median over repeats
    ttft: float
    drafts: int
    draft_tokens: int
    accepted: int


def _per_request(runs: list[Run]) -> _PerRequest:
    seconds = statistics.median(run.seconds for run in runs)
    stats = [run.stats for run in runs if run.stats is not None]
    return _PerRequest(
        tokens=len(runs[0].token_ids),
        seconds=seconds,
        ttft=statistics.median(s.time_to_first_token_s for s in stats) if stats else 0.0,
        drafts=sum(s.num_drafts for s in stats),
        draft_tokens=sum(s.num_draft_tokens for s in stats),
        accepted=sum(s.num_accepted_tokens for s in stats),
    )


def _rate(tokens: Sequence[int], seconds: Sequence[float], picks: Sequence[int]) -> float:
    total = sum(seconds[i] for i in picks)
    return sum(tokens[i] for i in picks) / total if total > 0 else 0.0


def speedup_interval(
    plain: Sequence[_PerRequest],
    variant: Sequence[_PerRequest],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
) -> tuple[float, float, float]:
    """The speedup in tokens/s over plain decoding on the same requests, and its 95 %
    percentile bootstrap interval over requests (requests drawn with replacement)."""
    n = len(plain)
    p_tok, p_sec = [r.tokens for r in plain], [r.seconds for r in plain]
    v_tok, v_sec = [r.tokens for r in variant], [r.seconds for r in variant]
    everything = range(n)

    def ratio(picks: Sequence[int]) -> float:
        base = _rate(p_tok, p_sec, picks)
        return _rate(v_tok, v_sec, picks) / base if base > 0 else 0.0

    point = ratio(everything)
    rng = random.Random(seed)
    draws = sorted(ratio([rng.randrange(n) for _ in everything]) for _ in range(resamples))
    return point, _percentile(draws, 0.025), _percentile(draws, 0.975)


def figures(run: ModelRun) -> list[dict[str, Any]]:
    """Per cluster (and ``all``), one row per variant: the figures the report shows."""
    by_cluster: dict[str, list[BenchPrompt]] = defaultdict(list)
    for prompt in run.prompts:
        by_cluster[prompt.workload].append(prompt)
    clusters = [(ALL, run.prompts), *sorted(by_cluster.items())]
    if len(by_cluster) == 1:
        clusters = clusters[:1]
    plain_variant = run.variants[0]
    out = []
    for name, prompts in clusters:
        per = {
            variant: [
                _per_request(run.runs[(p.workload, p.name, variant)]) for p in prompts
            ]
            for variant in run.variants
        }
        rows = []
        for variant in run.variants:
            rows.append(_row(variant, per[variant], per[plain_variant]))
        out.append({"cluster": name, "requests": len(prompts), "rows": rows})
    return out


def _row(
    variant: Variant, measured: list[_PerRequest], plain: list[_PerRequest]
) -> dict[str, Any]:
    tokens = sum(r.tokens for r in measured)
    seconds = sum(r.seconds for r in measured)
    latencies = [r.seconds for r in measured]
    drafts = sum(r.drafts for r in measured)
    draft_tokens = sum(r.draft_tokens for r in measured)
    accepted = sum(r.accepted for r in measured)
    speculative = variant.method != "none"
    speedup, low, high = speedup_interval(plain, measured)
    return {
        "variant": variant.label,
        "method": variant.method,
        "k": _k_label(variant.k) if speculative else None,
        "requests": len(measured),
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_second": round(tokens / seconds, 2) if seconds > 0 else 0.0,
        "latency_p50_s": round(_percentile(latencies, 0.5), 4),
        "latency_p90_s": round(_percentile(latencies, 0.9), 4),
        "latency_p99_s": round(_percentile(latencies, 0.99), 4),
        "ttft_p50_s": round(_percentile([r.ttft for r in measured], 0.5), 4),
        "acceptance_rate": (
            round(accepted / draft_tokens, 4) if speculative and draft_tokens else
            (0.0 if speculative else None)
        ),
        "mean_accepted_length": (
            round(1.0 + accepted / drafts, 3) if speculative and drafts else
            (1.0 if speculative else None)
        ),
        "draft_tokens": draft_tokens if speculative else None,
        "speedup": round(speedup, 3),
        "speedup_low": round(low, 3),
        "speedup_high": round(high, 3),
    }


def machine() -> str:
    import torch

    return (
        f"{platform.machine()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"torch {torch.__version__}"
    )
