"""A small draft model proposes k tokens autoregressively with its own KV cache.

Given ``min_confidence`` it stops after a token it is unsure of (its probability, or for a
sampled token the draft's top probability, below the threshold), like Hugging Face's
``assistant_confidence_threshold``: a distilled draft is unsure exactly where the target
tends to disagree, so the passes it would spend past that point are mostly wasted. Where the
proposal stops depends only on the draft's own state, so verification stays exact.

The draft proposes only ids below ``proposable_ids`` (the ids its tokenizer shares with the
target's, padded embedding rows excluded) and hands its probabilities over the target's
``target_ids`` (zero beyond), so a draft padded to another size verifies like any other.
A draft whose head covers a frequency-ranked subset of the vocabulary (``vocabulary``, the
sorted ids its head rows stand for; see ``engine.speculation.proposers.vocabulary``) scores only
those rows and proposes only those tokens: q is 0 elsewhere, which rejection sampling handles like
any other q. Past its own ``window`` of positions (a draft built for a shorter context than
the target's) it steps aside: it proposes nothing and the target decodes plainly.

Registered as the method ``draft`` (vLLM's ``draft_model``); it loads the model in
``EngineConfig.draft``, recorded in the audit log as a ``draft_model`` artefact.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.api.types import IncompatibleDraftError, Method, SamplingParams
from engine.models.batched_cache import supports_batching
from engine.models.loading import (
    check_draft_compatible,
    context_window,
    embedding_rows,
    input_rows,
    load_model,
    load_tokenizer,
)
from engine.models.model_runner import ModelRunner
from engine.models.packed_linear import pack_linear_weights
from engine.models.versioning import model_version
from engine.speculation.logits_processors import LogitsProcessing
from engine.speculation.methods import (
    Artefact,
    ArtefactSpec,
    LoadContext,
    LoadedMethod,
    MethodSpec,
    register,
)
from engine.speculation.proposers.base import Proposal, Proposer, TokenProposer
from engine.speculation.proposers.translating import TranslatingDraftProposer
from engine.speculation.proposers.vocabulary import load_head_vocabulary, restrict_head
from engine.speculation.sampling import probabilities, sample


class DraftHead:
    """What the draft may propose and how its logits map onto the target's ids."""

    def __init__(
        self,
        model: torch.nn.Module,
        target_ids: int,
        proposable_ids: int,
        vocabulary: torch.Tensor | None = None,
    ) -> None:
        self.target_ids = target_ids
        self.vocabulary = vocabulary
        # Ids the draft can read (its input embeddings; the head may be a subset).
        self.draft_ids = input_rows(model)  # type: ignore[arg-type]
        # The head rows it may propose from: a prefix, since a subset's ids are sorted.
        self.rows = (
            proposable_ids
            if vocabulary is None
            else int(torch.searchsorted(vocabulary, proposable_ids).item())
        )

    def readable(self, tokens: list[int]) -> bool:
        return all(t < self.draft_ids for t in tokens)

    def token(self, row: int) -> int:
        return row if self.vocabulary is None else int(self.vocabulary[row])

    def over_target_ids(self, q: torch.Tensor, fill: float) -> torch.Tensor:
        """Values over the head's rows placed on the target's ids, ``fill`` everywhere else."""
        if self.vocabulary is None:
            return torch.nn.functional.pad(q, (0, self.target_ids - len(q)), value=fill)
        full = q.new_full((self.target_ids,), fill)
        full[self.vocabulary[: self.rows].to(q.device)] = q
        return full


@dataclass
class Drafting:
    """One sequence's proposal being drawn, a token per draft pass, with its own generator."""

    head: DraftHead
    k: int
    params: SamplingParams
    generator: torch.Generator
    min_confidence: float = 0.0
    processing: LogitsProcessing | None = None
    tokens: list[int] = field(default_factory=list)
    rows: list[torch.Tensor] = field(default_factory=list)
    done: bool = False

    def take(self, logits: torch.Tensor) -> int | None:
        """Draw the next token from the draft's last logits row; None once the proposal is
        complete (k tokens, a token it is unsure of, or nothing the constraints allow)."""
        logits = logits[: self.head.rows]
        head, params, min_confidence = self.head, self.params, self.min_confidence
        if self.processing is not None:
            # Processed over the target's ids, as the target's rows are: the draft's
            # logits placed on their ids, -inf where the draft cannot propose.
            full = head.over_target_ids(logits, float("-inf"))
            full = self.processing.apply(full.unsqueeze(0), [self.tokens])[0]
            if not torch.isfinite(full.amax()):
                self.done = True  # the draft has no token the constraints allow here
                return None
            index = int(full.argmax().item())
            if params.greedy:
                token = index
                sure = min_confidence <= 0.0 or bool(
                    torch.softmax(full, dim=-1)[index] >= min_confidence
                )
            else:
                q = probabilities(full, params)
                token = sample(q, self.generator)
                self.rows.append(q)
                sure = bool(q.max() >= min_confidence)
        elif params.greedy:
            index = int(logits.argmax().item())
            token = head.token(index)
            sure = min_confidence <= 0.0 or bool(
                torch.softmax(logits, dim=-1)[index] >= min_confidence
            )
        else:
            q = head.over_target_ids(probabilities(logits, params), 0.0)
            token = sample(q, self.generator)
            self.rows.append(q)
            sure = bool(q.max() >= min_confidence)
        self.tokens.append(token)
        self.done = not sure or len(self.tokens) >= self.k
        return None if self.done else token

    def proposal(self) -> Proposal:
        return Proposal(self.tokens, probs=torch.stack(self.rows) if self.rows else None)


