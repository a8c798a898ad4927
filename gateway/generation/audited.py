"""One audited generation: OpenAI request -> `request` event -> backend -> `completion` event.

Fail closed: the `request` event is committed before the backend sees the request (or, with
``start_before_request_commit``, before anything the backend generated is read: the response
starts only after the commit, and a failed commit cancels the generation), and a
non-streaming response leaves only after its `completion` event is committed; a stream ends
with ``[DONE]`` only after its `completion` event is committed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import structlog

from engine.api.types import (
    EngineError,
    GenerationRequest,
    GenerationResult,
    GenerationStats,
    TokenLogprob,
)
from gateway.admission import Slots
from gateway.audit.log import AppendedEvent, AuditUnavailableError
from gateway.backends.base import Generation, GenerationBackend
from gateway.dependencies import Services
from gateway.errors import (
    audit_unavailable,
    completion_not_recorded,
    from_engine_error,
    shutting_down,
)
from gateway.generation.job import GENAI_OPERATIONS, Job
from gateway.generation.replies import speculative_usage, usage
from gateway.generation.stream import StreamChunks, error_chunk, sse
from gateway.keys import Principal
from gateway.lifecycle import ShutdownError
from gateway.observability.telemetry import CompletionTelemetry
from gateway.privacy.commitments import CommitmentKey, DataKey, text_bytes
from gateway.privacy.store import SealedContent, key_owner_subject, user_subject
from gateway.quota_gate import Ticket
from gateway.recording import (
    append_durably,
    combined_stats,
    completion_payload,
    request_payload,
    schedule_record,
)
from gateway.schemas import (
    SpeculativeUsage,
)
from gateway.served_models import ServedModel
from gateway.tune.sample import cluster_of

log = structlog.get_logger(__name__)

Answer = TypeVar("Answer")



@dataclass
class _ChoiceState:
    text: str = ""
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: GenerationStats | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)


@dataclass
class AuditedGeneration:
    """Runs one Job against the backend of the model it names, with its `request` and
    `completion` events."""

    services: Services
    principal: Principal
    model: ServedModel
    job: Job
    slots: Slots | None = None
    quota: Ticket | None = None  # charged the tokens served when the request closes
    started: float = field(default_factory=time.perf_counter)
    request_event: AppendedEvent | None = None
    choices: list[_ChoiceState] = field(default_factory=list)
    telemetry: CompletionTelemetry | None = None
    handles: list[Generation] = field(default_factory=list)
    closed: bool = False
    # The key the commitments are made under; a data key where content is stored.
    commitments: CommitmentKey | None = None
    data_key: DataKey | None = None

    @property
    def audit_id(self) -> str:
        assert self.request_event is not None
        return self.request_event.event_id

    @property
    def backend(self) -> GenerationBackend:
        return self.model.backend

    async def open(self) -> list[Generation]:
        """Commit the `request` event, then submit; returns the backend's generations.

        Runs under the completion's GenAI span, so that the audit write and the backend's spans
        are its children; `close` ends the span, or this method when nothing was audited."""
        job = self.job
        prompt = job.prompt.content
        self.telemetry = self.services.telemetry.start_completion(
            operation=GENAI_OPERATIONS[job.kind],
            model=self.backend.card.model_name,
            sampling=job.sampling[0],
            input_messages=prompt if job.kind == "chat" else [{"role": "user", "content": prompt}],
        )
        with self.telemetry.activate():
            try:
                return await self._submit()
            except BaseException:
                if self.request_event is None:
                    self.telemetry.record_error("audit_unavailable")
                    self.telemetry.end()
                raise

    async def _commitment_key(self, subject_ref: str) -> CommitmentKey:
        """The subject's data key where content is stored (fetched or created), else the
        deployment commitment key; AuditUnavailableError when the store does not answer."""
        privacy = self.services.privacy
        if not self.job.store_content:
            self.commitments = privacy.deployment_commitments
        else:
            self.data_key = await self.services.offload.db(privacy.data_key, subject_ref)
            self.commitments = self.data_key.commitments
        return self.commitments

    async def _submit(self) -> list[Generation]:
        """Commit the `request` event and hand the job to the backend: after the commit, or
        (``start_before_request_commit``) while it is in flight. Either way the generations
        are returned, and so read, only once the event is committed; when it is not, they
        are cancelled before anything of them was read."""
        job = self.job
        services = self.services
        early = services.settings.start_before_request_commit
        submit_error: EngineError | None = None
        self.choices = [_ChoiceState() for _ in job.sampling]
        subject = user_subject(job.user) if job.user else key_owner_subject(self.principal.key_id)
        subject_ref = services.privacy.subject_ref(subject)
        attempt: Future[AppendedEvent] | None = None
        try:
            commitments = await self._commitment_key(subject_ref)
            payload = request_payload(
                card=self.backend.card,
                backend=self.model.kind,
                principal=self.principal,
                route=job.route,
                request_id=job.request_id,
                prompt_commitment=commitments.commit(job.prompt.committed),
                commitment_key=commitments.description,
                prompt_tokens=len(job.prompt.token_ids),
                sampling=job.sampling[0],
                n=len(job.sampling),
                speculative=job.speculative,
                stream=job.stream,
                subject_ref=subject_ref,
                store_content=job.store_content,
                client_request_id=job.client_request_id,
                chat_template=job.prompt.template,
            )
            payload["instance_id"] = services.instance_id
            if self.principal.team is not None:
                payload["team"] = self.principal.team
            if self.data_key is None:
                attempt = services.appender.submit("request", self.principal.key_id, payload)
            else:
                content = {
                    "kind": job.kind,
                    "prompt": job.prompt.content,
                    "prompt_token_ids": list(job.prompt.token_ids),
                }
                attempt = services.offload.submit_db(
                    services.privacy.append_with_content,
                    "request",
                    self.principal.key_id,
                    payload,
                    self.data_key,
                    "prompt",
                    content,
                )
            if early:
                submit_error = self._start_backend()
            self.request_event = await services.offload.wait_db(attempt, "request append")
        except AuditUnavailableError as error:
            self._cancel_handles()
            log.error("request_not_audited", error=str(error))
            if attempt is not None:
                # Settled on a pool thread or on the loop: the spool's fsync goes to its own.
                io = services.offload.submit_io
                attempt.add_done_callback(lambda late: io(self._answer_late_request, late))
            raise audit_unavailable() from error
        except BaseException:
            self._cancel_handles()
            raise
        if not early:
            submit_error = self._start_backend()
        if submit_error is not None:
            self._cancel_handles()
            await self.close_quietly("error", str(submit_error))
            raise from_engine_error(submit_error) from submit_error
        services.lifecycle.track(self.handles)
        return self.handles

    def _start_backend(self) -> EngineError | None:
        """Submit every choice to the backend; the error that refused one (the ones already
        submitted stay in ``handles``, for the caller to cancel), or None."""
        job = self.job
        try:
            for index, sampling in enumerate(job.sampling):
                request = GenerationRequest(
                    prompt_ids=job.prompt.token_ids,
                    sampling=sampling,
                    speculative=job.speculative,
                    request_id=f"{job.request_id}-{index}",
                    compiled=job.compiled,
                )
                self.handles.append(self.backend.submit(request))
        except EngineError as error:
            return error
        return None

    def _cancel_handles(self) -> None:
        for handle in self.handles:
            handle.cancel()

    def _answer_late_request(self, attempt: Future[AppendedEvent]) -> None:
        """A `request` event that commits after the client was told 503 gets a `completion`
        saying it was not served (on the spool's thread; the spool never waits)."""
        if attempt.cancelled() or attempt.exception() is not None:
            return
        payload = self._completion_payload("not_served", "the request event committed late")
        payload["request_event_id"] = attempt.result().event_id
        try:
            self.services.spool.enqueue("completion", self.principal.key_id, payload)
        except OSError:
            log.exception("late_request_not_answered")

    async def run(self, render: Callable[[list[GenerationResult]], Answer]) -> Answer:
        """Non-streaming: wait for every choice, then commit the `completion` event and
        return ``render(results)``, which is built while the commit is in flight (it is
        returned, and so sent, only once the event is committed or spooled)."""
        handles = await self.open()
        try:
            results = list(await asyncio.gather(*(handle.result_async() for handle in handles)))
        except EngineError as error:
            await self.close_quietly("error", str(error))
            raise from_engine_error(error) from error
        except ShutdownError as error:
            await self.close_quietly("shutdown", str(error))
            raise shutting_down(str(error)) from error
        except BaseException:
            for handle in handles:
                handle.cancel()
            with anyio.CancelScope(shield=True):
                await self.close_quietly("cancelled", "the client disconnected")
            raise
        for state, result in zip(self.choices, results, strict=True):
            state.text, state.num_tokens = result.text, len(result.token_ids)
            state.token_ids = list(result.token_ids)
            state.logprobs = list(result.logprobs or ())
            state.finish_reason, state.stats = result.finish_reason, result.stats
        answers: list[Answer] = []
        try:
            await self.close("ok", None, lambda: answers.append(render(results)))
        except AuditUnavailableError as error:
            log.error("completion_not_audited", error=str(error))
            raise completion_not_recorded() from error
        return answers[0]

    async def stream(self, handles: list[Generation]) -> AsyncIterator[str]:
        """Server-sent events in OpenAI's chunk format, then usage (when asked), then
        ``[DONE]`` once the `completion` event is committed. Choices stream one after another."""
        usage_so_far = self.usage if self.job.continuous_usage else None
        chunks = StreamChunks(self.job, self.backend.card, usage_so_far)
        try:
            for index, handle in enumerate(handles):
                state = self.choices[index]
                reader = None if self.job.tools is None else self.job.tools.reader()
                if self.job.kind == "chat":
                    yield sse(
                        chunks.choice(index, {"delta": {"role": "assistant", "content": ""}}, None)
                    )
                async for delta in handle.deltas():
                    offset = len(state.text)
                    state.text += delta.text
                    state.num_tokens += len(delta.token_ids)
                    state.token_ids.extend(delta.token_ids)
                    if delta.finish_reason is not None:
                        state.finish_reason, state.stats = delta.finish_reason, delta.stats
                    if reader is not None:
                        for chunk in chunks.tool_deltas(
                            index, reader, delta.text, delta.finish_reason
                        ):
                            yield sse(chunk)
                        continue
                    if delta.text or delta.finish_reason is not None or delta.logprobs:
                        yield sse(
                            chunks.text(
                                index, delta.text, delta.finish_reason, delta.logprobs, offset
                            )
                        )
        except EngineError as error:
            await self.close_quietly("error", str(error))
            yield sse(error_chunk(from_engine_error(error)))
            return
        except ShutdownError as error:
            await self.close_quietly("shutdown", str(error))
            yield sse(error_chunk(shutting_down(str(error))))
            return
        except Exception as error:  # a fault in the backend: a server error, not a disconnect
            log.exception("stream_failed")
            await self.close_quietly("error", str(error))
            yield sse(error_chunk(from_engine_error(error)))
            return
        except BaseException:
            for handle in handles:
                handle.cancel()
            # The client went away: the task is being cancelled, so shield the audit write.
            with anyio.CancelScope(shield=True):
                await self.close_quietly("cancelled", "the client disconnected")
            raise
        try:
            await self.close("ok", None)
        except AuditUnavailableError as error:
            log.error("completion_not_audited", error=str(error))
            yield sse(error_chunk(completion_not_recorded()))
            return
        if self.job.include_usage:
            yield sse(chunks.usage(self.usage(), self.speculative()))
        yield "data: [DONE]\n\n"

    def usage(self) -> dict[str, int]:
        return usage(
            len(self.job.prompt.token_ids), sum(state.num_tokens for state in self.choices)
        )

    def stats(self) -> GenerationStats | None:
        return combined_stats([state.stats for state in self.choices if state.stats is not None])

    def speculative(self) -> SpeculativeUsage:
        """Figures over all choices; only once every choice has finished."""
        stats = self.stats()
        assert stats is not None and len(self.choices) > 0
        return speculative_usage(stats)

    def _completion_payload(self, outcome: str, error: str | None) -> dict[str, Any]:
        commitments = self.commitments
        assert commitments is not None
        return completion_payload(
            request_event_id=self.audit_id if self.request_event else "",
            outcome=outcome,
            error=error,
            commitments=[commitments.commit(text_bytes(state.text)) for state in self.choices],
            commitment_key=commitments.description,
            schedules=[schedule_record(state.stats) for state in self.choices],
            finish_reasons=[state.finish_reason for state in self.choices],
            prompt_tokens=len(self.job.prompt.token_ids),
            completion_tokens=sum(state.num_tokens for state in self.choices),
            stats=self.stats(),
            latency_s=time.perf_counter() - self.started,
        )

    def _sealed_completion(self) -> SealedContent | None:
        """The choices' text and tokens, encrypted under the subject's data key, where the
        request's content is stored: committed with the `completion` event, directly or from
        the durable spool (which never holds the text)."""
        if self.data_key is None:
            return None
        content = {"choices": [{"text": s.text, "token_ids": s.token_ids} for s in self.choices]}
        return SealedContent.seal(self.data_key, "completion", content)

    def finish(self) -> None:
        """Give back the request's admission slots and stop tracking its backend work."""
        self.services.lifecycle.forget(self.handles)
        if self.slots is not None:
            self.slots.release()
            self.slots = None

    async def close(
        self, outcome: str, error: str | None, meanwhile: Callable[[], None] | None = None
    ) -> None:
        """Commit the `completion` event for whatever the choices hold now: directly, or
        through the durable spool when the store does not answer in time. Raises
        AuditUnavailableError only when neither could take it. The telemetry of the result,
        and ``meanwhile``, run on the loop while the commit is in flight."""
        self.finish()
        self.closed = True
        payload = self._completion_payload(outcome, error)
        telemetry = self.telemetry
        assert telemetry is not None

        def alongside() -> None:
            self._record_outcome(telemetry, outcome)
            if meanwhile is not None:
                meanwhile()

        services = self.services
        charging = None
        if self.quota is not None:
            charging = services.quotas.charge(self.quota, self.usage()["total_tokens"])
        try:
            with telemetry.activate():
                await append_durably(
                    services.offload,
                    services.spool,
                    services.appender,
                    "completion",
                    self.principal.key_id,
                    payload,
                    self._sealed_completion(),
                    meanwhile=alongside,
                )
        finally:
            telemetry.end()
            if charging is not None:
                await services.quotas.settle(charging)

    def _record_outcome(self, telemetry: CompletionTelemetry, outcome: str) -> None:
        stats = self.stats()
        if stats is not None:
            model = self.backend.card.model_name
            telemetry.record_result(
                response_id=self.job.response_id,
                response_model=model,
                finish_reasons=[s.finish_reason for s in self.choices if s.finish_reason],
                stats=stats,
                output_texts=[state.text for state in self.choices],
            )
            workload = cluster_of({"route": self.job.route, "key_name": self.principal.name})
            self.services.acceptance.observe(model, workload, stats)
        if outcome != "ok":
            telemetry.record_error(outcome)

    async def close_quietly(self, outcome: str, error: str) -> None:
        """Record a failed or abandoned request; the client hears of the original failure."""
        try:
            await self.close(outcome, error)
        except AuditUnavailableError as audit_error:
            log.error("completion_not_audited", outcome=outcome, error=str(audit_error))
