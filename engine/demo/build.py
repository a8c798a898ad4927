"""``specgate models build-demo``: tokenizer, target and distilled draft, saved in HF format.

The full build took 33.5 minutes on two shared CPU cores with native bfloat16 (1400 target
steps under bf16 autocast, held-out loss 4.38), and 32.6 minutes on two AVX2 cores without it
(1000 float32 steps, loss 4.56). The target is a deep, narrow Llama (11M parameters, 12
layers of width 256): on CPU its decoding step is dominated by per-layer overhead, so five
new tokens cost about 1.5 times one (measured: 10.4 vs 15.5 ms in float32 on one AVX2 core),
which is the regime where verifying several proposed tokens in one pass pays; and at this
training budget (2-3M tokens) a small model learns more than a large one. The draft is the
same width with one layer (about 1.5 ms a step), started from the target's first layer,
embeddings and head, and distilled from the target. The models train on 512-token windows;
``max_position_embeddings`` is 1024."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from transformers import GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from engine.demo.corpus import Corpus, SourceFile, load_corpus
from engine.demo.quoting import QUOTE_HEADER, functions, quoting_documents
from engine.demo.tokenizer import train_tokenizer
from engine.demo.training import (
    ModelShape,
    Schedule,
    TokenStream,
    count_parameters,
    distill_draft,
    greedy_agreement,
    held_out_loss,
    init_draft_from_target,
    llama_config,
    train_language_model,
)
from engine.loading import cpu_has_native_bfloat16

END_OF_TURN = "<|end|>"
SAMPLE_PROMPT = "import os\n\n\ndef "
LOSS_LOG_EVERY = 10


@dataclass(frozen=True)
class BuildSpec:
    vocab_size: int
    max_positions: int
    target: ModelShape
    draft_layers: int
    target_schedule: Schedule
    draft_schedule: Schedule
    eval_windows: int
    max_files: int | None
    # Share of the target's training characters given to quoting documents (see quoting.py).
    quoting_share: float
    # Train under bfloat16 autocast and save the target in bfloat16 (CPUs with native bf16).
    bfloat16: bool
    seed: int = 1234


FULL_BFLOAT16 = BuildSpec(
    vocab_size=4096,
    max_positions=1024,
    target=ModelShape(hidden=192, layers=24, intermediate=512, heads=4, kv_heads=2),
    draft_layers=1,
    target_schedule=Schedule(steps=1150, batch_size=4, seq_len=512, lr=2e-3, warmup_steps=50),
    draft_schedule=Schedule(steps=200, batch_size=8, seq_len=512, lr=1e-3, warmup_steps=10),
    eval_windows=12,
    max_files=None,
    quoting_share=0.1,
    bfloat16=True,
)

# The same pair where bfloat16 is emulated and training runs in float32: a target step takes
# 1.9 s and a distillation step 1.8 s on 2 AVX2 cores, so fewer steps fit in the 45-minute
# budget (560 target steps were too few: held-out loss 4.90 and no recognisable Python).
FULL_FLOAT32 = replace(
    FULL_BFLOAT16,
    target_schedule=replace(FULL_BFLOAT16.target_schedule, steps=900),
    draft_schedule=replace(FULL_BFLOAT16.draft_schedule, steps=150),
    bfloat16=False,
)

QUICK = BuildSpec(
    vocab_size=384,
    max_positions=256,
    target=ModelShape(hidden=64, layers=2, intermediate=128, heads=4, kv_heads=2),
    draft_layers=1,
    target_schedule=Schedule(steps=10, batch_size=2, seq_len=64, lr=3e-3, warmup_steps=2),
    draft_schedule=Schedule(steps=10, batch_size=2, seq_len=64, lr=3e-3, warmup_steps=2),
    eval_windows=2,
    max_files=40,
    quoting_share=0.1,
    bfloat16=False,
)


def full_spec() -> BuildSpec:
    """The full build for this CPU: bfloat16 training only where the CPU computes it natively."""
    return FULL_BFLOAT16 if cpu_has_native_bfloat16() else FULL_FLOAT32


class _PhaseTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.seconds[name] = round(time.perf_counter() - start, 2)


def _token_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> TokenStream:
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for encoded in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(encoded)
        ids.append(eos)
    return TokenStream(torch.tensor(ids, dtype=torch.long))


def _generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    end_of_turn = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    return GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id, end_of_turn],
        pad_token_id=tokenizer.pad_token_id,
    )


def _save(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Saved in the model's own dtype (the target bfloat16 when trained so, the draft float32)."""
    model.generation_config = _generation_config(tokenizer)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


@torch.inference_mode()
def _greedy_sample(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, tokens: int) -> str:
    prompt = tokenizer(SAMPLE_PROMPT, return_tensors="pt", add_special_tokens=False)
    output = model.generate(**prompt, max_new_tokens=tokens, do_sample=False)
    return str(tokenizer.decode(output[0], skip_special_tokens=True))


