"""Where one EAGLE-2 decode step of the engine spends its time, against the cost model.

    python -m bench.eagle_profile [--target DIR] [--heads DIR] [--tokens 64] [--k 16]
                                  [--steps 5] [--topk 4] [--draft-tokens 16] [--threads N]

Decodes the bench's first code and chat prompts greedily with the engine's own pieces (a
``BatchedRunner`` slot, ``EagleProposer``, ``engine.serving.step.run_step``) at a fixed k, and times
each piece of every step: the draft catching up on the accepted path's features, the draft's
passes per tree level (the decoder layer, and its head), what the proposer does around them
in Python (tree growing, masks, top-k), the target's tree pass, and verification with the
KV compaction of the accepted path. Beside them it times what the cost model
(``engine.speculation.adaptive.pass_cost_speedup``, the benchmark's theoretical speedup) charges: a
chain pass of the target of 1 row and of the tree's rows, on the same context. Means per step over
all steps; the tokens must equal plain decoding's (checked).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the specgate command does

import torch

from bench.workload import builtin_prompts
from engine.api.types import SamplingParams
from engine.models.batched_runner import BatchedRunner, Feed
from engine.models.loading import load_model, load_tokenizer, pick_device
from engine.models.packed_linear import pack_linear_weights
from engine.models.versioning import model_version
from engine.serving.step import StepRow, run_step
from engine.speculation.adaptive import PassCosts
from engine.speculation.proposers.base import Proposal
from engine.speculation.proposers.eagle import EagleProposer, EagleTree
from engine.training.demo.paths import default_demo_dir
from engine.training.heads.eagle import EagleDraft
from engine.training.heads.loading import load_heads_for


class Timers:
    """Seconds per named piece, summed within a step; ``steps`` keeps each step's sums."""

    def __init__(self) -> None:
        self.current: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.steps: list[dict[str, float]] = []

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.current[name] += time.perf_counter() - started
                self.counts[name] += 1

        return timed

    def close_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)

    def mean_ms(self, name: str) -> float:
        return statistics.fmean(s.get(name, 0.0) for s in self.steps) * 1e3


def instrument(proposer: EagleProposer, runner: BatchedRunner, timers: Timers) -> None:
    draft: EagleDraft = proposer.draft
    catch_up, forward = proposer._catch_up, draft.forward
    inside = [False]

    def timed_catch_up(context: list[int]) -> None:
        inside[0] = True
        try:
            timers.wrap("draft catch-up", catch_up)(context)
        finally:
            inside[0] = False

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        if inside[0]:  # the catch-up's own pass, counted there
            return forward(*args, **kwargs)
        return timers.wrap("draft level: layer", forward)(*args, **kwargs)

    draft.forward = timed_forward  # type: ignore[method-assign]
    draft.logits = timers.wrap("draft level: head", draft.logits)  # type: ignore[method-assign]
    proposer._catch_up = timed_catch_up  # type: ignore[method-assign]
    runner.forward_hidden = timers.wrap("target tree pass", runner.forward_hidden)  # type: ignore[method-assign]
    runner.keep_path = timers.wrap("KV compaction", runner.keep_path)  # type: ignore[method-assign]


def chain_pass_ms(runner: BatchedRunner, slot: int, tokens: list[int], repeats: int = 9) -> float:
    kept = runner.lengths[slot]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        runner.forward_hidden([Feed(slot, tokens)])
        times.append(time.perf_counter() - started)
        runner.truncate(slot, kept)
    return statistics.median(times) * 1e3


