"""The registry of stage settings models: each stage owns one pydantic model, registered under its name with
the spec's defaults (`@register_settings("gae") class GAESettings(StageSettings)`); the class knows its name
(`GAESettings.settings_name == "gae"`). pipeline.config builds the validated models of a run from it
(`config.settings(GAESettings)`); the credit engine reads the defaults from it when a batch has no config.
It imports nothing of the project, so a method module depends on it without reaching pipeline.config."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict


class StageSettings(BaseModel):
    """Base for stage settings: unknown keys are errors, so a typo never silently falls back. `settings_name`
    is the name `register_settings` gave the class (its section under `stages:` and `--set name.key=`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    settings_name: ClassVar[str]


S = TypeVar("S", bound=StageSettings)

SETTINGS_MODELS: dict[str, type[StageSettings]] = {}


def register_settings(name: str) -> Callable[[type[S]], type[S]]:
    """Class decorator: `@register_settings("tcpo") class TCPOSettings(StageSettings): ...`."""

    def deco(cls: type[S]) -> type[S]:
        cls.settings_name = name
        SETTINGS_MODELS[name] = cls
        return cls

    return deco


def settings_name(model: type[StageSettings]) -> str:
    """The name `model` is registered under (a TypeError for a class `register_settings` did not decorate,
    a subclass of a registered model included: it would read its parent's section)."""
    name = model.__dict__.get("settings_name")
    if name is None or SETTINGS_MODELS.get(name) is not model:
        raise TypeError(f"{model.__name__} is not a registered settings model (@register_settings(name))")
    return name


def default_settings(name: str) -> StageSettings:
    """The registered model of `name` with its defaults (a KeyError names the registered ones)."""
    model = SETTINGS_MODELS.get(name)
    if model is None:
        raise KeyError(f"unknown stage settings {name!r}; known: {sorted(SETTINGS_MODELS)}")
    return model()


def named_settings(config, name: str) -> StageSettings:
    """The settings registered as `name` under `config` (a pipeline.config.Config), or their defaults where
    there is no config."""
    return config.settings_named(name) if config is not None else default_settings(name)
