"""Flow parameters: a deployment passes the config as JSON; flows take a `Config` or its dict."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.config import Config, ConfigError, build_config, parse_config_text


def load_config(path: str | Path | None = None, sets: list[str] | None = None, **fields: Any) -> Config:
    """The config of a command: the YAML file at `path` (if any), keyword fields, then `--set` overrides."""
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
    return build_config(None, None, **config)


def config_parameter(config: Config) -> dict[str, Any]:
    """The config as a deployment parameter (plain JSON)."""
    return config.model_dump(mode="json")
