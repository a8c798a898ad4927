"""Retrain a model's Medusa heads, EAGLE draft or draft model on this deployment's own
traffic, and say whether they do better than the configured ones on requests they did not
learn from.

The sample is read as `tune measure` reads it (``gateway.tune.sample.audited_sample``, under
a `tune_train` event) and split, seeded, into training and held-out requests. The target
answers the training prompts greedily and the heads learn its answers
(``engine.training.heads``: its features and soft labels), or a draft model is distilled on
them as the demo's is (``engine.training.demo.draft``: a few of the target's layers learning
its top-k distribution); either is deterministic for a seed. The
answers, the costly part, are cached under ``<out>/cache`` by the target's version and the
prompts, so a rerun into the same directory reads them back; they are the target's answers
to users' prompts, so the cache is removed once the run is done unless it is kept on
purpose. The artefact goes to ``<out>/<method>-<hash>`` (the directory holds exactly what the
engine loads, so its name and the provenance's ``content_sha256`` are the version the audit
log records for every request served with it), with ``provenance.json`` beside it. The
held-out requests are then replayed through plain decoding, the configured artefact of that
method (if any) and the new one (``gateway.tune.measure.measure_artefacts``), and
``verdict`` says whether the new one is better.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from engine.training.demo.draft import DraftSpec
from engine.training.heads import heads_method
from engine.training.heads.train import HeadsSpec, Progress
from gateway.tune.measure import ALL, ArtefactVariant, ModelRun, TuneModel, figures, machine
from gateway.tune.sample import Sample, TuneRequest

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

HeadsMethod = Literal["medusa", "eagle"]
TuneMethod = Literal["medusa", "eagle", "draft"]
REQUEST_KIND = "request"  # what a draft's greedy agreement is reported under
PROVENANCE_KIND = "specgate-tune-provenance"
TRAIN_REPORT_KIND = "specgate-tune-train-report"
CACHE_DIR = "cache"
PROVENANCE_FILE = "provenance.json"
CURRENT, RETRAINED = "current", "retrained"


def split_requests(
    requests: Sequence[TuneRequest], held_out_share: float, seed: int
) -> tuple[list[TuneRequest], list[TuneRequest]]:
    """``requests`` cut into training and held-out ones: ordered by id, shuffled by ``seed``,
    the first ``held_out_share`` held out (at least one each way)."""
    if len(requests) < 2:
        raise ValueError(
            f"{len(requests)} request(s) read: training and measuring need at least 2"
        )
    ordered = sorted(requests, key=lambda request: request.source_id)
    random.Random(seed).shuffle(ordered)
    held = min(len(ordered) - 1, max(1, round(len(ordered) * held_out_share)))
    return ordered[held:], ordered[:held]


def current_artefact(model: TuneModel, method: TuneMethod) -> Path | None:
    """The configured artefact of ``method``: the draft model, or the heads directory if it
    holds ``method``'s heads."""
    if method == "draft":
        return model.draft
    if model.heads is None or heads_method(model.heads) != method:
        return None
    return model.heads


@dataclass
class Trained:
    """A new artefact: its directory and content hash, the recipe it was trained with, the
    target version it fits, the requests it learnt from, what was left out, and the
    training's figures."""

    directory: Path
    content_sha256: str
    spec: HeadsSpec | DraftSpec
    target_version: str
    trained_on: list[TuneRequest]
    skipped: Counter[str]
    summary: dict[str, Any] = field(default_factory=dict)


