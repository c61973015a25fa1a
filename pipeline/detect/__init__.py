"""C3 detectors (spec 5, Table 5): a registry of rule detectors (`@detector("name")`), the built-in rules
per action format, and the `detect` annotation stage that writes the `spans` table."""

from pipeline.detect import builtin  # noqa: F401  (registers the built-in detectors)
from pipeline.detect.registry import DETECTORS, DetectSettings, Hit, StepView, TrajView, detector
from pipeline.detect.stage import detect, detect_spans, run_detectors, spans_table, traj_views
from pipeline.detect.text import jaccard, ngrams, normalize_answer

__all__ = [
    "DETECTORS",
    "DetectSettings",
    "Hit",
    "StepView",
    "TrajView",
    "detector",
    "detect",
    "detect_spans",
    "run_detectors",
    "spans_table",
    "traj_views",
    "jaccard",
    "ngrams",
    "normalize_answer",
]
