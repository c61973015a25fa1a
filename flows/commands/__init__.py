"""CLI sub-commands; each module defines `register(app: typer.Typer)`."""
