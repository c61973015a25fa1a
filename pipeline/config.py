"""Configuration: one YAML file names the lake, the methods, every stage's settings, the LLM endpoints and
the task runner. Each stage owns one pydantic settings model (registered by name, with the spec's
defaults); `--set stage.key=value` on the command line overrides any of them."""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipeline.settings import SETTINGS_MODELS, S, StageSettings, register_settings, settings_name

__all__ = ["SETTINGS_MODELS", "Config", "ConfigError", "StageSettings", "build_config", "register_settings"]


class ConfigError(ValueError):
    pass


class FlowSettings(BaseModel):
    """How the Prefect flows run a round (flows/): caching, retries, the export stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cache: bool = Field(True, description="skip a batch stage whose inputs, settings and code are unchanged")
    retries: int = Field(
        3, ge=0, description="retries of an LLM stage task (annotate with llm, counterfactual)"
    )
    retry_delay_s: float = Field(2.0, ge=0, description="first retry delay; doubles on each retry (backoff)")
    export: bool = Field(
        True,
        description="write the train_batch table (per batch and method) after credit: what `creditflow export` "
        "and the trainer loop read (off: neither can export the round)",
    )
    progress: bool = Field(True, description="rich progress bars per stage on the terminal")
    max_failed_share: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="an LLM stage whose failed requests (after retries and service restarts, or too long for "
        "the context) exceed this share of its requests fails the run: `process` exits 1 with one line naming "
        "the stage, the count and the cause (its fallbacks are written, and recomputed next run)",
    )
    allow_degraded: bool = Field(
        False, description="accept a run above max_failed_share (`process --allow-degraded`): it only warns"
    )
    lock_wait_s: float = Field(
        0.0,
        ge=0,
        description="when another run is processing the same (lake, round): wait up to this long for it "
        "(.inf: as long as it runs), then run, finding its work cached; 0: stop at once with one line "
        "(`creditflow process --wait`)",
    )
    processes: Literal["auto"] | bool = Field(
        "auto",
        description="run the thread runner's batch stages in worker processes (the stages hold the GIL); "
        "auto / true: with the thread runner; false: never; LLM stages stay in threads",
    )
    api_idle: bool = Field(
        True,
        description="when the stage workers fill every CPU, the run's own Prefect API server (ephemeral) gets "
        "only idle CPU while the batch stages run (Linux SCHED_IDLE), its bookkeeping catching up "
        "in the gaps and after them; never a server named by PREFECT_API_URL (flows/api_priority.py)",
    )


class ServeSettings(BaseModel):
    """`creditflow serve`: the deployments it starts (a cron schedule and an incoming-folder trigger)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    incoming: str | None = Field(
        None, description="folder watched for new rounds (files or folders); None: off"
    )
    incoming_format: str = Field(
        "chat-jsonl", description="ingest format of incoming files (`creditflow ingest --format`)"
    )
    poll_interval_s: int = Field(60, ge=1, description="how often the incoming folder is polled")
    settle_s: float = Field(2.0, ge=0, description="a file is taken once unmodified for this long")
    cron: str | None = Field(
        None, description="cron schedule of the process-pending-rounds deployment; None: off"
    )


TRACKERS = ("mlflow", "wandb", "tensorboard")


