"""Gateway configuration: defaults < YAML file (``--config``) < ``SPECGATE_*`` variables < flags.

Every field is named the same in all three places (the YAML keys are the field names), so an
operator can move a setting between them without translating it.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from engine.config import (
    DType,
    EngineConfig,
    SpeculativeConfig,
    ToolCallParser,
    speculative_config_from_vllm,
)
from engine.speculation import methods
from engine.speculation.methods import RegisteredMethod
from gateway.audit.log import APPEND_LOCK_TIMEOUT_S
from gateway.audit.signing import DEFAULT_ORIGIN
from gateway.knobs import KNOBS, knob
from gateway.privacy.store import RETENTION_DAYS_DEFAULT
from gateway.tune.recommend import ACCEPTANCE_FLOOR
from gateway.tune.watch import DEFAULT_MARGIN, DEFAULT_WINDOW_TOKENS


class ConfigError(ValueError):
    """The configuration cannot be used; the message names the offending field."""


def _default_data_dir() -> Path:
    xdg = os.environ.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "share"
    return base / "specgate"


def _default_log_format() -> Literal["json", "console"]:
    return "console" if sys.stdout.isatty() else "json"


VllmPool = Literal["speculative", "plain"]


class VllmServerSettings(BaseModel):
    """One vLLM OpenAI-compatible server the gateway forwards to.

    The gateway cannot hash remote weights, so the operator names the model version:
    ``model_version`` directly, or ``model_dir``, a directory holding the manifest that
    ``specgate models hash DIR`` wrote beside the weights. ``speculative_config`` is what the
    server was started with, in vLLM's ``--speculative-config`` terms; ``pool`` defaults to
    ``speculative`` when it is set, else ``plain`` (requests with ``speculative: false``, and
    every request while speculation is switched off, go to the plain pool).
    """

    model_config = ConfigDict(extra="forbid")

    url: str
    served_model_name: str | None = Field(
        default=None, description="None: the one model the server lists at /v1/models."
    )
    model_version: str | None = None
    model_dir: Path | None = None
    speculative_config: dict[str, Any] | None = None
    pool: VllmPool | None = None

    @property
    def resolved_pool(self) -> VllmPool:
        if self.pool is not None:
            return self.pool
        return "speculative" if self.speculative_config else "plain"


class BackendSettings(BaseModel):
    """What generates tokens: the built-in engine (``local``: the engine fields of
    :class:`ModelSettings` apply) or vLLM servers (``vllm``)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["local", "vllm"] = "local"
    vllm_servers: list[VllmServerSettings] = Field(default_factory=list)
    health_interval_s: float = Field(
        default=2.0, gt=0, description="Active health check of each vLLM replica."
    )
    retry_interval_s: float = Field(
        default=5.0, gt=0, description="A replica taken out is checked again after this."
    )
    connect_timeout_s: float = Field(default=3.0, gt=0)
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="Longest wait for the next piece of a vLLM answer."
    )
    metrics_interval_s: float = Field(
        default=1.0, gt=0, description="Scrape of vllm:spec_decode_* where no per-request figures."
    )


