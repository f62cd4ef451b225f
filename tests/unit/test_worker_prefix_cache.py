"""The worker's side of prefix caching: WorkerConfig.enable_prefix_caching reaches the engine, and
the hit counts reach the load report and the Prometheus metrics."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from blitzmesh import convert
from services.model_format import synth
from services.worker.config import WorkerConfig
from services.worker.engine.sampling import SamplingParams
from services.worker.model.llama import LlamaForCausalLM, load_model
from services.worker.service import Instance, WorkerServicer

PARAMS = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = [1, *range(100, 139)]  # 40 tokens: 2 full blocks of 16 are matched on a repeat


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    path = synth.synthesize(tmp_path_factory.mktemp("worker-prefix") / "tiny", "tiny", seed=0)
    return load_model(str(path))


def metric(name: str) -> float | None:
    return REGISTRY.get_sample_value(name)


@pytest.mark.parametrize("enabled", [True, False])
async def test_hits_reach_the_load_report_and_the_metrics(model: LlamaForCausalLM, enabled: bool) -> None:
    servicer = WorkerServicer(
        WorkerConfig(instance_id="w", kv_cache_tokens=1024, max_batch_size=4, enable_prefix_caching=enabled)
    )
    engine = servicer._make_engine(model, frozenset({2}))
    assert engine.config.enable_prefix_caching is enabled
    inst = Instance("m", model, None)  # type: ignore[arg-type]  # no parameter groups needed here
    inst.engine = engine
    servicer.instance = inst
    await engine.start()
    try:
        for request_id in ("a", "b"):
            [ev async for ev in engine.generate(request_id, PROMPT, PARAMS)]
        report = servicer.load_report()
        hit, query = (32, 80) if enabled else (0, 0)
        assert (report.prefix_hit_tokens, report.prefix_query_tokens) == (hit, query)
        wire = convert.load_report_to_proto(report)
        assert (wire.prefix_hit_tokens, wire.prefix_query_tokens) == (hit, query)
        assert metric("blitzmesh_worker_prefix_hit_tokens") == hit
        assert metric("blitzmesh_worker_prefix_query_tokens") == query
        assert metric("blitzmesh_worker_prefix_cache_hit_rate") == pytest.approx(hit / query if query else 0.0)
    finally:
        await engine.stop()
    servicer.instance = None
    assert metric("blitzmesh_worker_prefix_cache_hit_rate") == 0.0
