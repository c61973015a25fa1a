"""One module per credit method (estimators and refiners); each registers itself."""
