"""Flow parameters: a deployment passes the config as JSON; flows take a `Config` or its dict."""

from __future__ import annotations

from typing import Any

from pipeline.config import Config, load_config


def as_config(config: Config | dict[str, Any]) -> Config:
    if isinstance(config, Config):
        return config
    return load_config(None, None, **config)


def config_parameter(config: Config) -> dict[str, Any]:
    """The config as a deployment parameter (plain JSON)."""
    return config.model_dump(mode="json")