def plain_tokens(runner: BatchedRunner, prompt: list[int], count: int) -> list[int]:
    runner.release(0)
    runner.forward([Feed(0, prompt[:-1])], last_only=True)
    context = list(prompt)
    params = SamplingParams(max_tokens=count, temperature=0.0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(count):
        row = StepRow(0, context, Proposal([]), params, generator)
        context.append(run_step(runner, [row])[0].next_token)
    runner.release(0)
    return context[len(prompt) :]


def eagle_run(
    runner: BatchedRunner, proposer: EagleProposer, prompt: list[int], count: int, k: int,
    timers: Timers,
) -> tuple[list[int], list[tuple[int, int]]]:
    """Greedy EAGLE decoding of ``count`` tokens; the tokens and (proposed, accepted) per
    step."""
    runner.release(0)
    hidden = runner.forward_hidden([Feed(0, prompt[:-1])])[1][0]
    proposer.start(prompt)
    proposer.observe_hidden(hidden)
    context = list(prompt)
    params = SamplingParams(max_tokens=count, temperature=0.0)
    generator = torch.Generator().manual_seed(0)
    steps = []
    timers.current.clear()
    while len(context) - len(prompt) < count:
        started = time.perf_counter()
        proposal = proposer.propose(context, min(k, count - (len(context) - len(prompt)) - 1),
                                    params, generator)
        timers.current["propose (all)"] += time.perf_counter() - started
        row = StepRow(0, context, proposal, params, generator,
                      observe_hidden=proposer.observe_hidden)
        started = time.perf_counter()
        verdict = run_step(runner, [row])[0]
        timers.current["run_step (all)"] += time.perf_counter() - started
        timers.current["tree rows"] += len(proposal.tokens) + 1
        context += [*(proposal.tokens[i] for i in verdict.path), verdict.next_token]
        proposer.accepted(context)
        steps.append((len(proposal.tokens), len(verdict.path)))
        timers.close_step()
    runner.release(0)
    return context[len(prompt) : len(prompt) + count], steps


def profile_tree(
    runner: BatchedRunner, draft: EagleDraft, tree: EagleTree, prompts: list[list[int]],
    tokens: int, k: int, verbose: bool, costs: PassCosts | None = None,
) -> dict[str, float]:
    """One tree configuration over ``prompts``, plain decoding timed beside it per prompt;
    with ``costs`` the tree's depth adapts (``engine.speculation.proposers.eagle.TreeDepth``)."""
    proposer = EagleProposer(draft, tree) if costs is None else EagleProposer(
        draft, tree, costs=costs
    )
    timers = Timers()
    instrument(proposer, runner, timers)
    steps_all: list[tuple[int, int]] = []
    plain_seconds = eagle_seconds = 0.0
    passes: dict[str, list[float]] = defaultdict(list)
    for ids in prompts:
        started = time.perf_counter()
        expected = plain_tokens(runner, ids, tokens)
        plain_seconds += time.perf_counter() - started
        started = time.perf_counter()
        got, steps = eagle_run(runner, proposer, ids, tokens, k, timers)
        eagle_seconds += time.perf_counter() - started
        if got != expected:
            print(f"  tokens DIFFER from plain decoding's ({len(ids)}-token prompt)")
        steps_all += steps
        # The cost model's passes on this context: chain passes of 1 and of the tree's rows.
        runner.forward([Feed(0, ids[:-1])], last_only=True)
        rows = round(statistics.fmean(p for p, _ in steps)) + 1
        passes["target 1 row"].append(chain_pass_ms(runner, 0, ids[-1:]))
        passes["target chain, tree's rows"].append(chain_pass_ms(runner, 0, ids[-rows:]))
        runner.release(0)
    figures = {name: timers.mean_ms(name) for name in (
        "propose (all)", "draft catch-up", "draft level: layer", "draft level: head",
        "run_step (all)", "target tree pass", "KV compaction")}
    figures["proposer Python/topk/masks"] = (
        figures["propose (all)"] - figures["draft catch-up"] - figures["draft level: layer"]
        - figures["draft level: head"])
    figures["verify + bookkeeping"] = (
        figures["run_step (all)"] - figures["target tree pass"] - figures["KV compaction"])
    per_step = len(timers.steps)
    figures["draft levels per step"] = timers.counts["draft level: layer"] / per_step
    figures["rows per step"] = timers.mean_ms("tree rows") / 1e3
    for name, values in passes.items():
        figures[f"model: {name}"] = statistics.median(values)
    figures["mean accepted length"] = 1 + sum(a for _, a in steps_all) / per_step
    figures["speedup (time, plain alongside)"] = plain_seconds / eagle_seconds
    if verbose:
        for name, value in figures.items():
            print(f"  {name:34s} {value:8.2f}")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    demo = default_demo_dir()
    parser.add_argument("--target", type=Path, default=demo / "target")
    parser.add_argument("--heads", type=Path, default=demo / "eagle")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=16)
    parser.add_argument(
        "--trees", default="5,4,16",
        help="num_steps,eagle_topk,num_draft_tokens per configuration, ';' between them",
    )
    parser.add_argument("--prompts", type=int, default=2, help="per workload (code, chat)")
    parser.add_argument("--threads", type=int)
    parser.add_argument(
        "--adaptive-depth", action="store_true",
        help="also run each tree with its depth chosen from measured costs, as the engine does",
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    device = pick_device(None)
    model = load_model(args.target, device, "bfloat16")
    pack_linear_weights(model)
    _, draft = load_heads_for(args.heads, model, model_version(args.target))
    assert isinstance(draft, EagleDraft)
    tokenizer = load_tokenizer(args.target)
    prompts = [
        list(p.prompt_ids) for p in builtin_prompts(tokenizer, args.tokens, args.prompts)
        if p.workload in ("code", "chat")
    ]
    runner = BatchedRunner(model, max_slots=1)
    trees = [EagleTree(*map(int, spec.split(","))) for spec in args.trees.split(";")]
    table = []
    costs = None
    if args.adaptive_depth:
        costs = PassCosts()
        runner.forward([Feed(0, prompts[0][:-1])], last_only=True)
        costs.record_target(1, chain_pass_ms(runner, 0, prompts[0][-1:]) / 1e3)
        runner.release(0)
    for tree in trees:
        for adaptive in (None, costs) if costs is not None else (None,):
            label = " adaptive depth" if adaptive is not None else ""
            print(f"{tree}{label}, k {args.k}, load {os.getloadavg()[0]:.2f} (ms per step)")
            figures = profile_tree(runner, draft, tree, prompts, args.tokens, args.k, True,
                                   adaptive)
            table.append((tree, label, figures))
    print(f"\n{len(prompts)} prompts (code, chat), {args.tokens} tokens, k {args.k}, torch "
          f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}")
    print("| steps | topk | draft tokens | depth | mean accepted length | levels | propose ms "
          "| target pass ms | step ms | speedup |")
    print("|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for tree, label, f in table:
        print(f"| {tree.num_steps} | {tree.eagle_topk} | {tree.num_draft_tokens} | "
              f"{'adaptive' if label else 'fixed'} | "
              f"{f['mean accepted length']:.2f} | {f['draft levels per step']:.2f} | "
              f"{f['propose (all)']:.1f} | {f['target tree pass']:.1f} | "
              f"{f['propose (all)'] + f['run_step (all)']:.1f} | "
              f"{f['speedup (time, plain alongside)']:.2f}x |")


if __name__ == "__main__":
    main()
