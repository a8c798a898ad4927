"""Turn timed runs into figures: tokens/s, speedups, acceptance, theoretical speedup,
the recommendation, and the JSON, Markdown and PNG outputs."""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bench.costs import PassCosts
from bench.variants import Run, Variant
from engine.api.types import GenerationStats, Method
from engine.speculation.adaptive import pass_cost_speedup
from engine.speculation.divergence import Divergence

ALL_WORKLOADS = "all"
# Below this measured speedup a method is not worth switching on.
WORTHWHILE_SPEEDUP = 1.05


def theoretical_speedup(stats: GenerationStats, costs: PassCosts, cost_ratio: float) -> float:
    """The speedup the measured acceptance gives if the target passes and the proposer cost
    what ``costs`` measured and nothing else took time
    (``engine.speculation.adaptive.pass_cost_speedup``, in one-token target passes): a verifying
    pass of m + 1 rows interpolated between the
    measured 1 and ``costs.verify_tokens`` rows, a proposed token ``cost_ratio``
    (``PassCosts.proposer_ratio``: a heads method's whole proposal, its draft passes per tree
    level included), a pass that proposed nothing one. ``stats``: the pooled counts of a
    method's runs."""
    passes = max(stats.num_target_passes, stats.num_drafts)
    mean_k = stats.num_draft_tokens / stats.num_drafts if stats.num_drafts else 0.0
    verify_ratio = costs.target_verify_ms / costs.target_one_ms
    verify = 1.0 + max(0.0, verify_ratio - 1.0) * mean_k / max(costs.verify_tokens - 1, 1)
    return pass_cost_speedup(
        stats.num_draft_tokens, stats.num_accepted_tokens, stats.num_drafts, passes,
        verify, cost_ratio, 1.0,
    )


