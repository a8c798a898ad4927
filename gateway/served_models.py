"""The models a gateway serves, and the routing of a request's ``model`` field to one of them.

Each model has a backend of its own (the built-in engine, or a pool of vLLM servers) with its
own speculation defaults and fallback, a name (the backend card's ``model_name``, which the
responses and the audit record carry) and aliases. Clients may name a model by either; an
unknown name is OpenAI's 404 ``model_not_found``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from gateway.backends.base import GenerationBackend
from gateway.errors import APIError
from gateway.settings import ConfigError, ConfiguredModel, Settings


@dataclass(frozen=True)
class ServedModel:
    """One model: its backend, its aliases, and the settings it was loaded from."""

    backend: GenerationBackend
    aliases: tuple[str, ...]
    settings: Settings

    @property
    def name(self) -> str:
        return self.backend.card.model_name

    @property
    def kind(self) -> str:
        """What serves it: ``local`` (the built-in engine) or ``vllm``."""
        return self.settings.backend.kind


class ServedModels:
    """The served models in their configured order (the first answers where one must be
    chosen without a request naming it, such as the replay of a model no longer served)."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        if not models:
            raise ConfigError("models: at least one model must be served")
        self._models = tuple(models)
        self._by_name: dict[str, ServedModel] = {}
        for model in self._models:
            for name in (model.name, *model.aliases):
                other = self._by_name.setdefault(name, model)
                if other is not model:
                    raise ConfigError(f"models: two models are named {name!r}")

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models)

    @property
    def first(self) -> ServedModel:
        return self._models[0]

    @property
    def names(self) -> list[str]:
        return [model.name for model in self._models]

    def find(self, name: str) -> ServedModel | None:
        return self._by_name.get(name)

    def resolve(self, requested: str) -> ServedModel:
        """The model ``requested`` names, or the 404 OpenAI answers for an unknown model."""
        model = self._by_name.get(requested)
        if model is None:
            served = ", ".join(f"'{name}'" for name in self.names)
            raise APIError(
                404,
                f"The model '{requested}' does not exist. This server serves {served}.",
                param="model",
                code="model_not_found",
            )
        return model

    def close(self) -> None:
        for model in self._models:
            model.backend.close()


def load_models(
    configured: Sequence[ConfiguredModel], load: Callable[[Settings], GenerationBackend]
) -> ServedModels:
    """Load every configured model's backend in order; on a failure the ones loaded are
    closed, and a configuration error names the entry it is about."""
    loaded: list[ServedModel] = []
    try:
        for model in configured:
            try:
                backend = load(model.settings)
            except ConfigError as error:
                raise model.located(error) from None
            loaded.append(ServedModel(backend, model.aliases, model.settings))
        return ServedModels(loaded)
    except BaseException:
        for served in loaded:
            served.backend.close()
        raise
