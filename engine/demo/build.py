"""``specgate models build-demo``: tokenizer, target and distilled draft, saved in HF format.

The target is a deep, narrow Llama (11.3M parameters, 24 layers of width 192) and the draft
two layers of the same width (2.4M parameters, most of them embeddings and head), started
from the target's first two layers, embeddings and head and distilled from the target. Deep
and narrow because on CPU a decoding step of a model this size costs per layer, not per
parameter: the target pass then stands to its draft as a production target's memory-bound
pass does, which is the regime speculative decoding exists for (measured in float32 on one
core of a 2-core AVX512-BF16 EPYC: target 11.8 ms for one token and 14.8 ms for five, draft
0.95 ms, 8% of a target pass). The target starts with an induction circuit wired into its
first two layers (``engine/demo/induction.py``), without which it does not learn to copy in
this budget; the draft's two layers start as that circuit, trained, so it can copy too.
Quoting chats (``engine/demo/quoting.py``) amounting to 15% of the source text are mixed in.

On two cores of an AMD EPYC with AVX512-BF16 a full build took 42.7 minutes: the target's
1150 steps under bf16 autocast 28.9 minutes (1.51 s each), the draft's 600 distillation
steps 12.3 minutes, the evaluation 1.3 minutes. Target held-out loss 3.33, draft 3.45,
greedy agreement 0.76, target quoting accuracy 0.83; the previous build on the same CPU (no
circuit, one-layer draft) gave 4.63, 4.90, 0.57 and 0.26. Distilling longer is what made the
draft worth running: 200 steps gave a greedy agreement of 0.43 and 1.33x on the benchmark's code
prompts, 600 gave 0.54 and 1.77x (one-layer draft). Where bfloat16 is emulated training runs
in float32 with fewer steps (900 and 300), sized from an earlier 12-layer target's 1.9 s per
step on 2 AVX2 cores. On the EPYC above float32 steps took 1.71 s (target) and 1.44 s
(draft), about 34 minutes for that build; it has not been timed on a CPU without native
bfloat16, which is where it runs. bfloat16 kernels differ between CPU types, so the pair is
reproducible per CPU type, not across types. The models train on 512-token windows;
``max_position_embeddings`` is 1024."""

from __future__ import annotations

import difflib
import json
import platform
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import cast

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
from engine.demo.induction import wire_induction_circuit
from engine.demo.quoting import functions, quoting_conversations, quoting_request
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
    # Share of the training characters given to quoting chats (see quoting.py).
    quoting_share: float
    # Train under bfloat16 autocast and save the target in bfloat16 (CPUs with native bf16).
    bfloat16: bool
    seed: int = 1234


FULL_BFLOAT16 = BuildSpec(
    vocab_size=4096,
    max_positions=1024,
    target=ModelShape(hidden=192, layers=24, intermediate=512, heads=4, kv_heads=2),
    draft_layers=2,
    target_schedule=Schedule(steps=1150, batch_size=4, seq_len=512, lr=2e-3, warmup_steps=50),
    draft_schedule=Schedule(steps=600, batch_size=8, seq_len=512, lr=1e-3, warmup_steps=10),
    eval_windows=12,
    max_files=None,
    quoting_share=0.15,
    bfloat16=True,
)

