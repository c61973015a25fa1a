"""Progress of a running flow, for whoever shows it (the CLI's rich bars). The flow reports each stage's
size and every finished batch; nothing is shown unless a listener is installed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

Listener = Callable[[str, str, dict], None]  # (event, stage, info)
_listeners: list[Listener] = []


def report(event: str, stage: str, **info) -> None:
    for listener in list(_listeners):
        listener(event, stage, info)


@contextmanager
def listening(listener: Listener) -> Iterator[None]:
    _listeners.append(listener)
    try:
        yield
    finally:
        _listeners.remove(listener)


@contextmanager
def rich_progress(console=None) -> Iterator[None]:
    """One rich progress bar per stage: `stage  [bar]  done/total  cached`."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    bars: dict[str, TaskID] = {}
    cached: dict[str, int] = {}
    progress = Progress(
        TextColumn("{task.description:<16}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    )

    def on_event(event: str, stage: str, info: dict) -> None:
        if event == "stage":
            bars[stage] = progress.add_task(stage, total=info.get("total", 0), note="")
            cached[stage] = 0
        elif event == "batch" and stage in bars:
            cached[stage] += int(bool(info.get("cached")))
            progress.update(bars[stage], advance=1, note=f"cached {cached[stage]}" if cached[stage] else "")

    with progress, listening(on_event):
        yield
