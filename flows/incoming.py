"""Flows the `creditflow serve` deployments run: `incoming_flow` ingests and processes each new round that
appears in the incoming folder; `process_pending_flow` (the cron deployment) processes every round of the
lake whose credit is incomplete."""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from flows.config import as_config
from pipeline.config import Config
from pipeline.credit.process import CREDIT
from pipeline.stages import get_stage
from warehouse.lake import Lake

log = logging.getLogger(__name__)


def _process(config: Config, round_: int) -> dict:
    """The round's summary, processed as every run is (flows.run.process_checked_round: under its lock)."""
    from flows.run import process_checked_round

    return process_checked_round(config, Lake(config.lake), round_)


def poll_incoming(
    config: Config,
    trigger: Callable[[], Any],
    finished: Callable[[Any], bool],
    stop: threading.Event,
    max_polls: int | None = None,
) -> int:
    """`creditflow serve`'s folder watch: every `serve.poll_interval_s` look at the incoming folder (a directory
    listing, no Prefect call) and `trigger()` the incoming flow only when a settled new entry is there and the
    run triggered before has `finished`; so an idle folder creates no flow runs. Returns the runs triggered."""
    from warehouse.incoming import new_entries

    if not config.serve.incoming:
        raise ValueError("serve.incoming is not set: no incoming folder to poll")
    incoming = Path(config.serve.incoming).expanduser().resolve()
    pending, triggered, polls = None, 0, 0
    while not stop.is_set() and (max_polls is None or polls < max_polls):
        polls += 1
        if pending is not None and finished(pending):
            pending = None
        if pending is None and new_entries(incoming, config.serve.settle_s):
            log.info("incoming: new entries in %s, starting the incoming flow", incoming)
            pending = trigger()
            triggered += 1
        stop.wait(config.serve.poll_interval_s)
    return triggered


@flow(name="incoming", validate_parameters=False)
def incoming_flow(config: Config | dict) -> dict:
    """Ingest + process every settled new entry of `serve.incoming`, oldest first; move it to done/ (or
    failed/ with the error in the ledger). Running it again does nothing new."""
    from flows.ingest import ingest_flow
    from warehouse.incoming import assign_round, move_entry, new_entries, read_ledger, write_ledger

    config = as_config(config)
    if not config.serve.incoming:
        raise ValueError("serve.incoming is not set: no incoming folder to poll")
    incoming = Path(config.serve.incoming).expanduser().resolve()
    incoming.mkdir(parents=True, exist_ok=True)
    lake = Lake(config.lake)
    logger = get_run_logger()
    done: dict[str, dict] = {}
    for entry in new_entries(incoming, config.serve.settle_s):
        ledger = read_ledger(lake)
        round_ = assign_round(lake, entry, ledger)
        ledger[entry.name] = {"round": round_, "status": "started", "at": dt.datetime.now(dt.UTC).isoformat()}
        write_ledger(lake, ledger)
        try:
            ingest_flow([str(entry)], config.serve.incoming_format, round_, config)
            summary = _process(config, round_)
            if config.track:
                from flows.trackers import track_round

                track_round(config, round_, summary)
            status, folder = summary["state"], "done"
        except Exception as exc:  # one bad drop must not stop the others
            logger.error("incoming %s (round %d) failed: %s", entry.name, round_, exc)
            status, folder = f"failed: {type(exc).__name__}: {exc}"[:500], "failed"
        moved = move_entry(entry, incoming, folder)
        ledger = read_ledger(lake)
        ledger[entry.name] = {
            **ledger[entry.name],
            "status": status,
            "moved_to": str(moved),
            "at": dt.datetime.now(dt.UTC).isoformat(),
        }
        write_ledger(lake, ledger)
        done[entry.name] = ledger[entry.name]
    return done


def pending_rounds(config: Config) -> list[int]:
    """Rounds whose advantages parts are incomplete for some batch or method."""
    from warehouse.rounds import batch_names
    from warehouse.runlog import parts_present

    lake = Lake(config.lake)
    out = []
    for round_ in lake.rounds("trajectories"):
        batches = batch_names(lake, round_)
        if batches and not all(
            parts_present(lake, round_, get_stage(CREDIT).outputs(b, config.methods)) for b in batches
        ):
            out.append(round_)
    return out


@flow(name="process-pending", validate_parameters=False)
def process_pending_flow(config: Config | dict) -> dict[int, str]:
    """Process every round of the lake whose credit is incomplete (the cron deployment)."""
    config = as_config(config)
    states = {}
    for round_ in pending_rounds(config):
        try:
            states[round_] = _process(config, round_)["state"]
        except Exception as exc:  # one failed round must not stop the others
            get_run_logger().error("round %d failed: %s", round_, exc)
            states[round_] = "Failed"
    return states