class ModelSettings(BaseModel):
    """One served model: its backend and, for the built-in engine, its model directories,
    speculation, fallback and batching. The top level of :class:`Settings` holds these for a
    gateway that serves one model; each entry of ``models`` holds them for one of several."""

    model_config = ConfigDict(extra="forbid")

    backend: BackendSettings = Field(default_factory=BackendSettings)

    # The engine's knobs: each declared by its EngineConfig field (gateway.knobs).
    target: Path | None = knob("target")
    draft: Path | None = knob("draft")
    heads: Path | None = knob("heads")
    method: RegisteredMethod | None = knob("method")
    num_speculative_tokens: int | None = knob("num_speculative_tokens")
    speculative_config: str | None = Field(
        default=None, description="vLLM --speculative-config JSON."
    )
    max_speculative_tokens: int = knob("max_speculative_tokens")
    prompt_lookup_min: int | None = knob("prompt_lookup_min")
    prompt_lookup_max: int | None = knob("prompt_lookup_max")
    draft_confidence_threshold: float = knob("draft_confidence_threshold")
    acceptance_threshold: float = knob("acceptance_threshold")
    fallback_window_tokens: int = knob("fallback_window_tokens")
    fallback_probe_interval: int = knob("fallback_probe_interval")
    disable_by_queue_depth: int | None = knob("disable_by_queue_depth")
    dtype: DType = knob("dtype")
    device: str | None = knob("device")
    max_num_seqs: int = knob("max_num_seqs")
    max_num_batched_tokens: int = knob("max_num_batched_tokens")
    long_prefill_token_threshold: int = knob("long_prefill_token_threshold")
    max_prefill_chunk_seconds: float | None = knob("max_prefill_chunk_seconds")
    batch_invariant: bool = knob("batch_invariant")
    max_kv_tokens: int | None = knob("max_kv_tokens")
    fallback_min_speedup: float = knob("fallback_min_speedup")
    acceptance_thresholds: dict[RegisteredMethod, float] = knob("acceptance_thresholds")
    translate_draft_tokens: bool = knob("translate_draft_tokens")
    tool_call_parser: ToolCallParser | None = knob("tool_call_parser")

    @field_validator("speculative_config")
    @classmethod
    def _vllm_json_parses(cls, value: str | None) -> str | None:
        if value is not None:
            speculative_config_from_vllm(value)
        return value

    @field_validator("backend")
    @classmethod
    def _vllm_servers_given(cls, value: BackendSettings) -> BackendSettings:
        if value.kind == "vllm":
            if not value.vllm_servers:
                raise ValueError("kind 'vllm' needs at least one entry in vllm_servers")
            for index, server in enumerate(value.vllm_servers):
                if server.model_version is None and server.model_dir is None:
                    raise ValueError(
                        f"vllm_servers[{index}]: give model_version, or model_dir with the "
                        "manifest `specgate models hash DIR` writes"
                    )
                if server.resolved_pool == "speculative" and not server.speculative_config:
                    raise ValueError(
                        f"vllm_servers[{index}]: pool 'speculative' needs speculative_config"
                    )
        return value


class ServedModelSettings(ModelSettings):
    """One entry of ``models``: a model the gateway serves under ``name`` and ``aliases``
    (requests name either in their ``model`` field). The keys it leaves out take the top
    level's values, so that what all models share is written once."""

    name: str = Field(min_length=1, description="What `model` names; the audit records it.")
    aliases: list[str] = Field(default_factory=list, description="Other names that route here.")


@dataclass(frozen=True)
class ConfiguredModel:
    """A model to serve: its own settings (the top level's with its entry's keys over them;
    ``served_model_name`` is the entry's name), its aliases, and where its keys are written
    (``models[1]``, or ``""`` for the top level's one model)."""

    settings: Settings
    aliases: tuple[str, ...] = ()
    where: str = ""

    def located(self, error: ConfigError) -> ConfigError:
        """``error`` naming the entry it is about."""
        return ConfigError(f"{self.where}: {error}") if self.where else error


