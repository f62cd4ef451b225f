"""The model format every service shares: HF config, checkpoint reading, parameter groups,
tokenizer and chat template, synthetic checkpoints and conversion.

The gateway, the parameter manager and the worker all import this package; the worker keeps the
compute (decoder, attention, native kernel, engine) in `services.worker.model`.
"""
