"""Recipes: the research built on the library (studies, sweeps, reports, the demo, calibration, model building,
the alignment and mismatch tables). The library never imports them (an import-linter contract)."""
