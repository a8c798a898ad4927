"""From a tuning report's figures: the method and k to serve each model (and each workload
cluster) with, the expected speedup with its interval, and where speculation should be off;
and the configuration change that applies it.

A method is recommended only where its speedup interval lies wholly above 1 (a gain shown
beyond the uncertainty over requests); where every method's whole interval is below 1 it is
``off`` (it slows that traffic down); where the interval holds 1 no gain is shown and plain
decoding stays (``no_gain_shown``). Among the methods that qualify, the best point speedup
wins.
"""

from __future__ import annotations

from typing import Any

import yaml

# The acceptance rate under which the advice is to fine-tune the proposer or lower k.
ACCEPTANCE_FLOOR = 0.6
# n-gram lookup gaining less than this suggests a draft model or EAGLE heads.
NGRAM_LITTLE = 1.1


def recommend(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The recommendation for one cluster's rows (``gateway.tune.measure.figures``)."""
    speculative = [row for row in rows if row["method"] != "none"]
    best = max(speculative, key=lambda row: row["speedup"], default=None)
    shown = [row for row in speculative if row["speedup_low"] > 1.0]
    chosen = max(shown, key=lambda row: row["speedup"], default=None)
    advice: list[str] = []
    pick: dict[str, Any] | None
    if chosen is not None:
        verdict, pick = "on", chosen
    elif speculative and all(row["speedup_high"] < 1.0 for row in speculative):
        verdict, pick = "off", best
        advice.append("every method slows this traffic down: serve it with plain decoding")
    else:
        verdict, pick = "no_gain_shown", best
        if best is not None:
            advice.append(
                "no method's gain is shown beyond the uncertainty: plain decoding stays "
                "(measure more requests or repeats to narrow the interval)"
            )
    for method in sorted({row["method"] for row in speculative}):
        own = [row for row in speculative if row["method"] == method]
        top = max(own, key=lambda row: row["speedup"])
        rate = top["acceptance_rate"]
        if rate is not None and rate < ACCEPTANCE_FLOOR:
            remedy = (
                "propose fewer tokens (a lower k), or try a draft model or EAGLE heads"
                if method == "ngram"
                else "fine-tune it on this kind of text, or propose fewer tokens (a lower k)"
            )
            advice.append(
                f"{method}: acceptance {rate:.0%} is under {ACCEPTANCE_FLOOR:.0%}: {remedy}"
            )
    methods = {row["method"] for row in speculative}
    ngram = [row for row in speculative if row["method"] == "ngram"]
    if ngram and methods == {"ngram"} and max(r["speedup"] for r in ngram) < NGRAM_LITTLE:
        advice.append(
            "n-gram lookup brings little here: build a draft model or EAGLE heads "
            "(`specgate heads train`) and measure again"
        )
    return {
        "verdict": verdict,
        "method": pick["method"] if verdict == "on" and pick else "none",
        "k": pick["k"] if verdict == "on" and pick else None,
        "speedup": pick["speedup"] if pick else 1.0,
        "speedup_low": pick["speedup_low"] if pick else 1.0,
        "speedup_high": pick["speedup_high"] if pick else 1.0,
        "acceptance_rate": pick["acceptance_rate"] if pick else None,
        "best_measured": pick["variant"] if pick else "none",
        "advice": advice,
    }


def expected_acceptance(model: dict[str, Any], cluster: str = "all") -> dict[str, float]:
    """Per method, the acceptance rate the report measured on a model's ``cluster`` (by
    default all of its traffic, whose recommendation is the model's): the recommended
    variant's for the cluster's recommended method, else the method's best variant's; empty
    where the report has no such cluster."""
    found = next((c for c in model["clusters"] if c["cluster"] == cluster), None)
    if found is None:
        return {}
    rows = found["rows"]
    recommended = found["recommendation"]
    expected: dict[str, float] = {}
    for method in sorted({row["method"] for row in rows} - {"none"}):
        own = [row for row in rows if row["method"] == method]
        pick = next(
            (
                row
                for row in own
                if method == recommended["method"] and row["k"] == recommended["k"]
            ),
            max(own, key=lambda row: row["speedup"]),
        )
        if pick["acceptance_rate"] is not None:
            expected[method] = pick["acceptance_rate"]
    return expected


class ConfigChangeError(ValueError):
    """The configuration file cannot take the recommendation."""


def model_settings(recommendation: dict[str, Any]) -> dict[str, Any]:
    """The settings a model's recommendation sets: its method and its fixed k (null:
    adaptive k, or plain decoding)."""
    k = recommendation["k"]
    return {
        "method": recommendation["method"],
        "num_speculative_tokens": k if isinstance(k, int) else None,
    }


def apply_to_config(document: Any, report: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The configuration mapping with each measured model's method and k set (a vLLM-served
    model's method alone: its pools' k is theirs), and the change alone (the YAML snippet)."""
    models = [m for m in report["models"] if m.get("recommendation")]
    return set_model_settings(
        document,
        {
            m["name"]: (
                {"method": m["recommendation"]["method"]}
                if m.get("backend") == "vllm"
                else model_settings(m["recommendation"])
            )
            for m in models
        },
    )


def set_model_settings(
    document: Any, settings: dict[str, dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The configuration mapping with each named model's ``settings`` set, and the change
    alone. A configuration with ``models`` gets them in the entry of that name; one without,
    at the top level (its one model)."""
    if document is None:
        document = {}
    if not isinstance(document, dict):
        raise ConfigChangeError("the configuration must map setting names to values")
    updated = dict(document)
    entries = updated.get("models")
    if not entries:
        if len(settings) != 1:
            raise ConfigChangeError(
                f"the change covers {len(settings)} models; the configuration serves one"
            )
        (change,) = settings.values()
        updated.update(change)
        return updated, change
    entries = [dict(entry) for entry in entries]
    changed = []
    for name, values in settings.items():
        entry = next((e for e in entries if e.get("name") == name), None)
        if entry is None:
            raise ConfigChangeError(f"the configuration has no models entry named {name!r}")
        entry.update(values)
        changed.append({"name": name, **values})
    updated["models"] = entries
    return updated, {"models": changed}


def snippet(change: dict[str, Any]) -> str:
    return yaml.safe_dump(change, sort_keys=False)
