"""Credit engine: estimators and refiners behind one registry, composed as method chains.

Every module in pipeline/credit/methods/ is imported here, so a method registers itself by existing."""

import importlib
import pkgutil

from pipeline.credit import methods as _methods
from pipeline.credit.batch import CreditBatch
from pipeline.credit.registry import (
    ESTIMATORS,
    REFINERS,
    MethodError,
    estimator,
    parse_method,
    refiner,
    run_methods,
)
from pipeline.credit.result import CreditResult

for _m in sorted(m.name for m in pkgutil.iter_modules(_methods.__path__)):
    importlib.import_module(f"pipeline.credit.methods.{_m}")

__all__ = [
    "ESTIMATORS",
    "REFINERS",
    "CreditBatch",
    "CreditResult",
    "MethodError",
    "estimator",
    "parse_method",
    "refiner",
    "run_methods",
]