def distil(
    model: TuneModel,
    method: TuneMethod,
    requests: Sequence[TuneRequest],
    spec: HeadsSpec | DraftSpec,
    out: Path,
    progress: Progress,
) -> Trained:
    """Heads (``HeadsSpec``) or a draft model (``DraftSpec``) for ``model``'s target trained
    on its greedy answers to ``requests``' prompts (on the CPU, as ``specgate heads train``
    and the demo's draft build), written to ``out/<method>-<hash>``; answers already in
    ``out/cache`` for this target version are read back, not generated."""
    import torch

    from engine.models.loading import embedding_rows, load_model, load_tokenizer
    from engine.models.versioning import model_version
    from gateway.tune.measure import prompt_ids

    tokenizer = load_tokenizer(model.target)
    target = load_model(model.target, torch.device("cpu"), "float32")
    version = model_version(model.target)
    vocabulary = embedding_rows(target)
    prompts: list[list[int]] = []
    trained_on: list[TuneRequest] = []
    skipped: Counter[str] = Counter()
    for request in requests:
        ids = prompt_ids(request, tokenizer)
        if not ids:
            skipped["not_a_request"] += 1
        elif max(ids) >= vocabulary:
            skipped["tokens_unknown_to_the_target"] += 1
        else:
            prompts.append(list(ids))
            trained_on.append(request)
    if not prompts:
        raise ValueError("no training request holds a prompt the target can read")
    generated = 0

    def counting(phase: str, done: int, total: int, loss: float) -> None:
        nonlocal generated
        if phase == "answers":
            generated = max(generated, total)
        progress(phase, done, total, loss)

    partial = out / f".{method}-partial"
    shutil.rmtree(partial, ignore_errors=True)
    if method == "draft":
        assert isinstance(spec, DraftSpec)
        spec = replace(spec, prompts=len(prompts))
        summary = _distil_draft(target, tokenizer, prompts, spec, version, out, counting, partial)
    else:
        assert isinstance(spec, HeadsSpec)
        summary = _distil_heads(
            target, tokenizer, prompts, spec, version, model.target.name, method, out,
            counting, progress, partial,
        )
    digest = model_version(partial)
    directory = out / f"{method}-{digest.removeprefix('sha256:')[:16]}"
    if directory.exists():  # the same content: a rerun with the same seed
        shutil.rmtree(partial)
    else:
        os.replace(partial, directory)
    summary.update(answers_generated=generated, answers_read_back=len(prompts) - generated)
    return Trained(directory, digest, spec, version, trained_on, skipped, summary)


def _distil_heads(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]],
    spec: HeadsSpec, version: str, target_name: str, method: HeadsMethod, out: Path,
    counting: Progress, progress: Progress, partial: Path,
) -> dict[str, Any]:
    """Heads trained on the answers to ``prompts`` (``counting`` follows their generation),
    saved to ``partial``; the training's figures."""
    from engine.training.heads.eagle import EagleDraft
    from engine.training.heads.medusa import MedusaHeads
    from engine.training.heads.train import build_data, train_eagle, train_medusa

    data = build_data(
        target, tokenizer, [], spec, version, counting, cache_dir=out / CACHE_DIR,
        prompts=prompts,
    )
    eos = tokenizer.eos_token_id
    heads: MedusaHeads | EagleDraft
    if method == "eagle":
        heads, losses = train_eagle(target, data, spec, version, target_name, progress, eos)
    else:
        heads, losses = train_medusa(target, data, spec, version, progress, eos)
    heads.save(partial)
    return {
        "sequences": int(data.ids.shape[0]),
        "positions": data.positions,
        "extra_parameters": heads.extra_parameters(),
        "losses": losses,
    }


def _distil_draft(
    target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[list[int]],
    spec: DraftSpec, version: str, out: Path, counting: Progress, partial: Path,
) -> dict[str, Any]:
    """A draft model distilled on the answers to ``prompts`` as the demo's is
    (``engine.training.demo.draft.distil_draft``), saved to ``partial`` with the target's
    tokenizer and its head vocabulary; the training's figures."""
    from transformers import LlamaForCausalLM

    from engine.training.demo.answers import Prompt, TokenPrompt
    from engine.training.demo.draft import distil_draft, save_draft

    if not isinstance(target, LlamaForCausalLM):
        raise ValueError(f"a draft is distilled from a Llama target, not {type(target).__name__}")
    chats: list[Prompt] = [TokenPrompt(REQUEST_KIND, ids) for ids in prompts]
    built = distil_draft(target, tokenizer, chats, spec, counting, version, out / CACHE_DIR)
    # The manifest says nothing of this run's timing or cache, so the same answers and recipe
    # give the same directory, bit for bit.
    save_draft(built.draft, tokenizer, built.vocabulary, built.manifest, partial)
    figures = {k: v for k, v in built.manifest.items() if k not in ("spec", "target_version")}
    return {**figures, "seconds": built.seconds}


def recipe(
    spec: HeadsSpec | DraftSpec, method: TuneMethod, held_out_share: float
) -> dict[str, Any]:
    key = "draft_spec" if isinstance(spec, DraftSpec) else "heads_spec"
    return {"method": method, "held_out_share": held_out_share, key: asdict(spec)}


def provenance(
    model: TuneModel,
    sample: Sample,
    trained: Trained,
    held_out: Sequence[TuneRequest],
    method: TuneMethod,
    held_out_share: float,
) -> dict[str, Any]:
    """Where the artefact comes from: the target (path and version), the sample (its audit
    event, the requests by event id or file line, the file's SHA-256), the recipe (every
    training setting and the seed), the subjects' keyed references whose content was read and
    those the artefact learnt from (never content), the split, and the artefact's content
    hash."""
    return {
        "kind": PROVENANCE_KIND,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "artefact": {
            "directory": trained.directory.name,
            "method": method,
            "content_sha256": trained.content_sha256,
        },
        "model": model.name,
        "target": str(model.target),
        "target_model_version": trained.target_version,
        "train_event_id": sample.event.event_id,
        "sample": {
            **sample.source,
            "requests": [request.source_id for request in sample.requests],
            "skipped": dict(sample.skipped),
        },
        "subject_refs_read": _subjects(sample.requests),
        "subject_refs_trained_on": _subjects(trained.trained_on),
        "split": {
            "seed": trained.spec.seed,
            "held_out_share": held_out_share,
            "train": [request.source_id for request in trained.trained_on],
            "held_out": [request.source_id for request in held_out],
            "left_out_of_training": dict(trained.skipped),
        },
        "recipe": recipe(trained.spec, method, held_out_share),
        "training": trained.summary,
    }


