"""Experiments: alignment checks, sweeps, reports and plots."""
