"""Harnesses that start real data-plane and KV-transfer nodes in their own processes, for the
tests and the data-plane and disaggregation benchmarks. No production module imports them."""
