"""Discrete-event cluster simulator: simulated workers and links, driven by the global
manager's pure reconcile core (`python -m bench.simulate`, see `__main__`)."""