def _subjects(requests: Sequence[TuneRequest]) -> list[str]:
    return sorted({r.subject_ref for r in requests if r.subject_ref is not None})


def write_json(document: dict[str, Any], path: Path) -> str:
    """``document`` as indented JSON at ``path``; its SHA-256."""
    data = (json.dumps(document, indent=2) + "\n").encode("utf-8")
    path.write_bytes(data)
    return hashlib.sha256(data).hexdigest()


def held_out_rows(run: ModelRun) -> list[dict[str, Any]]:
    """The held-out figures of every variant (all requests), each named by its artefact
    (``plain``, ``current``, ``retrained``)."""
    whole = next(cluster for cluster in figures(run) if cluster["cluster"] == ALL)
    return [
        {"artefact": v.artefact if isinstance(v, ArtefactVariant) else "plain", **row}
        for v, row in zip(run.variants, whole["rows"], strict=True)
    ]


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether the retrained artefact is better on the held-out requests: with a current one
    of its method, a higher acceptance rate and a higher speedup over plain decoding than
    its; without, a speedup above 1 (faster than plain decoding)."""
    by_artefact = {row["artefact"]: row for row in rows}
    new, current = by_artefact[RETRAINED], by_artefact.get(CURRENT)
    figures_of = {
        name: {
            "acceptance_rate": row["acceptance_rate"],
            "mean_accepted_length": row["mean_accepted_length"],
            "tokens_per_second": row["tokens_per_second"],
            "speedup": row["speedup"],
        }
        for name, row in by_artefact.items()
        if name != "plain"
    }
    if current is None:
        better = new["speedup"] > 1.0
        reason = (
            f"no current artefact of this method; retrained speedup {new['speedup']:.2f}x "
            f"over plain decoding"
        )
    else:
        better = (
            new["acceptance_rate"] > current["acceptance_rate"]
            and new["speedup"] > current["speedup"]
        )
        reason = (
            f"held-out acceptance {new['acceptance_rate']:.1%} (retrained) vs "
            f"{current['acceptance_rate']:.1%} (current), speedup {new['speedup']:.2f}x vs "
            f"{current['speedup']:.2f}x"
        )
    return {
        "better": better,
        "compared_with": CURRENT if current is not None else "plain",
        "reason": reason,
        "figures": figures_of,
    }


def train_report(
    run: ModelRun,
    prov: dict[str, Any],
    provenance_sha256: str,
    artefacts: dict[str, Path],
    k: int,
    repeats: int,
    max_tokens: int,
) -> dict[str, Any]:
    """``train.json``: the held-out comparison (figures per artefact, the verdict) and what
    it was measured on, by request id and artefact path; no content."""
    rows = held_out_rows(run)
    return {
        "kind": TRAIN_REPORT_KIND,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "train_event_id": prov["train_event_id"],
        "model": run.model.name,
        "method": prov["artefact"]["method"],
        "target_model_version": run.target_version,
        "dtype": run.dtype,
        "artefacts": {name: str(path) for name, path in artefacts.items()},
        "artefact_content_sha256": prov["artefact"]["content_sha256"],
        "provenance_sha256": provenance_sha256,
        "options": {"k": k, "repeats": repeats, "max_tokens": max_tokens},
        "held_out": {
            "requests": [prompt.name for prompt in run.prompts],
            "skipped": dict(run.skipped),
        },
        "machine": machine(),
        "rows": rows,
        "verdict": verdict(rows),
    }


def training_spec(
    method: TuneMethod, *, steps: int, answer_tokens: int, generation_batch: int, lr: float,
    seed: int, num_heads: int, rows_per_step: int, sequences_per_step: int,
    draft_vocab_size: int, draft_layers: Sequence[int], draft_head_tokens: int | None,
) -> HeadsSpec | DraftSpec:
    """The recipe ``tune train``'s options give: ``DraftSpec`` for a draft model (its own
    layers and head tokens where not given; the prompt count is set once the sample is read),
    ``HeadsSpec`` for heads (no text snippets: the sample's prompts alone)."""
    if method == "draft":
        return DraftSpec(
            layers=tuple(draft_layers or DraftSpec.layers),
            head_tokens=draft_head_tokens or DraftSpec.head_tokens, prompts=0,
            answer_tokens=answer_tokens, generation_batch=generation_batch,
            steps=steps, lr=lr, warmup_steps=min(DraftSpec.warmup_steps, steps // 10), seed=seed,
        )  # fmt: skip
    return HeadsSpec(
        num_heads=num_heads, snippets=0, answer_tokens=answer_tokens,
        generation_batch=generation_batch, steps=steps, rows_per_step=rows_per_step, lr=lr,
        warmup_steps=min(50, steps // 10), seed=seed,
        draft_vocab_size=draft_vocab_size or None, sequences_per_step=sequences_per_step,
    )  # fmt: skip


@dataclass
class Retraining:
    """An artefact trained on a sample's training requests, with its provenance written, and
    the requests held out to compare it on."""

    trained: Trained
    held_out: list[TuneRequest]
    provenance: dict[str, Any]
    provenance_sha256: str


def retrain(
    model: TuneModel, method: TuneMethod, sample: Sample, spec: HeadsSpec | DraftSpec,
    held_out_share: float, out: Path, progress: Progress,
) -> Retraining:
    """``model``'s requests of ``sample`` split by the recipe's seed, the artefact distilled
    on the training part (``distil``) and its provenance written to ``out``. Raises
    ValueError where there is nothing to learn from."""
    from gateway.tune.measure import assign

    by_model, unassigned = assign(sample.requests, [model])
    sample.skipped.update(unassigned)
    trained_requests, held = split_requests(by_model[model.name], held_out_share, spec.seed)
    out.mkdir(parents=True, exist_ok=True)
    trained = distil(model, method, trained_requests, spec, out, progress)
    prov = provenance(model, sample, trained, held, method, held_out_share)
    return Retraining(trained, held, prov, write_json(prov, out / PROVENANCE_FILE))


@dataclass
class Comparison:
    """The held-out comparison: the configured artefact it was measured beside (None: only
    plain decoding), the report and where it went (JSON, HTML, the JSON's SHA-256)."""

    current: Path | None
    report: dict[str, Any]
    paths: tuple[Path, Path]
    report_sha256: str

    @property
    def verdict(self) -> dict[str, Any]:
        return dict(self.report["verdict"])


def compare(
    model: TuneModel, method: TuneMethod, retraining: Retraining, out: Path,
    k: int, repeats: int, max_tokens: int,
) -> Comparison:
    """The held-out requests replayed through plain decoding, the configured artefact of
    ``method`` and the retrained one (``measure_artefacts``), and ``train.json`` /
    ``train.html`` written. Raises ValueError where no held-out request can be replayed."""
    from gateway.tune.measure import measure_artefacts
    from gateway.tune.report import write_train_report

    current = current_artefact(model, method)
    artefacts = {CURRENT: current} if current is not None else {}
    artefacts[RETRAINED] = retraining.trained.directory
    run = measure_artefacts(model, method, artefacts, retraining.held_out, k, repeats, max_tokens)
    if not run.prompts:
        raise ValueError("no held-out request can be replayed on this target")
    report = train_report(
        run, retraining.provenance, retraining.provenance_sha256, artefacts, k, repeats,
        max_tokens,
    )
    json_path, html_path, digest = write_train_report(report, out)
    return Comparison(current, report, (json_path, html_path), digest)


def promotion(
    model: TuneModel, method: TuneMethod, sample: Sample, retraining: Retraining,
    comparison: Comparison,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The `tune_promote` event's evidence, and the configuration change for ``model`` if
    the retrained artefact is better (None otherwise): its directory as the ``draft`` or
    ``heads``, and the method where other heads were served."""
    trained, decision = retraining.trained, comparison.verdict
    evidence = {
        "model": model.name,
        "method": method,
        "artefact": str(trained.directory.resolve()),
        "content_sha256": trained.content_sha256,
        "current": str(comparison.current) if comparison.current is not None else None,
        "train_event_id": sample.event.event_id,
        "report_sha256": comparison.report_sha256,
        "provenance_sha256": retraining.provenance_sha256,
        "compared_with": decision["compared_with"],
        "held_out": decision["figures"],
        "reason": decision["reason"],
    }
    if not decision["better"]:
        return evidence, None
    field_name = "draft" if method == "draft" else "heads"
    change: dict[str, Any] = {field_name: str(trained.directory.resolve())}
    if method != "draft" and model.method in ("medusa", "eagle") and model.method != method:
        change["method"] = method  # the other method's heads are replaced
    return evidence, change
