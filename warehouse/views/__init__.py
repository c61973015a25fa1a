"""Named analysis views over the lake tables. Stages register the questions users ask as SQL views;
the catalog creates them in every connection, and the README documents each one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class View:
    name: str
    sql: str
    doc: str


VIEWS: dict[str, View] = {}


def register_view(name: str, sql: str, doc: str) -> View:
    view = View(name, sql.strip().rstrip(";"), doc)
    VIEWS[name] = view
    return view


def _load_all() -> None:
    """Import every module of this package: each registers its views."""
    import importlib
    import pkgutil

    for mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        importlib.import_module(f"warehouse.views.{mod}")


_load_all()
