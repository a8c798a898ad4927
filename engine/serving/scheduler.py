"""Continuous batching: requests join the running batch between steps and leave when done.

Each iteration of ``BatchScheduler.run``:
1. admits waiting requests while there is a free slot (``max_num_seqs``) and the KV budget
   holds every running sequence's reservation (``reservation``: each slot's cache grows on
   its own, up to it, ``engine.models.batched_cache``);
2. prefills the prompts that this step finishes, the shortest remainder first, within what
   the step's token budget (``max_num_batched_tokens``) leaves after the decoding sequences'
   rows, one chunk of at most ``long_prefill_token_threshold`` tokens per prompt; a prompt
   longer than that gets fewer where the measured cost per prompt token would make its pass
   overrun ``max_prefill_chunk_seconds`` (``engine.serving.prefill_pace``);
3. runs one decode step over every sequence whose prompt is cached: each brings its own
   proposal, its length chosen for the batch from every sequence's acceptance and the
   measured step costs at this batch size (``engine.speculation.batch_speculation``), so speculation
   shrinks as the batch grows and stops where it no longer pays;
4. spends what is left of the budget on chunks that do not finish their prompt, after the
   decode pass: a short request arriving behind a long prompt waits for the chunk in flight,
   its own prefill and one decode pass, never for more of the long prompt;
5. streams each sequence's new tokens and retires the finished, cancelled ones, moving the
   last slot into the freed one so the running slots stay contiguous.

Prefill chunks run as passes of their own: in the padded layout a chunk of hundreds of rows
in the decode pass would pad every decoding sequence to its length.
"""

from __future__ import annotations

import queue
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from opentelemetry import trace

from engine.api.types import MAX_STEP_ROWS, GenerationStats, Method, StreamDelta
from engine.models.batched_runner import Feed
from engine.serving.logprobs import LogprobRecorder
from engine.serving.output import OutputAssembler
from engine.serving.prefill_pace import PrefillPace
from engine.serving.request_handle import RequestHandle
from engine.serving.step import StepRow, StepRunner, run_step
from engine.speculation.adaptive import PassCosts
from engine.speculation.batch_speculation import BatchSpeculation, Sequence, StepCosts
from engine.speculation.logits_processors import LogitsProcessing
from engine.speculation.proposers.base import Proposal
from engine.speculation.proposers.draft import DraftPool, DraftProposer, DraftRequest
from engine.speculation.request import Speculation, record_proposal_cost

_tracer = trace.get_tracer("specgate.engine")

def reservation(prompt_tokens: int, max_tokens: int) -> int:
    """KV positions a request's slot may need: its prompt, its output and one step's rows
    (padding included: a pass near the end of a request writes that far past its committed
    tokens)."""
    return prompt_tokens + max_tokens + MAX_STEP_ROWS


@dataclass
class ActiveSequence:
    """One request in the running batch."""

    handle: RequestHandle
    method: Method
    speculation: Speculation | None
    stats: GenerationStats
    generator: torch.Generator
    output: OutputAssembler
    context: list[int]
    reserved: int  # KV positions this request may need (``reservation``)
    processing: LogitsProcessing | None = None
    recorder: LogprobRecorder | None = None
    slot: int = -1
    prefilled: int = 0  # prompt tokens cached so far; the target is len(prompt) - 1
    remaining: int = 0
    done: bool = False
    span: trace.Span | None = None
    started_decoding: bool = field(default=False)
    # The target's last hidden states of the prompt's cached positions, chunk by chunk, for
    # a proposer that drafts from them (``wants_hidden``); None for the others.
    prompt_hidden: list[torch.Tensor] | None = None

    @property
    def wants_hidden(self) -> bool:
        return self.hidden_observer is not None

    @property
    def hidden_observer(self) -> Callable[[torch.Tensor], None] | None:
        """The proposer's ``observe_hidden`` where it drafts from the target's hidden states."""
        proposer = self.speculation.proposer if self.speculation is not None else None
        if proposer is None or not proposer.wants_hidden:
            return None
        return proposer.observe_hidden

    @property
    def prefill_target(self) -> int:
        return self.stats.num_prompt_tokens - 1

    @property
    def decoding(self) -> bool:
        return self.prefilled >= self.prefill_target