def agreeing_prefix(cached: list[int], agreed: int, context: list[int]) -> int:
    """How much of the draft's cached tokens the committed ``context`` keeps: everything up
    to ``agreed`` (the context at the last proposal), then as long as they match."""
    keep = min(agreed, len(cached))
    limit = min(len(cached), len(context))
    while keep < limit and cached[keep] == context[keep]:
        keep += 1
    return keep


class DraftModelProposer(TokenProposer):
    method: Method = "draft"
    proposes_trees = False
    most_tokens: int | None = None

    def __init__(
        self,
        runner: ModelRunner,
        target_ids: int,
        proposable_ids: int,
        window: int,
        vocabulary: torch.Tensor | None = None,
    ) -> None:
        self.runner = runner
        self.head = DraftHead(runner.model, target_ids, proposable_ids, vocabulary)
        self.window = window
        # Token ids whose keys and values the draft cache holds, position for position.
        self.cached: list[int] = []
        # Length of the committed context at the last proposal: the cache agrees up to here.
        self.agreed = 0

    def start(self, prompt_ids: list[int]) -> None:
        self.runner.reset()
        self.cached = []
        self.agreed = 0

    def propose(
        self,
        context: list[int],
        k: int,
        params: SamplingParams,
        generator: torch.Generator,
        min_confidence: float = 0.0,
        processing: LogitsProcessing | None = None,
    ) -> Proposal:
        # Feed whatever of the context the cache lacks (the last token, plus any accepted
        # tokens the draft never saw), then extend one token at a time.
        pending = context[len(self.cached) :]
        self.agreed = len(context)
        k = min(k, self.window - len(context))
        if k <= 0 or not self.head.readable(pending):
            return Proposal([])
        drafting = Drafting(self.head, k, params, generator, min_confidence, processing)
        while True:
            logits = self.runner.forward(pending, last_only=True)[-1]
            self.cached.extend(pending)
            token = drafting.take(logits)
            if token is None:
                return drafting.proposal()
            pending = [token]

    def accepted(self, context: list[int]) -> None:
        # Keep the cached prefix that agrees with the committed context; drop the rest.
        keep = agreeing_prefix(self.cached, self.agreed, context)
        self.runner.truncate(keep)
        del self.cached[keep:]


def _load(context: LoadContext) -> LoadedMethod:
    """The draft model in ``config.draft``, checked against the target's vocabulary; one with
    another tokenizer proposes through ``TranslatingDraftProposer`` where the configuration
    allows it (``translate_draft_tokens``), else it is refused."""
    config = context.config
    directory = context.artefact_dir(DRAFT)
    assert directory is not None  # EngineConfig refuses the method without one
    target = context.target
    draft_tokenizer = load_tokenizer(directory)
    draft = load_model(directory, target.device, config.dtype)
    try:
        check_draft_compatible(
            context.tokenizer, draft_tokenizer, embedding_rows(draft), embedding_rows(target)
        )
        translated = False
    except IncompatibleDraftError:
        if not config.translate_draft_tokens:
            raise
        translated = True
    artefacts = (Artefact("draft_model", directory.name, model_version(directory)),)
    window = context_window(draft.config)
    target_ids = context.vocab_size
    if translated:  # a translated draft keeps its full head, over its own ids
        pack_linear_weights(draft)
        tokenizer = context.tokenizer
        return LoadedMethod(
            lambda: TranslatingDraftProposer(
                ModelRunner(draft), tokenizer, draft_tokenizer, target_ids=target_ids, window=window
            ),
            artefacts,
            calibrate=_runner,
        )
    vocabulary = load_head_vocabulary(directory, embedding_rows(draft))
    if vocabulary is not None:
        restrict_head(draft, vocabulary)
    pack_linear_weights(draft)  # after the head is cut: it packs the head it serves
    proposable = min(len(context.tokenizer), input_rows(draft), target_ids)
    if supports_batching(target.config) and supports_batching(draft.config):
        # One draft cache with a slot per running sequence: a step drafts for all of them in
        # shared passes (engine.speculation.proposers.batched_draft); one more slot for the
        # engine's own proposer instance. Imported here: batched_draft builds on this module.
        from engine.speculation.proposers.batched_draft import BatchedDraft, BatchedDraftProposer

        drafts = BatchedDraft(
            draft,
            config.max_num_seqs + 1,
            target_ids=target_ids,
            proposable_ids=proposable,
            window=window,
            vocabulary=vocabulary,
            invariant=config.batch_invariant,
        )
        return LoadedMethod(
            lambda: BatchedDraftProposer(drafts),
            artefacts,
            calibrate=lambda _proposer: ModelRunner(draft),
        )
    return LoadedMethod(
        lambda: DraftModelProposer(
            ModelRunner(draft),
            target_ids=target_ids,
            proposable_ids=proposable,
            window=window,
            vocabulary=vocabulary,
        ),
        artefacts,
        calibrate=_runner,
    )


def _runner(proposer: Proposer) -> ModelRunner | None:
    """A draft's cost per proposed token is one pass of its model."""
    assert isinstance(proposer, DraftModelProposer | TranslatingDraftProposer)
    return proposer.runner


DRAFT = register(
    MethodSpec(
        name="draft",
        vllm_names=("draft_model", "draft"),
        artefact=ArtefactSpec("draft_model", "draft", "draft model"),
        model_based=True,
        load=_load,
    )
)