class Settings(BaseSettings, ModelSettings):
    model_config = SettingsConfigDict(env_prefix="SPECGATE_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)

    models: list[ServedModelSettings] = Field(
        default_factory=list,
        description="Several models, each with its name, aliases and backend; empty: the one "
        "model the top level describes.",
    )
    served_model_name: str | None = knob("served_model_name")
    max_queue: int = knob("max_queue")
    cpu_threads: int | None = knob("cpu_threads")

    data_dir: Path = Field(default_factory=_default_data_dir)
    instance_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=100,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="This gateway's stable identity (a StatefulSet pod name, a host name): its "
        "unanswered requests are marked interrupted when an instance with the same id starts. "
        "Unset: an id kept in the data directory. Never give two running replicas the same id.",
    )
    database_url: str = Field(
        default_factory=lambda data: (
            f"sqlite:///{data.get('data_dir', _default_data_dir())}/audit.db"
        )
    )
    migrate: bool = Field(
        default=True, description="Run migrations at startup (SQLite is always migrated)."
    )
    signing_key_path: Path = Field(
        default_factory=lambda data: (
            Path(data.get("data_dir", _default_data_dir())) / "audit-signing-key.pem"
        )
    )
    bootstrap_admin_key: SecretStr | None = None
    max_body_bytes: int = Field(default=1024 * 1024, ge=1)
    checkpoint_interval_s: float = Field(default=300.0, gt=0)
    audit_watch_interval_s: float = Field(
        default=5.0,
        gt=0,
        description="How often the gateway checks that the audit database still extends what "
        "it wrote and verified (the bound on an unseen truncation or rewrite while idle).",
    )
    audit_reverify_period_s: float = Field(
        default=86400.0,
        gt=0,
        description="The whole signed audit history is verified again within this period "
        "(a slice every hundredth of it, 1-60 s apart).",
    )
    store_content: bool = False

    log_format: Literal["json", "console"] = Field(default_factory=_default_log_format)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_content: bool = False
    otlp_endpoint: str | None = None
    otlp_protocol: Literal["http/protobuf", "grpc"] | None = Field(
        default=None,
        description="None: OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL, else http/protobuf.",
    )
    trace_content: bool = False
    metrics_vllm_names: bool = Field(
        default=False,
        description="Also export the speculation and token counters under vLLM's names "
        "(vllm:spec_decode_*, labelled model_name), for dashboards built for vLLM.",
    )
    egress_allowlist: list[str] = Field(default_factory=list)

    audit_mac_key_path: Path = Field(
        default_factory=lambda data: (
            Path(data.get("data_dir", _default_data_dir())) / "audit-mac-key"
        ),
        description="HMAC key for every audit event (shared by replicas; never in the DB).",
    )
    audit_state_path: Path = Field(
        default_factory=lambda data: (
            Path(data.get("data_dir", _default_data_dir())) / "audit-checkpoint-state.json"
        ),
        description="Where the last checkpoint this gateway signed is kept, outside the DB.",
    )
    privacy_kek_path: Path = Field(
        default_factory=lambda data: (
            Path(data.get("data_dir", _default_data_dir())) / "privacy-kek"
        ),
        description="Key-encryption key of the content data keys (a Secret; never in the DB).",
    )
    retention_days: int = Field(
        default=RETENTION_DAYS_DEFAULT,
        ge=1,
        description="Stored content is shredded this many days after its key was made.",
    )
    processing_record_path: Path | None = Field(
        default=None,
        description="The operator's record of processing activities (YAML, docs/compliance.md);"
        " each new version is recorded in the audit log at startup.",
    )
    retention_interval_s: float = Field(
        default=3600.0, gt=0, description="How often expired content keys are destroyed."
    )
    audit_lock_timeout_s: float = Field(
        default=APPEND_LOCK_TIMEOUT_S, gt=0, description="Longest wait for the append lock."
    )
    audit_origin: str = Field(
        default=DEFAULT_ORIGIN, description="The log's name in its signed checkpoints."
    )
    witness_public_key_path: Path | None = Field(
        default=None, description="PEM of the witness whose cosignatures /readyz may require."
    )
    witness_name: str = Field(default="specgate-witness", description="The witness key's name.")
    witness_max_age_s: float | None = Field(
        default=None, gt=0, description="/readyz fails without a cosignature this fresh."
    )
    # Reliability bounds (docs/reliability.md).
    db_connect_timeout_s: float = Field(
        default=3.0, gt=0, description="PostgreSQL connect timeout (libpq connect_timeout)."
    )
    db_statement_timeout_s: float = Field(
        default=5.0, gt=0, description="PostgreSQL statement_timeout of the gateway's sessions."
    )
    db_lock_timeout_s: float = Field(
        default=3.0, gt=0, description="PostgreSQL lock_timeout of the gateway's sessions."
    )
    audit_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Longest a request waits for a database call (key lookup, audit append) "
        "before it is answered 503 audit_unavailable; also bounds /readyz.",
    )
    start_before_request_commit: bool = Field(
        default=False,
        description="Start the engine on a request while its `request` event is being "
        "committed. No output leaves before the commit lands; if it fails the generation is "
        "cancelled and the client gets 503 audit_unavailable. Off: the engine is given the "
        "request only after the commit.",
    )
    key_cache_ttl_s: float = Field(
        default=5.0,
        ge=0,
        description="An API key the database accepted is trusted for this long without asking "
        "again; a key revoked on another replica or with the CLI stops working within it "
        "(at once when revoked through this gateway's admin API). 0: ask every time.",
    )
    gil_switch_interval_s: float = Field(
        default=0.0005,
        gt=0,
        description="Python's GIL switch interval while serving: how long the event loop may "
        "wait for the GIL behind the engine's thread (Python's default is 0.005).",
    )
    db_threads: int = Field(default=32, ge=1, description="Threads for database calls.")
    prepare_threads: int = Field(
        default=2, ge=1, description="Threads for chat templating and tokenizing."
    )
    max_prompt_bytes: int = Field(
        default=256 * 1024, ge=1, description="Prompt text (UTF-8 bytes) refused before tokenizing."
    )
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="A request's headers must arrive within this time."
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0, description="A request's whole body must arrive within this time."
    )
    keep_alive_timeout_s: int = Field(
        default=5, ge=1, description="An idle keep-alive connection is closed after this."
    )
    max_connections: int = Field(
        default=1024, ge=1, description="Open connections beyond this are answered 503."
    )
    shutdown_grace_s: float = Field(
        default=45.0,
        ge=0,
        description="On SIGTERM, the whole shutdown ends within this, database waits included. "
        "Streams may finish until its last audit_timeout_s (or its second half, if shorter), "
        "kept for the final records; the rest end with an error chunk and a `shutdown` "
        "outcome. Keep below the chart's terminationGracePeriodSeconds.",
    )
    spool_retry_s: float = Field(
        default=1.0, gt=0, description="Pause between attempts to commit spooled events."
    )
    lease_ttl_s: float = Field(
        default=30.0,
        gt=0,
        description="An instance that has not renewed its lease for this long is taken for "
        "gone: another instance marks its unanswered requests `interrupted`. Keep it well "
        "above lease_renew_s plus the database's worst stall.",
    )
    lease_renew_s: float = Field(
        default=10.0,
        gt=0,
        description="How often this instance renews its lease and looks for expired ones.",
    )
    tune_report: Path | None = Field(
        default=None,
        description="The tune.json that `specgate tune apply` applied: the acceptance each "
        "model, workload and method is expected to keep (acceptance drift on /metrics and in "
        "the audit log). Unset: the floor alone judges drift.",
    )
    drift_window_tokens: int = Field(
        default=DEFAULT_WINDOW_TOKENS,
        ge=1,
        description="Draft tokens of the newest requests per model, method and workload whose "
        "acceptance is judged for drift (judged once the window holds that many).",
    )
    drift_margin: float = Field(
        default=DEFAULT_MARGIN,
        ge=0.0,
        le=1.0,
        description="A drift: the window's acceptance below the tuning report's less this.",
    )
    drift_floor: float = Field(
        default=ACCEPTANCE_FLOOR,
        ge=0.0,
        le=1.0,
        description="A drift, with or without a tuning report: the window's acceptance below "
        "this.",
    )
    refusal_window_s: float = Field(
        default=10.0,
        gt=0,
        description="Requests refused at admission (429) are recorded as one counted "
        "`refused` audit event per window of this length.",
    )

    def configured_models(self) -> list[ConfiguredModel]:
        """The models to serve, in the order given: the entries of ``models``, else the one
        model of the top level."""
        if not self.models:
            return [ConfiguredModel(self)]
        return [
            ConfiguredModel(
                self.model_copy(
                    update={
                        **{
                            key: getattr(entry, key)
                            for key in entry.model_fields_set
                            if key in ModelSettings.model_fields
                        },
                        "served_model_name": entry.name,
                        "models": [],
                    }
                ),
                tuple(entry.aliases),
                f"models[{index}]",
            )
            for index, entry in enumerate(self.models)
        ]

    def outbound_backend_urls(self) -> dict[str, str]:
        """The URLs the backends connect to, for the egress guard (``source -> url``)."""
        urls = {}
        for model in self.configured_models():
            backend = model.settings.backend
            if backend.kind == "vllm":
                prefix = f"{model.where}." if model.where else ""
                for index, server in enumerate(backend.vllm_servers):
                    urls[f"{prefix}backend.vllm_servers[{index}].url"] = server.url
        return urls

    @model_validator(mode="after")
    def _model_names_unique(self) -> Settings:
        if self.models and self.served_model_name is not None:
            raise ValueError("served_model_name names the one model; with models, use name")
        seen: dict[str, int] = {}
        for index, entry in enumerate(self.models):
            for name in (entry.name, *entry.aliases):
                if name in seen:
                    raise ValueError(
                        f"models[{index}]: the name {name!r} is models[{seen[name]}]'s already"
                    )
                seen[name] = index
        return self

    @model_validator(mode="after")
    def _lease_renewed_in_time(self) -> Settings:
        if self.lease_renew_s >= self.lease_ttl_s:
            raise ValueError(
                f"lease_renew_s ({self.lease_renew_s:g}) must be below lease_ttl_s "
                f"({self.lease_ttl_s:g}), or a live instance's lease would expire"
            )
        return self

    @field_validator("database_url")
    @classmethod
    def _known_database(cls, value: str) -> str:
        if not value.startswith(("sqlite:", "postgresql:", "postgresql+psycopg:")):
            raise ValueError("must start with sqlite:, postgresql: or postgresql+psycopg:")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, YamlConfigSettingsSource(settings_cls)

    def public_snapshot(self) -> dict[str, Any]:
        """The configuration without secrets, as recorded in the `startup` audit event."""
        from sqlalchemy.engine import make_url

        snapshot = self.model_dump(mode="json", exclude={"bootstrap_admin_key"})
        snapshot["database_url"] = make_url(self.database_url).render_as_string(hide_password=True)
        snapshot["bootstrap_admin_key_set"] = self.bootstrap_admin_key is not None
        return snapshot