@dataclass(frozen=True)
class BatchLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_kv_tokens: int | None  # reserved positions over all slots; None: no bound
    long_prefill_token_threshold: int  # most prompt tokens one sequence prefills per step
    # Prompt chunks at fixed boundaries (multiples of the threshold), never cut to what the
    # step's budget leaves, so a prompt's prefill passes do not depend on the batch.
    batch_invariant: bool = False
    # Most seconds one chunk pass should take, at the measured cost per prompt token
    # (``engine.serving.prefill_pace``); None: chunks are bounded in tokens only.
    max_prefill_chunk_seconds: float | None = None


class BatchScheduler:
    def __init__(
        self,
        runner: StepRunner,
        limits: BatchLimits,
        costs: PassCosts,
        steps: StepCosts,
        admit: Callable[[RequestHandle], ActiveSequence | None],
        finish: Callable[[ActiveSequence], None],
    ) -> None:
        self.runner = runner
        self.limits = limits
        self.costs = costs
        self.steps = steps
        self.proposal_lengths = BatchSpeculation(steps)
        self.pace = PrefillPace(limits.max_prefill_chunk_seconds, costs)
        self._admit = admit
        self._finish = finish
        self.running: list[ActiveSequence] = []
        self.waiting: deque[RequestHandle] = deque()
        self.last_batch_size = 0

    def run(self, requests: queue.Queue[RequestHandle | None]) -> None:
        """Serve until ``None`` arrives on ``requests`` and every request before it is done."""
        stopping = False
        while not (stopping and not self.running and not self.waiting):
            if not stopping:
                stopping = not self._take(requests, block=not (self.running or self.waiting))
            self._admit_waiting()
            try:
                budget = self._prefill(self._prefill_budget(), finishing=True)
                self._decode()
                self._prefill(budget, finishing=False)
            except Exception as exc:  # delivered to every running caller; the worker lives on
                for seq in self.running:
                    seq.handle.put(exc)
                    seq.done = True
            self._retire()

    def _take(self, requests: queue.Queue[RequestHandle | None], block: bool) -> bool:
        """Move requests from the bounded queue to ``waiting``, only as many as free slots
        (at least the head of the line): the rest stay in the queue, whose bound keeps
        overload an immediate ``QueueFullError``. False once the ``None`` sentinel arrives."""
        while len(self.waiting) < max(1, self.limits.max_num_seqs - len(self.running)):
            try:
                handle = requests.get(block=block)
            except queue.Empty:
                return True
            if handle is None:
                return False
            self.waiting.append(handle)
            block = False
        return True

    def _fits(self, reserved: int) -> bool:
        budget = self.limits.max_kv_tokens
        if budget is None:
            return True
        return reserved + sum(seq.reserved for seq in self.running) <= budget

    def _admit_waiting(self) -> None:
        while self.waiting and len(self.running) < self.limits.max_num_seqs:
            handle = self.waiting[0]
            if handle.cancelled:
                self.waiting.popleft()
                continue
            request = handle.request
            needed = reservation(len(request.prompt_ids), request.sampling.max_tokens)
            if self.running and not self._fits(needed):
                return  # waits for a sequence to leave (first come, first served)
            self.waiting.popleft()
            try:
                seq = self._admit(handle)
            except Exception as exc:
                handle.put(exc)
                continue
            if seq is None:
                continue
            seq.slot = len(self.running)
            self.runner.release(seq.slot)
            self.runner.reserve(seq.slot, seq.reserved)
            seq.span = _tracer.start_span("specgate.prefill", context=handle.otel_context)
            seq.span.set_attribute("specgate.prompt_tokens", len(seq.context))
            self.running.append(seq)

    def _prefill_budget(self) -> int:
        decoding = sum(1 for seq in self.running if seq.decoding and not seq.done)
        return max(self.limits.max_num_batched_tokens - decoding, 1)

    def _prefill(self, budget: int, finishing: bool) -> int:
        """Prompt chunks within ``budget``, the prompt with the least left first; with
        ``finishing`` only chunks that finish their prompt (those run before the decode pass).
        Returns the budget left."""
        pending = sorted(self.running, key=lambda seq: seq.prefill_target - seq.prefilled)
        threshold = self.limits.long_prefill_token_threshold
        # Batch-invariant chunks keep their fixed boundaries: a bound in time would make them
        # depend on how fast the machine ran.
        paced = threshold if self.limits.batch_invariant else self.pace.limit(threshold)
        spent = False
        for seq in pending:
            if budget <= 0:
                break
            if seq.decoding or seq.done:
                continue
            if seq.handle.cancelled:
                seq.done = True
                continue
            left = seq.prefill_target - seq.prefilled
            # A prompt the threshold prefills in one pass keeps it: cutting it would add a
            # pass to its own first token, for a wait the threshold already bounds.
            most = threshold if seq.prefill_target <= threshold else paced
            chunk = min(left, budget, most)
            if self.limits.batch_invariant and chunk < left:
                whole = min(left, threshold)
                if chunk < whole and spent:
                    break  # the whole chunk waits for a step with room for it
                chunk = whole  # the first chunk of a step runs whole: prefill always advances
            if finishing and chunk < left:
                continue  # a prompt with more left but a whole pass of its own may finish
            end = seq.prefilled + chunk
            feed = Feed(seq.slot, seq.context[seq.prefilled : end])
            started = time.perf_counter()
            if seq.wants_hidden:
                hidden = self.runner.forward_hidden([feed])[1][0]
                seq.prompt_hidden = [*(seq.prompt_hidden or []), hidden]
            else:
                self.runner.forward([feed], last_only=True)
            if self.runner.device.type == "cuda":  # the pass's time, not its launch's
                torch.cuda.synchronize(self.runner.device)
            self.pace.record(chunk, time.perf_counter() - started)
            budget -= chunk
            spent = True
            seq.prefilled = end
        return budget

    def _start_decoding(self, seq: ActiveSequence) -> None:
        seq.started_decoding = True
        if seq.span is not None:
            seq.span.end()
        seq.span = _tracer.start_span("specgate.decode", context=seq.handle.otel_context)
        if seq.speculation is not None:
            seq.speculation.begin(list(seq.context))
            observe = seq.hidden_observer
            if observe is not None and seq.prompt_hidden:
                observe(torch.cat(seq.prompt_hidden))
            seq.prompt_hidden = None

    def _decode(self) -> None:
        active = [seq for seq in self.running if seq.decoding and not seq.done]
        for seq in active:
            if seq.handle.cancelled:
                seq.done = True
        active = [seq for seq in active if not seq.done]
        if not active:
            return
        self.last_batch_size = len(active)
        for seq in active:
            seq.stats.max_batch_size = max(seq.stats.max_batch_size or 1, len(active))
        for seq in active:
            if not seq.started_decoding:
                self._start_decoding(seq)
        lengths = self.proposal_lengths.lengths(
            [
                Sequence(
                    seq.speculation, seq.stats.num_target_passes, seq.remaining, _catch_up(seq)
                )
                for seq in active
            ]
        )
        proposals = self._propose_all(active, lengths)
        rows = [
            StepRow(
                seq.slot,
                seq.context,
                proposal,
                seq.handle.request.sampling,
                seq.generator,
                seq.processing,
                None if seq.recorder is None else seq.recorder.observe,
                seq.hidden_observer,
            )
            for seq, proposal in zip(active, proposals, strict=True)
        ]
        fed = sum(len(row.proposal.tokens) + 1 for row in rows)
        started = time.perf_counter()
        verdicts = run_step(self.runner, rows)
        self.steps.record(len(active), fed, time.perf_counter() - started)
        for seq, row, verdict in zip(active, rows, verdicts, strict=True):
            proposal = row.proposal
            new_tokens = [*(proposal.tokens[i] for i in verdict.path), verdict.next_token]
            seq.context.extend(new_tokens)
            stats = seq.stats
            stats.record_step(len(proposal.tokens), len(verdict.path))
            stats.proposal_lengths.append(len(proposal.tokens))
            if seq.speculation is not None:
                seq.speculation.committed(seq.context, len(proposal.tokens), verdict.path)
            seq.remaining -= len(new_tokens)
            self._deliver(seq, new_tokens)

    def _propose_all(self, active: list[ActiveSequence], lengths: list[int]) -> list[Proposal]:
        """Each sequence's proposal of its chosen length: the draft model's sequences in
        shared draft passes (``DraftPool``), the others one by one."""
        proposals = [Proposal([]) for _ in active]
        shared: dict[int, tuple[DraftPool, list[int], list[DraftRequest]]] = {}
        for index, (seq, k) in enumerate(zip(active, lengths, strict=True)):
            speculation = seq.speculation
            if speculation is None or k <= 0:
                continue
            proposer = speculation.proposer
            params = seq.handle.request.sampling
            if isinstance(proposer, DraftProposer):
                pool = proposer.pool
                _, indices, requests = shared.setdefault(id(pool), (pool, [], []))
                indices.append(index)
                requests.append(
                    DraftRequest(
                        proposer,
                        seq.context,
                        k,
                        params,
                        seq.generator,
                        speculation.min_confidence,
                        seq.processing,
                    )
                )
                continue
            started = time.perf_counter()
            proposals[index] = proposer.propose(
                seq.context, k, params, seq.generator, speculation.min_confidence, seq.processing
            )
            if proposals[index].tokens:
                record_proposal_cost(
                    self.costs, proposer, time.perf_counter() - started,
                    len(proposals[index].tokens),
                )
        for pool, indices, requests in shared.values():
            started = time.perf_counter()
            rows = pool.catch_up(requests)
            self.costs.record_catch_up("draft", rows, time.perf_counter() - started)
            started = time.perf_counter()
            drafted = pool.propose(requests)
            for index, proposal in zip(indices, drafted, strict=True):
                proposals[index] = proposal
            self._record_proposer("draft", started, drafted)
        return proposals

    def _record_proposer(self, method: Method, started: float, proposals: list[Proposal]) -> None:
        """Seconds per proposed token (shared draft passes: per token of every sequence)."""
        tokens = sum(len(proposal.tokens) for proposal in proposals)
        if tokens:
            self.costs.record_proposer(method, (time.perf_counter() - started) / tokens)

    def _deliver(self, seq: ActiveSequence, tokens: list[int]) -> None:
        handle, stats = seq.handle, seq.stats
        before = len(seq.output.token_ids)
        piece = seq.output.add(tokens)
        logprobs = None
        if seq.recorder is not None:
            logprobs = seq.recorder.take(before, len(seq.output.token_ids))
        if not stats.time_to_first_token_s:
            stats.time_to_first_token_s = time.perf_counter() - handle.submitted_at
        stats.num_output_tokens = len(seq.output.token_ids)
        if piece.finish_reason is not None or seq.remaining <= 0:
            stats.total_time_s = time.perf_counter() - handle.submitted_at
            reason = piece.finish_reason or "length"
            handle.put(StreamDelta(piece.text, tuple(piece.token_ids), reason, stats, logprobs))
            seq.done = True
        elif piece.token_ids or piece.text:
            handle.put(StreamDelta(piece.text, tuple(piece.token_ids), logprobs=logprobs))

    def _retire(self) -> None:
        for seq in [seq for seq in self.running if seq.done or seq.handle.cancelled]:
            self._close(seq)
        self.running = [seq for seq in self.running if not seq.done]
        for slot, seq in enumerate(self.running):
            if seq.slot != slot:
                self.runner.move_slot(seq.slot, slot)
                seq.slot = slot

    def _close(self, seq: ActiveSequence) -> None:
        seq.done = True
        self.runner.release(seq.slot)
        if seq.speculation is not None and isinstance(seq.speculation.proposer, DraftProposer):
            seq.speculation.proposer.finish()
        if seq.span is not None:
            if seq.started_decoding:
                annotate(seq.span, seq.stats)
            seq.span.end()
            seq.span = None
        self._finish(seq)


def _catch_up(seq: ActiveSequence) -> int:
    """Committed tokens the sequence's proposer must feed before it can propose again (a
    draft whose cache fell behind during plain steps); 0 for the others."""
    proposer = seq.speculation.proposer if seq.speculation is not None else None
    if isinstance(proposer, DraftProposer) and proposer.slot is not None:
        return proposer.catch_up_rows(seq.context)
    return 0


def annotate(span: trace.Span, stats: GenerationStats) -> None:
    span.set_attributes(
        {**stats.span_attributes(), "specgate.output_tokens": stats.num_output_tokens}
    )
