"""Data plane benchmark: `python -m bench.dataplane` (see __main__.py)."""