def vllm_backend_from_flags(
    kind: str | None,
    *,
    plain_urls: list[str],
    speculative_urls: list[str],
    speculative_config: str | None,
    model_version: str | None,
    model_dir: Path | None,
) -> dict[str, Any] | None:
    """The ``backend`` block ``specgate serve``'s flags describe; None when they name no
    servers (the YAML file's or the variables' block stands; ``--backend local`` aside)."""
    if not plain_urls and not speculative_urls:
        return {"kind": kind} if kind not in (None, "vllm") else None
    if kind not in (None, "vllm"):
        raise ConfigError(f"backend: --vllm-url does not go with --backend {kind}")
    spec: dict[str, Any] | None = None
    if speculative_urls:
        if speculative_config is None:
            raise ConfigError("backend: --vllm-speculative-url needs --vllm-speculative-config")
        try:
            spec = json.loads(speculative_config)
        except ValueError as error:
            raise ConfigError(f"backend: --vllm-speculative-config is not JSON: {error}") from None
    common: dict[str, Any] = {"model_version": model_version, "model_dir": model_dir}
    servers: list[dict[str, Any]] = [{"url": url, "pool": "plain", **common} for url in plain_urls]
    servers += [
        {"url": url, "pool": "speculative", "speculative_config": spec, **common}
        for url in speculative_urls
    ]
    return {"kind": "vllm", "vllm_servers": servers}


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        if item["type"] == "default_factory_not_called":
            continue  # a consequence of another field's error, reported on its own
        field = ".".join(str(part) for part in item["loc"]) or "configuration"
        lines.append(f"{field}: {item['msg']}")
    return "invalid configuration: " + "; ".join(lines)


