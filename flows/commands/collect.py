"""`creditflow collect`: multi-turn rollouts of a policy in an environment, straight into the lake."""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("collect")
    def collect_cmd(
        model: Path = typer.Option(
            ..., "--model", help="Hugging Face model folder (the policy; tokenizer.json inside)"
        ),
        env: str | None = typer.Option(None, "--env", help="environment: search_qa | code_repair"),
        prompts: int | None = typer.Option(None, "--prompts", help="prompts (groups) this round"),
        samples: int | None = typer.Option(None, "--samples", help="samples per prompt (group size)"),
        round_: int = typer.Option(0, "--round", help="round number (lake partition)"),
        lake: str = typer.Option("lake", "--lake", help="lake: folder, file://, s3://BUCKET/PATH, gs://..."),
        endpoint: list[str] | None = typer.Option(
            None, "--endpoint", help="OpenAI-compatible base URL(s) (vllm backend)"
        ),
        turns: int | None = typer.Option(None, "--turns", help="turn budget K (default: the env's)"),
        backend: str | None = typer.Option(
            None,
            "--backend",
            help="vllm | local (default: vllm when an endpoint is "
            "configured or a managed server runs, else local)",
        ),
        config: Path | None = typer.Option(None, "--config", help="YAML config (stages.collect, llm)"),
        sets: list[str] = typer.Option([], "--set", help="collect.key=value overrides"),
    ) -> None:
        """Roll out prompts x samples episodes and write the round's trajectories + steps."""
        import trainer.loop  # noqa: F401 - registers the loop / train settings a shared config may carry
        import trainer.train  # noqa: F401
        from flows.config import load_config
        from flows.display import print_kv
        from pipeline.llm.types import LLMSettings
        from trainer.collect import CollectSettings, collect_to_lake, resolve_backend
        from warehouse.lake import Lake

        cfg = load_config(config, sets)
        base = cfg.settings(CollectSettings)
        upd = {
            k: v
            for k, v in {
                "env": env,
                "prompts": prompts,
                "samples": samples,
                "turns": turns,
                "backend": backend,
            }.items()
            if v is not None
        }
        settings = CollectSettings(**{**base.model_dump(), **upd})
        llm = LLMSettings.from_config(cfg, endpoints=list(endpoint) if endpoint else None)
        configured = list(endpoint or []) or list(cfg.llm.get("endpoints") or [])
        chosen = resolve_backend(settings.backend, configured, lake)
        res = collect_to_lake(
            Lake(lake),
            model,
            settings,
            round_,
            backend=chosen,
            llm_settings=llm,
            batch_groups=cfg.batch_groups,
        )
        print_kv("creditflow collect", {"round": round_, "env": settings.env, **res.stats, "lake": str(lake)})
