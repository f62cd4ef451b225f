"""ZigZag ILP solve-time benchmark: `python -m bench.zigzag` (see __main__.py)."""