def _yaml_error(config_file: Path, error: yaml.YAMLError) -> str:
    """One line naming the file and, where the parser knows it, the line and column."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        where = f"{config_file}, line {mark.line + 1}, column {mark.column + 1}"
        context = f" ({error.context})" if error.context else ""
        return f"config: {where}: {error.problem}{context}"
    return f"config: {config_file} is not YAML: {' '.join(str(error).split())}"


def _check_yaml(config_file: Path) -> None:
    """ConfigError when the file is not YAML, or not a mapping of setting names to values
    (read here too, so that the error is one line and not the YAML source's traceback)."""
    try:
        with config_file.open("rb") as stream:
            document = yaml.safe_load(stream)
    except yaml.YAMLError as error:
        raise ConfigError(_yaml_error(config_file, error)) from None
    if document is not None and not isinstance(document, dict):
        raise ConfigError(f"config: {config_file} must map setting names to values")


def load_settings(config_file: Path | None = None, **overrides: Any) -> Settings:
    """Read the configuration; ``overrides`` (flags that were given) win over everything.

    Raises ConfigError naming the field when any source holds an invalid value.
    """
    given = {key: value for key, value in overrides.items() if value is not None}
    try:
        if config_file is None:
            return Settings(**given)
        if not config_file.is_file():
            raise ConfigError(f"config: file {config_file} does not exist")
        _check_yaml(config_file)

        class FileSettings(Settings):
            model_config = SettingsConfigDict(yaml_file=config_file)

        return FileSettings(**given)
    except ValidationError as error:
        raise ConfigError(_describe(error)) from None


def _demo_pair() -> tuple[Path, Path | None]:
    """The demo target, and its draft once ``specgate models build-demo`` has distilled it."""
    from engine.training.demo.paths import default_demo_dir

    demo = default_demo_dir()
    target, draft = demo / "target", demo / "draft"
    if not (target / "config.json").is_file():
        raise ConfigError(
            f"target: no model given and the demo target is missing in {demo}; "
            "build it with `specgate models build-demo` or pass --target DIR"
        )
    return target, draft if (draft / "config.json").is_file() else None


DEMO_MODEL_NAME = "specgate-demo"


def engine_config(settings: Settings) -> EngineConfig:
    """The engine configuration the settings describe, checked before anything is loaded."""
    speculative = SpeculativeConfig()
    artefact_dirs: dict[str, Path | None] = {"draft": settings.draft, "heads": settings.heads}
    if settings.speculative_config is not None:
        speculative, vllm_model = speculative_config_from_vllm(settings.speculative_config)
        artefact = methods.spec(speculative.method).artefact
        if artefact is not None:
            artefact_dirs[artefact.config_field] = (
                artefact_dirs[artefact.config_field] or vllm_model
            )
    draft, heads = artefact_dirs["draft"], artefact_dirs["heads"]
    target = settings.target
    demo_without_draft = False
    if target is None:
        target, demo_draft = _demo_pair()
        draft = draft or demo_draft
        demo_without_draft = draft is None
    given: dict[str, Path | None] = {"draft": draft, "heads": heads}  # artefact directories
    for name, path in (("target", target), ("draft", draft), ("heads", heads)):
        if path is not None and not path.is_dir():
            raise ConfigError(f"{name}: {path} is not a model directory")
    method = settings.method
    if method is None and settings.speculative_config is None:
        # The method of the artefact given (engine.speculation.methods.default_method); the demo
        # serves with n-gram lookup until its draft is built.
        method = methods.default_method(given) or ("ngram" if demo_without_draft else "none")
    # Every other knob as given; a speculative one left unset (None) keeps the engine's
    # default or the --speculative-config's value.
    updates: dict[str, Any] = {
        entry.field: getattr(settings, name)
        for name, entry in KNOBS.items()
        if entry.owner is SpeculativeConfig
        and name != "method"
        and getattr(settings, name) is not None
    }
    if method is not None:
        updates["method"] = method
    knobs: dict[str, Any] = {
        entry.field: getattr(settings, name)
        for name, entry in KNOBS.items()
        if entry.owner is EngineConfig
    }
    knobs.update(
        target=target,
        draft=draft,
        heads=heads,
        served_model_name=settings.served_model_name
        or (DEMO_MODEL_NAME if settings.target is None else None),
    )
    try:
        return EngineConfig(
            **knobs,
            speculative=SpeculativeConfig.model_validate({**speculative.model_dump(), **updates}),
        )
    except ValidationError as error:
        artefact = methods.spec(method).artefact if method is not None else None
        if artefact is not None and given[artefact.config_field] is None:
            flag = f"--{artefact.config_field} DIR"
            raise ConfigError(
                f"method: {method!r} needs a {artefact.description} ({flag})"
            ) from None
        raise ConfigError(_describe(error)) from None
