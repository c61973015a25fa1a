"""Flow parameters: a deployment passes the config as JSON; flows take a `Config` or its dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import Config, ConfigError, build_config, parse_config_text

# the trainer's settings models (stages.loop / collect / train): registered before a command's config is built,
# so every command accepts a config file that holds them; imported then, not with the CLI (numpy, pyarrow)
TRAINER_SETTINGS = ("trainer.loop", "trainer.train")


def register_trainer_settings() -> None:
    import importlib

    for name in TRAINER_SETTINGS:
        importlib.import_module(name)


def load_config(path: str | Path | None = None, sets: list[str] | None = None, **fields: Any) -> Config:
    """The config of a command: the YAML file at `path` (if any), keyword fields, then `--set` overrides."""
    register_trainer_settings()
    data: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the config file ({exc.strerror or exc})") from exc
        data = parse_config_text(text, str(path))
    return build_config(data, sets, **fields)


def as_config(config: Config | dict[str, Any]) -> Config:
    if isinstance(config, Config):
        return config
    register_trainer_settings()
    return build_config(None, None, **config)


def config_parameter(config: Config) -> dict[str, Any]:
    """The config as a deployment parameter (plain JSON)."""
    return config.model_dump(mode="json")
