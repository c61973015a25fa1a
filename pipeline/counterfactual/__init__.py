"""TCPO fixed-history counterfactuals: the `counterfactual` annotation stage (-> `counterfactuals` table)
and the stateful-environment interface (`pipeline.counterfactual.env`)."""

from pipeline.counterfactual import stage  # noqa: F401  (registers the stage)
from pipeline.counterfactual.stage import CounterfactualSettings, counterfactual, history_messages

__all__ = ["CounterfactualSettings", "counterfactual", "history_messages"]
