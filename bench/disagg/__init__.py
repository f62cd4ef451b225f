"""Disaggregation benchmark: `python -m bench.disagg` (see __main__.py)."""
