"""Experiments: shipped configs (configs/*.toml), comparisons, tables, reports and plots."""