class TrackSettings(BaseModel):
    """Experiment trackers (`--track` / `track:`): where each round's credit statistics, summary and report go."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mlflow_uri: str | None = Field(None, description="MLflow tracking URI (None: a file store LAKE/_mlruns)")
    mlflow_experiment: str = Field("creditflow", description="MLflow experiment name")
    wandb_project: str = Field("creditflow", description="W&B project")
    wandb_entity: str | None = Field(None, description="W&B entity (None: the account's default)")
    wandb_mode: str | None = Field(
        None, description="W&B mode: online | offline (None: WANDB_MODE or online)"
    )
    wandb_dir: str | None = Field(None, description="W&B local folder (None: LAKE/_wandb)")
    tensorboard_dir: str | None = Field(None, description="TensorBoard log dir (None: LAKE/_tensorboard)")
    report: bool = Field(True, description="build the round's HTML report and attach it as an artifact")


class Config(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lake: str = Field("./lake", description="lake folder (or fsspec URL)")
    methods: list[str] = Field(default_factory=lambda: ["grpo"], description="method chains to compute")
    annotator: str = Field("rules", description="IAPO annotator: rules | llm")
    batch_groups: int = Field(64, ge=1, description="groups per processing batch (whole groups)")
    task_runner: str = Field("threads", description="threads | processes | ray | dask")
    task_runner_address: str | None = Field(None, description="Ray/Dask cluster address (None: local)")
    max_workers: int = Field(2, ge=1, description="thread-runner workers")
    tokenizer: str | None = Field(None, description="tokenizer.json path; None: SmolLM2 (byte fallback)")
    llm: dict[str, Any] = Field(
        default_factory=dict, description="shared LLM client settings (endpoints, ...)"
    )
    stages: dict[str, dict[str, Any]] = Field(default_factory=dict, description="per-stage settings")
    flow: FlowSettings = Field(default_factory=FlowSettings, description="Prefect flow settings")
    serve: ServeSettings = Field(default_factory=ServeSettings, description="`creditflow serve` deployments")
    track: list[str] = Field(
        default_factory=list, description="experiment trackers: mlflow | wandb | tensorboard"
    )
    tracking: TrackSettings = Field(default_factory=TrackSettings, description="experiment tracker settings")

    @field_validator("track")
    @classmethod
    def _known_trackers(cls, value: list[str]) -> list[str]:
        unknown = [t for t in value if t not in TRACKERS]
        if unknown:
            raise ValueError(f"unknown tracker(s) {', '.join(unknown)}; known: {', '.join(TRACKERS)}")
        return list(dict.fromkeys(value))

    def settings(self, model: type[S]) -> S:
        """The validated settings of the stage whose registered model is `model` (defaults where the config is
        silent): `config.settings(GAESettings).lam`."""
        return self._validated(settings_name(model), model)

    def settings_named(self, name: str) -> StageSettings:
        """The validated settings model registered as `name`, for code that holds only a name (a stage's
        declared settings, a cache key); a ConfigError names the registered ones."""
        if name not in SETTINGS_MODELS:  # the stage modules register their models when imported
            _load_stage_modules()
        model = SETTINGS_MODELS.get(name)
        if model is None:
            raise ConfigError(f"unknown stage '{name}'; known: {sorted(SETTINGS_MODELS)}")
        return self._validated(name, model)

    def _validated(self, name: str, model: type[S]) -> S:
        try:
            return model(**self.stages.get(name, {}))
        except ValidationError as exc:
            raise ConfigError(f"settings of stage '{name}': {validation_line(exc)}") from exc

    def check(self) -> None:
        """Every stage's settings and every method chain, before any work starts (one line naming the bad one)."""
        import importlib
        import importlib.util

        _load_stage_modules()
        for name in self.stages:
            self.settings_named(name)
        registry = importlib.import_module("pipeline.credit.registry")
        for method in self.methods:
            try:
                registry.parse_method(method)
            except ValueError as exc:
                raise ConfigError(str(exc)) from exc
        needs = [(m, e) for r, m, e in EXTRA_NEEDS if r in (self.task_runner, f"annotator={self.annotator}")]
        for module, extra in needs:
            if importlib.util.find_spec(module) is None:
                what = self.task_runner if extra in ("ray", "dask") else f"annotator {self.annotator}"
                raise ConfigError(f"{what} needs {module}: pip install 'creditflow[{extra}]'")


# (setting, module it imports, extra that installs it): checked when the config is built
EXTRA_NEEDS = (
    ("ray", "prefect_ray", "ray"),
    ("ray", "ray", "ray"),
    ("dask", "prefect_dask", "dask"),
    ("annotator=llm", "openai", "llm"),
)


def validation_line(exc: ValidationError) -> str:
    """A pydantic error as one line: `field: message` for each error."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'value'}: {e['msg']}"
        + (
            f" (got {e['input']!r})"
            if e["type"] != "extra_forbidden" and not isinstance(e["input"], dict)
            else ""
        )
        for e in exc.errors()
    )


def _load_stage_modules() -> None:
    # plugin discovery by name (the packages import this module, so not a static import): the credit package
    # registers every method's settings model, the annotation stage packages theirs (detect, annotate_rules /
    # annotate_llm, counterfactual)
    import importlib

    importlib.import_module("pipeline.credit")
    importlib.import_module("pipeline.stages").load_stages()
    for module in ("pipeline.annotate.settings", "pipeline.verifiers.code"):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


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
            if stage in ("llm", "flow", "serve", "tracking"):  # nested top-level mappings, not stage settings
                data[stage] = {**(data.get(stage) or {}), skey: value}
            else:
                data["stages"].setdefault(stage, {})[skey] = value
        else:
            data[key] = value
    return data


def build_config(data: dict[str, Any] | None = None, sets: list[str] | None = None, **fields: Any) -> Config:
    """A validated `Config` from a mapping (a parsed YAML file), keyword fields, then `--set` overrides."""
    merged: dict[str, Any] = dict(data or {})
    merged.update({k: v for k, v in fields.items() if v is not None})
    merged = apply_overrides(merged, sets or [])
    try:
        cfg = Config(**merged)
    except ValidationError as exc:
        raise ConfigError(f"config: {validation_line(exc)}") from exc
    cfg.check()
    return cfg


def parse_config_text(text: str, source: str = "config") -> dict[str, Any]:
    """A YAML config file's text -> its mapping (a ConfigError naming the source otherwise)."""
    try:
        loaded = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML ({exc})") from exc
    if not isinstance(loaded, dict):
        raise ConfigError(f"{source}: the config must be a mapping")
    return loaded
