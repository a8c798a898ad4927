"""The registry of speculation methods: one entry per method, registered by the method's own
module, so that adding a method touches that module (and its tests) only.

An entry (``MethodSpec``) says everything the rest of Specgate needs to know about a method:
its name, the names vLLM's ``--speculative-config`` gives it, the keys it adds to the
speculative configuration (``options``), the artefact it loads (a draft model, heads: the
``EngineConfig`` field that names its directory and the kind recorded in the audit log),
whether its proposals run a model (then the acceptance threshold applies and its pass is
timed at load), and ``load``, which loads the artefact and returns a factory of proposers.

A method module registers itself at import with ``register(MethodSpec(...))``. Every module
of the ``engine.speculation.proposers`` package is imported on the first look-up (``methods()``),
so a new ``engine/speculation/proposers/<name>.py`` is found without a list to extend. ``none``
(plain decoding, no proposer) is registered here.

Nothing here imports torch; the registering modules do, and they are imported only when a
name is first looked up.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from engine.config import EngineConfig
    from engine.models.model_runner import ModelRunner
    from engine.speculation.adaptive import PassCosts
    from engine.speculation.proposers.base import Proposer

PLAIN = "none"

# The EngineConfig fields (and settings, and CLI flags of the same names) that name an
# artefact's directory. Methods share them: both a draft model and a translated draft load
# from ``draft``; Medusa's heads, and any other heads trained on the target, from ``heads``.
ArtefactField = Literal["draft", "heads"]


@dataclass(frozen=True)
class ArtefactSpec:
    """What a method loads besides the target: ``kind`` as the audit log's ``artefacts`` list
    records it (``{"kind", "name", "version"}``), ``config_field`` the directory's field,
    ``description`` what an error asking for the directory calls it."""

    kind: str
    config_field: ArtefactField
    description: str


@dataclass(frozen=True)
class Artefact:
    """A loaded, versioned artefact (``engine.models.versioning.model_version`` of its
    directory)."""

    kind: str
    name: str
    version: str

    def as_dict(self) -> dict[str, str | None]:
        return {"kind": self.kind, "name": self.name, "version": self.version}


@dataclass(frozen=True)
class LoadContext:
    """What a method's ``load`` gets: the configuration, the loaded target (its runner is the
    engine's own), its tokenizer and version, and its vocabulary size."""

    config: EngineConfig
    target: PreTrainedModel
    target_runner: ModelRunner
    tokenizer: PreTrainedTokenizerBase
    target_version: str
    vocab_size: int
    # The engine's measured pass costs, for proposers that size their proposals by them.
    costs: PassCosts | None = None

    def artefact_dir(self, spec: MethodSpec) -> Path | None:
        return None if spec.artefact is None else getattr(self.config, spec.artefact.config_field)


@dataclass(frozen=True)
class LoadedMethod:
    """A method ready to serve. ``new_proposer`` makes one proposer per request (a proposer
    may keep per-request state, such as a draft cache). ``artefacts``: what it loaded, for the
    audit log. ``calibrate``: given a proposer, the runner whose one-token pass is its cost per
    proposed token, timed at load (None: not timed). ``batching_blocked_by``: why requests
    using it cannot share a batch (None: they can)."""

    new_proposer: Callable[[], Proposer]
    artefacts: tuple[Artefact, ...] = ()
    calibrate: Callable[[Proposer], ModelRunner | None] | None = None
    batching_blocked_by: str | None = None


@dataclass(frozen=True)
class MethodSpec:
    """One speculation method. ``vllm_names``: the ``method`` values of vLLM's
    ``--speculative-config`` that mean it (the first is the one Specgate writes).
    ``options``: a pydantic model of the keys the method adds to the speculative
    configuration (flat, beside ``method``), with defaults. ``model_based``: its proposals
    run a model, so a low acceptance rate alone says they do not pay (the default acceptance
    threshold applies to it). ``recognises``: whether an artefact directory is this method's
    (which method a ``heads`` directory means by default). ``load``: None only for plain
    decoding."""

    name: str
    vllm_names: tuple[str, ...] = ()
    options: type[BaseModel] | None = None
    artefact: ArtefactSpec | None = None
    model_based: bool = False
    recognises: Callable[[Path], bool] | None = None
    load: Callable[[LoadContext], LoadedMethod] | None = field(default=None, compare=False)


