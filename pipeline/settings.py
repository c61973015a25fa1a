"""The registry of stage settings models: each stage owns one pydantic model, registered under its name with
the spec's defaults (`@register_settings("gae") class GAESettings(StageSettings)`). pipeline.config builds the
validated models of a run from it; the credit engine reads the defaults from it when a batch has no config.
It imports nothing of the project, so a method module depends on it without reaching pipeline.config."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

SETTINGS_MODELS: dict[str, type[BaseModel]] = {}

M = TypeVar("M", bound=type[BaseModel])


def register_settings(stage: str):
    """Class decorator: `@register_settings("tcpo") class TCPOSettings(BaseModel): ...`."""

    def deco(cls: M) -> M:
        SETTINGS_MODELS[stage] = cls
        return cls

    return deco


class StageSettings(BaseModel):
    """Base for stage settings: unknown keys are errors, so a typo never silently falls back."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def default_settings(name: str) -> Any:
    """The registered model of `name` with its defaults (a KeyError names the registered ones)."""
    model = SETTINGS_MODELS.get(name)
    if model is None:
        raise KeyError(f"unknown stage settings {name!r}; known: {sorted(SETTINGS_MODELS)}")
    return model()
