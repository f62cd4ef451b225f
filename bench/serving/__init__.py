"""Serving benchmark: gateway vs in-process engine vs HF transformers on one trace-drawn workload."""