@dataclass(frozen=True)
class Row:
    workload: str
    variant: Variant
    tokens: int
    seconds: float  # sum over prompts of the median over repeats
    speedup: float
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    mean_k: float | None
    theoretical: float | None
    same_tokens_as_plain: bool
    # The first divergence of every run whose tokens differ from plain decoding's.
    divergences: tuple[Divergence, ...] = ()
    # What the method holds beside the target, as a share of the target's weights (None:
    # plain decoding, Hugging Face's rows).
    extra_memory: float | None = None

    @property
    def first_divergence(self) -> int | None:
        return min((d.position for d in self.divergences), default=None)

    @property
    def largest_gap(self) -> Divergence | None:
        """The divergence with the widest plain-decoding logit gap."""
        return max(self.divergences, key=lambda d: d.plain_gap, default=None)

    @property
    def within_rounding(self) -> bool | None:
        """Whether every divergence is a near-tie within the dtype's rounding (None: none)."""
        if not self.divergences:
            return None
        return all(d.within_rounding for d in self.divergences)

    @property
    def lossless_in_dtype(self) -> bool:
        """Token-identical to plain decoding, or different only at near-ties within rounding."""
        return self.same_tokens_as_plain or bool(self.within_rounding)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def of_theoretical(self) -> float | None:
        return self.speedup / self.theoretical if self.theoretical else None

    def as_dict(self) -> dict[str, object]:
        return {
            "workload": self.workload,
            "variant": self.variant.label,
            "backend": self.variant.backend,
            "method": self.variant.method,
            "k": self.variant.k,
            "tokens": self.tokens,
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "speedup": round(self.speedup, 3),
            "acceptance_rate": _round(self.acceptance_rate),
            "mean_acceptance_length": _round(self.mean_acceptance_length),
            "mean_k": _round(self.mean_k),
            "extra_memory_share_of_target": _round4(self.extra_memory),
            "theoretical_speedup": _round(self.theoretical),
            "of_theoretical": _round(self.of_theoretical),
            "same_tokens_as_plain": self.same_tokens_as_plain,
            "first_divergence": self.first_divergence,
            "largest_logit_gap": _round(self.largest_gap.plain_gap) if self.largest_gap else None,
            "within_rounding": self.within_rounding,
            "divergences": [d.as_dict() for d in self.divergences],
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _round4(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


# (workload, prompt name, variant) -> runs over repeats
RunTable = dict[tuple[str, str, Variant], list[Run]]
# (workload, prompt name, variant) -> first divergences from plain decoding
DivergenceTable = dict[tuple[str, str, Variant], list[Divergence]]


def summarise(
    runs: RunTable, variants: list[Variant], costs: PassCosts,
    divergences: DivergenceTable | None = None,
    extra_memory: Mapping[Method, float] | None = None,
) -> list[Row]:
    """One row per workload and variant, plus all workloads combined when there are several.
    ``extra_memory``: each method's memory beside the target as a share of the target's
    (``bench.runner.extra_memory``)."""
    baseline = Variant("specgate", "none", None)
    workloads = sorted({workload for workload, _, _ in runs})
    if len(workloads) > 1:
        workloads.append(ALL_WORKLOADS)
    rows: list[Row] = []
    for workload in workloads:
        keys = sorted(
            (w, p) for w, p, _ in runs if workload in (w, ALL_WORKLOADS)
        )
        keys = list(dict.fromkeys(keys))
        base_seconds = sum(statistics.median(r.seconds for r in runs[(w, p, baseline)])
                           for w, p in keys)
        base_tokens = sum(len(runs[(w, p, baseline)][0].token_ids) for w, p in keys)
        # Tokens per second over plain decoding's, not time over time: a near-tie that
        # changes an output changes its length too, and a shorter answer is not a faster one.
        base_rate = base_tokens / base_seconds if base_seconds > 0 else 0.0
        for variant in variants:
            row = _row(workload, variant, keys, runs, base_rate, baseline, costs)
            found = tuple(
                d for w, p in keys for d in (divergences or {}).get((w, p, variant), [])
            )
            memory = (
                (extra_memory or {}).get(variant.method)
                if variant.backend == "specgate" and variant.method != "none"
                else None
            )
            rows.append(dataclasses.replace(row, divergences=found, extra_memory=memory))
    return rows


def _row(
    workload: str, variant: Variant, keys: list[tuple[str, str]], runs: RunTable,
    base_rate: float, baseline: Variant, costs: PassCosts,
) -> Row:
    chosen = [runs[(w, p, variant)] for w, p in keys]
    seconds = sum(statistics.median(r.seconds for r in repeats) for repeats in chosen)
    tokens = sum(len(repeats[0].token_ids) for repeats in chosen)
    same = all(
        run.token_ids == runs[(w, p, baseline)][0].token_ids
        for (w, p), repeats in zip(keys, chosen, strict=True)
        for run in repeats
    )
    total = GenerationStats(method=variant.method)
    for repeats in chosen:
        for run in repeats:
            if run.stats is not None:
                total.add_counts(run.stats)
    drafts = total.num_drafts
    alpha = total.acceptance_rate if total.num_draft_tokens else None
    mean_k = total.num_draft_tokens / drafts if drafts else None
    cost_ratio = costs.proposer_ratio(variant.method, mean_k or 0.0)
    theoretical = (
        theoretical_speedup(total, costs, cost_ratio)
        if drafts and cost_ratio is not None and variant.backend == "specgate"
        else None
    )
    return Row(
        workload=workload,
        variant=variant,
        tokens=tokens,
        seconds=seconds,
        speedup=tokens / seconds / base_rate if seconds > 0 and base_rate > 0 else 0.0,
        acceptance_rate=alpha,
        mean_acceptance_length=total.mean_acceptance_length if drafts else None,
        mean_k=mean_k,
        theoretical=theoretical,
        same_tokens_as_plain=same,
    )


def recommend(rows: list[Row], workload: str) -> str:
    """The Specgate variant with the best measured speedup among those lossless in the dtype,
    or plain decoding; any divergence beyond rounding is called out first as a bug."""
    speculative = [
        r for r in rows
        if r.workload == workload and r.variant.backend == "specgate" and r.variant.method != "none"
    ]
    bugs = "".join(_bug(r) for r in speculative if r.within_rounding is False)
    candidates = [r for r in speculative if r.lossless_in_dtype]
    best = max(candidates, key=lambda r: r.speedup, default=None)
    if best is None or best.speedup < WORTHWHILE_SPEEDUP:
        return (
            f"{bugs}{workload}: keep plain decoding (`--method none`); no speculative method "
            f"reached {WORTHWHILE_SPEEDUP}x here."
        )
    if best.variant.k is None:
        k_text = "adaptive K (leave `--num-speculative-tokens` unset"
        k_text += f"; it averaged {best.mean_k:.1f} proposals per step)" if best.mean_k else ")"
    else:
        k_text = f"`--num-speculative-tokens {best.variant.k}`"
    acceptance = (
        f", acceptance rate {best.acceptance_rate:.2f}" if best.acceptance_rate is not None else ""
    )
    return (
        f"{bugs}{workload}: use `--method {best.variant.method}` with {k_text}: expected speedup "
        f"{best.speedup:.2f}x over plain decoding{acceptance}.{_near_ties(best)}"
    )


def _bug(row: Row) -> str:
    worst = row.largest_gap
    assert worst is not None
    return (
        f"**BUG: `{row.variant.label}` is not lossless** ({row.workload}): its greedy output "
        f"left plain decoding's at token {worst.position} where the target's logit gap was "
        f"{worst.plain_gap:.4g}, wider than {worst.dtype} rounding ({worst.bound:.4g}); "
        "please report it. "
    )


def _near_ties(row: Row) -> str:
    worst = row.largest_gap
    if worst is None:
        return ""
    return (
        f" Its tokens differ from plain decoding's in {len(row.divergences)} run(s), each "
        f"first at a near-tie within {worst.dtype} rounding (largest logit gap "
        f"{worst.plain_gap:.4g}, bound {worst.bound:.4g}): lossless in {worst.dtype}; "
        "`--dtype float32` gives bit-exact greedy output."
    )


def _fmt(value: float | None, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def markdown(rows: list[Row], header: dict[str, object]) -> str:
    lines = ["# Specgate benchmark", ""]
    lines += [f"- {key}: {value}" for key, value in header.items()]
    lines += [
        "",
        "| workload | method | tokens/s | speedup | acceptance rate | mean acceptance length "
        "| extra memory | theoretical speedup | of theoretical | same tokens as plain "
        "| first divergence | logit gap | within rounding |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|:-:|---:|---:|:-:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.workload} | {r.variant.label} | {r.tokens_per_second:.1f} | "
            f"{r.speedup:.2f}x | {_fmt(r.acceptance_rate, '{:.2f}')} | "
            f"{_fmt(r.mean_acceptance_length, '{:.2f}')} | {_fmt(r.extra_memory, '{:.1%}')} | "
            f"{_fmt(r.theoretical, '{:.2f}x')} | "
            f"{_fmt(r.of_theoretical, '{:.0%}')} | {'yes' if r.same_tokens_as_plain else 'no'} | "
            f"{_fmt(r.first_divergence, '{}')} | "
            f"{_fmt(r.largest_gap.plain_gap if r.largest_gap else None, '{:.4g}')} | "
            f"{_within(r.within_rounding)} |"
        )
    workloads = list(dict.fromkeys(r.workload for r in rows))
    lines += ["", "## Recommendation", ""]
    lines += [f"- {recommend(rows, w)}" for w in workloads]
    return "\n".join(lines) + "\n"


def _within(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "**NO: bug**"


def chart(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in rows))
    labels = list(dict.fromkeys(r.variant.label for r in rows))
    width = 0.8 / len(workloads)
    figure, axes = plt.subplots(figsize=(max(6.0, 1.1 * len(labels)), 4.0))
    for index, workload in enumerate(workloads):
        speedups = {r.variant.label: r.speedup for r in rows if r.workload == workload}
        positions = [i + (index - (len(workloads) - 1) / 2) * width for i in range(len(labels))]
        axes.bar(positions, [speedups.get(label, 0.0) for label in labels], width, label=workload)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(labels)), labels, rotation=30, ha="right")
    axes.set_ylabel("speedup over plain decoding (greedy)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_outputs(
    out: Path, rows: list[Row], header: dict[str, object], costs: PassCosts,
    runs: RunTable,
) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "bench.json", "markdown": out / "bench.md", "chart": out / "bench.png"}
    workloads = list(dict.fromkeys(r.workload for r in rows))
    document = {
        **header,
        "pass_costs": costs.as_dict(),
        "rows": [r.as_dict() for r in rows],
        "recommendations": {w: recommend(rows, w) for w in workloads},
        "runs": [
            {
                "workload": w, "prompt": p, "variant": v.label, "repeat": i,
                "seconds": round(run.seconds, 5), "tokens": len(run.token_ids),
                "stats": run.stats.as_dict() if run.stats else None,
            }
            for (w, p, v), repeats in runs.items()
            for i, run in enumerate(repeats)
        ],
    }
    paths["json"].write_text(json.dumps(document, indent=2) + "\n")
    paths["markdown"].write_text(markdown(rows, header))
    chart(rows, paths["chart"])
    return paths
