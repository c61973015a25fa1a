"""Configuration: one YAML file names the lake, the methods, every stage's settings, the LLM endpoints and
the task runner. Each stage owns one pydantic settings model (registered by name, with the spec's
defaults); `--set stage.key=value` on the command line overrides any of them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

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


class ConfigError(ValueError):
    pass


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lake: str = Field("./lake", description="lake folder (or fsspec URL)")
    methods: list[str] = Field(default_factory=lambda: ["grpo"], description="method chains to compute")
    annotator: str = Field("rules", description="IAPO annotator: rules | llm")
    batch_groups: int = Field(64, ge=1, description="groups per processing batch (whole groups)")
    task_runner: str = Field("threads", description="threads | ray | dask")
    task_runner_address: str | None = Field(None, description="Ray/Dask cluster address (None: local)")
    max_workers: int = Field(2, ge=1, description="thread-runner workers")
    tokenizer: str | None = Field(None, description="tokenizer.json path; None: SmolLM2 (byte fallback)")
    llm: dict[str, Any] = Field(default_factory=dict, description="shared LLM client settings (endpoints, ...)")
    stages: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per-stage settings")

    def stage(self, name: str) -> BaseModel:
        """The validated settings model of one stage (defaults where the config is silent)."""
        _load_stage_modules()
        model = SETTINGS_MODELS.get(name)
        if model is None:
            raise ConfigError(f"unknown stage '{name}'; known: {sorted(SETTINGS_MODELS)}")
        try:
            return model(**self.stages.get(name, {}))
        except ValidationError as exc:
            raise ConfigError(f"settings of stage '{name}': {exc}") from exc

    def check(self) -> None:
        _load_stage_modules()
        for name in self.stages:
            self.stage(name)


def _load_stage_modules() -> None:
    # importing the credit package registers every method's settings model
    import pipeline.credit  # noqa: F401


def _parse_value(raw: str) -> Any:
    return yaml.safe_load(raw)


def apply_overrides(data: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """`key=value` sets a top-level field; `stage.key=value` a stage setting; values are YAML."""
    data = {**data, "stages": {k: dict(v) for k, v in (data.get("stages") or {}).items()}}
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value or stage.key=value, got {item!r}")
        key, raw = item.split("=", 1)
        value = _parse_value(raw)
        if "." in key:
            stage, skey = key.split(".", 1)
            if stage == "llm":
                data.setdefault("llm", {})
                data["llm"] = {**data["llm"], skey: value}
            else:
                data["stages"].setdefault(stage, {})[skey] = value
        else:
            data[key] = value
    return data


def load_config(path: str | Path | None = None, sets: list[str] | None = None, **fields: Any) -> Config:
    data: dict[str, Any] = {}
    if path is not None:
        text = Path(path).read_text()
        loaded = yaml.safe_load(text) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the config must be a mapping")
        data.update(loaded)
    data.update({k: v for k, v in fields.items() if v is not None})
    data = apply_overrides(data, sets or [])
    try:
        cfg = Config(**data)
    except ValidationError as exc:
        raise ConfigError(str(exc)) from exc
    cfg.check()
    return cfg
