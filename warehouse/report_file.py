"""The report as a file: the data from the lake (warehouse.report_data), the page (pipeline.report, pure) with
plotly.js inlined from the plotly package, written atomically."""

from __future__ import annotations

import time
from pathlib import Path

from warehouse.lake import Lake


def plotly_js() -> str:
    """The plotly.js bundle shipped inside the plotly package (the report inlines it: no network)."""
    from importlib import resources

    try:
        return (resources.files("plotly") / "package_data" / "plotly.min.js").read_text(encoding="utf-8")
    except ModuleNotFoundError:
        raise SystemExit("the report needs plotly: pip install 'plotly>=5.20'") from None


def write_report(
    lake: Lake, out: Path, rounds: list[int] | None = None, n_traj: int = 8
) -> tuple[Path, dict, dict[str, float]]:
    """Gather, build and write the report; returns the path, the gathered data and the timings."""
    from pipeline.report import build_report
    from warehouse.report_data import gather

    t0 = time.perf_counter()
    data = gather(lake, rounds, n_traj=n_traj)
    t_gather = time.perf_counter() - t0
    html = build_report(data, plotly_js())
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(out)
    return out, data, {"seconds": time.perf_counter() - t0, "queries": t_gather}