_registry: dict[str, MethodSpec] = {}
_lock = threading.Lock()
_discovered = False


def register(spec: MethodSpec) -> MethodSpec:
    """Add a method; registering a name twice is an error unless it is the same entry (a
    module imported twice under two names)."""
    with _lock:
        known = _registry.get(spec.name)
        if known is not None and known != spec:
            raise ValueError(f"speculation method {spec.name!r} is registered twice")
        taken = {
            n: other.name
            for other in _registry.values()
            if other.name != spec.name
            for n in other.vllm_names
        }
        clash = [n for n in spec.vllm_names if n in taken]
        if clash:
            raise ValueError(f"vLLM method name {clash[0]!r} already means {taken[clash[0]]!r}")
        _registry[spec.name] = spec
    return spec


def unregister(name: str) -> None:
    """Remove a method (tests register their own and take them out again)."""
    with _lock:
        _registry.pop(name, None)


def _discover() -> None:
    global _discovered
    if _discovered:
        return
    import engine.speculation.proposers as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    _discovered = True


def methods() -> Mapping[str, MethodSpec]:
    """Every registered method by name: ``none`` first, then those that load nothing, then
    those that load an artefact, each group by name (the order methods are listed in)."""
    _discover()
    with _lock:
        ordered = sorted(
            _registry.values(), key=lambda s: (s.name != PLAIN, s.artefact is not None, s.name)
        )
    return {s.name: s for s in ordered}


def method_names() -> tuple[str, ...]:
    return tuple(methods())


def spec(name: str) -> MethodSpec:
    found = methods().get(name)
    if found is None:
        raise ValueError(
            f"unknown speculation method {name!r}; registered: {', '.join(method_names())}"
        )
    return found


def check_registered(name: str) -> str:
    """``name`` if a method by that name is registered (a pydantic validator)."""
    spec(name)
    return name


# A method name in a pydantic model (configuration, settings, request), checked against the
# registry when validated.
RegisteredMethod = Annotated[str, AfterValidator(check_registered)]


def from_vllm_name(vllm_name: str) -> MethodSpec | None:
    """The method vLLM's ``--speculative-config`` ``method`` value means, if registered."""
    for candidate in methods().values():
        if vllm_name in candidate.vllm_names:
            return candidate
    return None


def vllm_names() -> tuple[str, ...]:
    return tuple(n for s in methods().values() for n in s.vllm_names)


def model_based() -> frozenset[str]:
    return frozenset(s.name for s in methods().values() if s.model_based)


def option_owner(key: str) -> MethodSpec | None:
    """The method whose options include ``key``."""
    for candidate in methods().values():
        if candidate.options is not None and key in candidate.options.model_fields:
            return candidate
    return None


def default_method(directories: Mapping[str, Path | None]) -> str | None:
    """The method a configuration that names no method means: the first registered one whose
    artefact directory is given and that recognises it as its own (or cannot tell), else the
    first whose directory is given at all (its loading then says what is wrong); None if no
    directory is given."""
    given = [
        candidate
        for candidate in methods().values()
        if candidate.artefact is not None
        and directories.get(candidate.artefact.config_field) is not None
    ]
    for candidate in given:
        assert candidate.artefact is not None
        directory = directories[candidate.artefact.config_field]
        assert directory is not None
        if candidate.recognises is None or candidate.recognises(directory):
            return candidate.name
    return given[0].name if given else None


def options_of(name: str, values: Mapping[str, Any]) -> BaseModel | None:
    """The method's options read from ``values`` (a speculative configuration's keys)."""
    options = spec(name).options
    if options is None:
        return None
    return options.model_validate({k: v for k, v in values.items() if k in options.model_fields})


register(MethodSpec(name=PLAIN))