# The same pair where bfloat16 is emulated and training runs in float32, which is slower, so
# fewer steps fit in the 45-minute budget (a 12-layer target took 1.9 s a step on 2 AVX2
# cores; 560 steps were too few for it to write recognisable Python).
FULL_FLOAT32 = replace(
    FULL_BFLOAT16,
    target_schedule=replace(FULL_BFLOAT16.target_schedule, steps=900),
    draft_schedule=replace(FULL_BFLOAT16.draft_schedule, steps=300),
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
    quoting_share=0.15,
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


def _chat_prompt_ids(tokenizer: PreTrainedTokenizerFast, request: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": request}], add_generation_prompt=True, tokenize=True,
        return_dict=False,
    )
    return [int(i) for i in cast(list[int], ids)]


def _held_out_quotes(
    tokenizer: PreTrainedTokenizerFast, held_out: tuple[SourceFile, ...], count: int
) -> list[tuple[list[int], list[int]]]:
    """``(chat prompt, verbatim quote)`` token ids for the first ``count`` held-out functions."""
    quotes = []
    for code in [code for source in held_out for _, code in functions(source)][:count]:
        request, answer = quoting_request("", code, rename=False)
        quote = tokenizer.encode(answer, add_special_tokens=False)
        quotes.append((_chat_prompt_ids(tokenizer, request), quote))
    return quotes


@torch.inference_mode()
def _quoting_accuracy(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
    held_out: tuple[SourceFile, ...], count: int,
) -> float:
    """Share of the tokens of a verbatim quote that the model predicts greedily when asked for
    one in a chat, over held-out functions: how much of its answer n-gram lookup could propose."""
    model.eval()
    correct = total = 0
    for head, quote in _held_out_quotes(tokenizer, held_out, count):
        ids = torch.tensor([head + quote])
        predicted = model(input_ids=ids).logits[0, len(head) - 1 : -1].argmax(-1)
        correct += int((predicted == ids[0, len(head) :]).sum())
        total += len(quote)
    return correct / max(1, total)


def _common_prefix_length(a: list[int], b: list[int]) -> int:
    shorter = min(len(a), len(b))
    return next((i for i in range(shorter) if a[i] != b[i]), shorter)


@torch.inference_mode()
def _quote_fidelity(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast,
    held_out: tuple[SourceFile, ...], count: int,
) -> tuple[float, float]:
    """What the model writes, decoding greedily, when asked for a verbatim quote of held-out
    functions: the mean share of the quote it reproduces exactly before its first mistake,
    and the mean token-level similarity of its whole answer to the quote (difflib's ratio)."""
    model.eval()
    generation_config = _generation_config(tokenizer)
    prefixes: list[float] = []
    similarities: list[float] = []
    for head, quote in _held_out_quotes(tokenizer, held_out, count):
        output = model.generate(
            input_ids=torch.tensor([head]), generation_config=generation_config,
            max_new_tokens=len(quote) + 1, do_sample=False,
        )[0, len(head) :].tolist()
        prefixes.append(_common_prefix_length(quote, output) / len(quote))
        similarities.append(difflib.SequenceMatcher(None, quote, output).ratio())
    return statistics.fmean(prefixes), statistics.fmean(similarities)


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
        quoting = [
            str(tokenizer.apply_chat_template(chat, tokenize=False))
            for chat in quoting_conversations(
                corpus.train, int(corpus.train_chars * spec.quoting_share), spec.seed
            )
        ]
        train_stream = _token_stream(tokenizer, [f.text for f in corpus.train] + quoting)
        eval_stream = _token_stream(tokenizer, [f.text for f in corpus.held_out])
    eval_len = min(spec.target_schedule.seq_len + 1, len(eval_stream.tokens) // 2)
    eval_windows = eval_stream.evenly_spaced_windows(spec.eval_windows, eval_len)

    target = LlamaForCausalLM(llama_config(spec.target, tokenizer, spec.max_positions))
    wire_induction_circuit(target, torch.Generator().manual_seed(spec.seed))
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
        exact_prefix, similarity = _quote_fidelity(
            teacher, tokenizer, corpus.held_out, spec.eval_windows
        )
        evaluation = {
            "target_held_out_loss": round(held_out_loss(teacher, eval_windows), 4),
            "draft_held_out_loss": round(held_out_loss(draft, eval_windows), 4),
            "greedy_agreement": round(greedy_agreement(draft, teacher, eval_windows), 4),
            "target_quoting_accuracy": round(
                _quoting_accuracy(teacher, tokenizer, corpus.held_out, spec.eval_windows), 4
            ),
            "target_quote_exact_prefix": round(exact_prefix, 4),
            "target_quote_similarity": round(similarity, 4),
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
            "quoting_chats": len(quoting),
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
            "initialised_from": (
                f"target layers[:{spec.draft_layers}], embeddings, final norm, lm_head"
            ),
            "schedule": asdict(spec.draft_schedule),
            "tokens_seen": spec.draft_schedule.tokens,
            "distillation_kl_every_10_steps": draft_losses,
        },
        "evaluation": evaluation,
        "seconds": {**timer.seconds, "total": round(time.perf_counter() - started, 2)},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
