"""Each engine knob is declared once, by its EngineConfig (or SpeculativeConfig) field: the
gateway's settings and ``specgate serve``'s flags carry that declaration, never a copy."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import pytest
import typer
from pydantic.fields import FieldInfo

from engine.config import EngineConfig, SpeculativeConfig
from gateway.cli_serve import serve
from gateway.knobs import KNOBS, NOT_KNOBS
from gateway.settings import ModelSettings, ServedModelSettings, Settings


def _validators(field: FieldInfo) -> list[Any]:
    return [m for m in field.metadata if callable(getattr(m, "func", None))]


def _declared(field: FieldInfo) -> dict[str, Any]:
    """What a declaration says besides the type: default, bounds, description."""
    return {
        "default": field.default,
        "default_factory": field.default_factory,
        "bounds": [m for m in field.metadata if m not in _validators(field)],
        "description": field.description,
    }


def _type(field: FieldInfo) -> Any:
    """The field's annotation as written (pydantic moves an annotated type's validators
    into the field's metadata)."""
    validators = _validators(field)
    return Annotated[field.annotation, *validators] if validators else field.annotation


def test_every_engine_field_is_a_knob() -> None:
    knobbed = {(entry.owner, entry.field) for entry in KNOBS.values()}
    engine = {(EngineConfig, name) for name in EngineConfig.model_fields if name not in NOT_KNOBS}
    speculative = {(SpeculativeConfig, name) for name in SpeculativeConfig.model_fields}
    assert engine | speculative == knobbed


@pytest.mark.parametrize("name", sorted(KNOBS))
def test_the_setting_is_the_engine_field(name: str) -> None:
    entry = KNOBS[name]
    engine = entry.declared
    expected = _declared(engine)
    expected_type: Any = _type(engine)
    if entry.unset is not None:
        expected.update(
            default=None,
            default_factory=None,
            description=f"{engine.description} Unset: {entry.unset}",
        )
        expected_type = Optional[expected_type]  # noqa: UP045 (a value, compared)
    assert engine.description, f"EngineConfig's {entry.field} has no description"
    for model in (Settings, ModelSettings, ServedModelSettings):
        if name not in model.model_fields:
            assert model is not Settings, name
            continue
        setting = model.model_fields[name]
        assert _declared(setting) == expected, (model.__name__, name)
        assert _type(setting) == expected_type, (model.__name__, name)


def test_the_engine_rejects_what_the_settings_reject() -> None:
    """Same bounds, same message (the engine's)."""
    from gateway.settings import ConfigError, load_settings

    with pytest.raises(
        ConfigError, match=r"max_num_seqs: Input should be less than or equal to 256"
    ):
        load_settings(max_num_seqs=257)
    with pytest.raises(ConfigError, match=r"prompt_lookup_min: Input should be greater"):
        load_settings(prompt_lookup_min=0)


def _flags() -> dict[str, str | None]:
    """``specgate serve``'s options and their help, as click shows them."""
    app = typer.Typer()
    app.command()(serve)
    command = typer.main.get_command(app)
    return {
        str(param.name): getattr(param, "help", None)
        for param in command.params
        if param.param_type_name == "option"
    }


def test_serve_has_a_flag_for_every_engine_field_helped_by_its_description() -> None:
    flags = _flags()
    engine_knobs = [name for name, entry in KNOBS.items() if entry.owner is EngineConfig]
    assert set(engine_knobs) <= set(flags)
    for name, entry in KNOBS.items():
        if name in flags:
            assert flags[name] == entry.description, name