@torch.inference_mode()
def _quoting_accuracy(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
    held_out: tuple[SourceFile, ...], count: int,
) -> float:
    """Share of the tokens of a verbatim quote that the model predicts greedily, over held-out
    functions: how much of its output n-gram lookup could propose."""
    model.eval()
    correct = total = 0
    samples = [code for source in held_out for _, code in functions(source)][:count]
    for code in samples:
        head = tokenizer.encode(code + QUOTE_HEADER, add_special_tokens=False)
        quote = tokenizer.encode(code, add_special_tokens=False)
        ids = torch.tensor([head + quote])
        predicted = model(input_ids=ids).logits[0, len(head) - 1 : -1].argmax(-1)
        correct += int((predicted == ids[0, len(head) :]).sum())
        total += len(quote)
    return correct / max(1, total)


def _loss_logger(
    progress: Progress, task: TaskID, log: list[float]
) -> Callable[[int, float], None]:
    window: list[float] = []

    def on_step(step: int, loss: float) -> None:
        window.append(loss)
        if len(window) == LOSS_LOG_EVERY:
            log.append(round(sum(window) / len(window), 4))
            window.clear()
        progress.update(task, advance=1, loss=loss)

    return on_step


def build_demo(out: Path, spec: BuildSpec, *, show_progress: bool = True) -> dict[str, object]:
    """Build the pair into ``out/target`` and ``out/draft``; returns (and writes) the manifest."""
    started = time.perf_counter()
    torch.manual_seed(spec.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    timer = _PhaseTimer()
    out.mkdir(parents=True, exist_ok=True)

    with timer.phase("corpus"):
        corpus: Corpus = load_corpus(max_files=spec.max_files)
    with timer.phase("tokenizer"):
        tokenizer = train_tokenizer((f.text for f in corpus.train), spec.vocab_size)
        quoting = quoting_documents(
            corpus.train, int(corpus.train_chars * spec.quoting_share), spec.seed
        )
        train_stream = _token_stream(tokenizer, [f.text for f in corpus.train] + quoting)
        eval_stream = _token_stream(tokenizer, [f.text for f in corpus.held_out])
    eval_len = min(spec.target_schedule.seq_len + 1, len(eval_stream.tokens) // 2)
    eval_windows = eval_stream.evenly_spaced_windows(spec.eval_windows, eval_len)

    target = LlamaForCausalLM(llama_config(spec.target, tokenizer, spec.max_positions))
    draft_shape = ModelShape(**{**asdict(spec.target), "layers": spec.draft_layers})
    draft = LlamaForCausalLM(llama_config(draft_shape, tokenizer, spec.max_positions))
    target_losses: list[float] = []
    draft_losses: list[float] = []

    columns = (
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(),
    )
    with Progress(*columns, disable=not show_progress) as progress:
        target_task = progress.add_task("target", total=spec.target_schedule.steps, loss=0.0)
        draft_task = progress.add_task("draft", total=spec.draft_schedule.steps, loss=0.0)
        with timer.phase("target_training"):
            train_language_model(
                target, train_stream, spec.target_schedule, spec.seed,
                _loss_logger(progress, target_task, target_losses), spec.bfloat16,
            )
        teacher = LlamaForCausalLM(target.config)
        teacher.load_state_dict(target.state_dict())
        if spec.bfloat16:
            teacher.bfloat16()
        init_draft_from_target(draft, target)
        with timer.phase("draft_distillation"):
            distill_draft(
                draft, teacher, train_stream, spec.draft_schedule, spec.seed + 1,
                _loss_logger(progress, draft_task, draft_losses), spec.bfloat16,
            )

    with timer.phase("evaluation"):
        evaluation = {
            "target_held_out_loss": round(held_out_loss(teacher, eval_windows), 4),
            "draft_held_out_loss": round(held_out_loss(draft, eval_windows), 4),
            "greedy_agreement": round(greedy_agreement(draft, teacher, eval_windows), 4),
            "target_quoting_accuracy": round(
                _quoting_accuracy(teacher, tokenizer, corpus.held_out, spec.eval_windows), 4
            ),
            "target_sample": _greedy_sample(teacher, tokenizer, 48),
        }
    with timer.phase("save"):
        _save(teacher, tokenizer, out / "target")
        _save(draft, tokenizer, out / "draft")

    manifest: dict[str, object] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "seed": spec.seed,
        "torch_threads": torch.get_num_threads(),
        "corpus": {
            "train_files": len(corpus.train),
            "held_out_files": [f.relative_path for f in corpus.held_out],
            "train_chars": corpus.train_chars,
            "quoting_documents": len(quoting),
            "train_tokens": len(train_stream.tokens),
            "held_out_tokens": len(eval_stream.tokens),
        },
        "tokenizer": {"vocab_size": len(tokenizer)},
        "target": {
            "shape": asdict(spec.target),
            "parameters": count_parameters(target),
            "saved_dtype": "bfloat16" if spec.bfloat16 else "float32",
            "schedule": asdict(spec.target_schedule),
            "tokens_seen": spec.target_schedule.tokens,
            "train_loss_every_10_steps": target_losses,
        },
        "draft": {
            "shape": draft_shape.__dict__,
            "parameters": count_parameters(draft),
            "saved_dtype": "float32",
            "initialised_from": "target layers[:1], embeddings, final norm, lm_head",
            "schedule": asdict(spec.draft_schedule),
            "tokens_seen": spec.draft_schedule.tokens,
            "distillation_kl_every_10_steps": draft_losses,
        },
        "evaluation": evaluation,
        "seconds": {**timer.seconds, "total": round(time.perf_counter() - started, 2)},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
