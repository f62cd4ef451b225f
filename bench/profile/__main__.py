"""Profile one worker engine: its step-time coefficients and its saturation decode throughput.

Usage:
    python -m bench.profile [--quick] [--model NAME] [--step-time-a-s A --step-time-b-s B]
                            [--max-batch-size N] [--max-num-tokens N] [--num-threads N]
                            [--device cpu|cuda] [--dtype auto|float32|bfloat16]
                            [--out FILE] [--profile-out FILE|none]

The engine is built as a worker builds it (the WorkerConfig options above, the rest a worker's
defaults) on `--model`: the default model if `models/smollm2-135m-instruct` is there, else the
synthetic preset `small` (`tiny`, `small`, `bench` are synthesized when missing). With
`--step-time-a-s/--step-time-b-s` the engine emulates an accelerator (`a + b * batch tokens` per
iteration) and the fit should give back base_s = a and prefill_token_s = decode_row_s = b.

1. Sweep (runner.QUICK / runner.FULL): prefill-only iterations over prompt lengths x batch sizes,
   then decode cells over batch sizes x context lengths; every iteration's time comes from the
   engine's `step_log`. Least squares fits `services.common.worker_profile.StepTimeModel`
   (base, per prompt token, per prompt attention pair, per finished prompt, per decode row, per
   decode context token); R², MAE and the residuals by kind of iteration are reported.
2. Saturation: `max_batch_size` decode-heavy requests always in flight; generated tokens/s over
   the window after a warm-up. HeteroScale's target is 0.7 x that (TARGET_FRACTION).

Writes the full record (profile, fit evidence, every iteration's features and time) to
`bench/results/profile_<model>[_quick].json` and the profile alone to `profiles/<model>.json`,
which HeteroScale reads through its `worker_profile` parameter
(`--policy-params '{"worker_profile": "profiles/<model>.json"}'`) and a simulator loads with
`services.common.worker_profile.load_profile`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from bench.profile.runner import FULL, QUICK, ProfileRun, profile_engine
from services.common.log import configure_logging
from services.common.worker_profile import PROFILE_DIR
from services.mesh.launcher import ensure_model
from services.model_format.default_model import DEFAULT_MODEL_ID
from services.worker.config import WorkerConfig


def default_model(model_dir: Path) -> str:
    return DEFAULT_MODEL_ID if (model_dir / DEFAULT_MODEL_ID / "config.json").is_file() else "small"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller sweep and a 30 s saturation run (about 2 minutes)")
    p.add_argument(
        "--model", help=f"model name in --model-dir or a preset (default {DEFAULT_MODEL_ID} if present, else small)"
    )
    p.add_argument("--model-dir", type=Path, default=Path("models"), help="where models live")
    p.add_argument("--step-time-a-s", type=float, help="emulated accelerator: fixed step time (worker option)")
    p.add_argument(
        "--step-time-b-s", type=float, help="emulated accelerator: step time per batch token (worker option)"
    )
    p.add_argument("--max-batch-size", type=int, help="worker option (default a worker's)")
    p.add_argument("--max-num-tokens", type=int, help="worker option (default a worker's)")
    p.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (worker option; 0 = torch's)")
    p.add_argument("--device", default="cpu", help="worker option: cpu or cuda[:N]")
    p.add_argument("--dtype", default="auto", help="worker option: auto, float32, bfloat16, float16")
    p.add_argument("--saturation-s", type=float, help="length of the saturation run, seconds")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt ids and output lengths")
    p.add_argument("--out", type=Path, help="full record (default bench/results/profile_<model>[_quick].json)")
    p.add_argument(
        "--profile-out",
        help=f"the profile alone, as HeteroScale and the simulator read it (default {PROFILE_DIR}/<model>.json, "
        f"{PROFILE_DIR}/<model>_a<A>_b<B>.json when emulated; 'none' writes none)",
    )
    return p


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    options: dict[str, Any] = {
        "num_threads": args.num_threads,
        "device": args.device,
        "dtype": args.dtype,
        "step_time_a_s": args.step_time_a_s,
        "step_time_b_s": args.step_time_b_s,
    }
    if args.max_batch_size is not None:
        options["max_batch_size"] = args.max_batch_size
    if args.max_num_tokens is not None:
        options["max_num_tokens"] = args.max_num_tokens
    return WorkerConfig(**options)


def profile_path(model: str, worker: WorkerConfig) -> Path:
    if worker.step_time_a_s is None or worker.step_time_b_s is None:
        return PROFILE_DIR / f"{model}.json"
    return PROFILE_DIR / f"{model}_a{worker.step_time_a_s:g}_b{worker.step_time_b_s:g}.json"


def summary(run: ProfileRun) -> str:
    p = run.profile
    st, sat, rec = p.step_time, p.saturation, p.recommended
    kinds = run.fit.by_kind
    lines = [
        f"profile of {p.model} on {p.device}, {p.dtype}, max_batch_size={p.engine['max_batch_size']} "
        f"max_num_tokens={p.engine['max_num_tokens']}"
        + ("" if p.emulated_step_time is None else f", emulated {p.emulated_step_time}"),
        f"step time fit on {st.samples} iterations: R2={st.r2:.4f} MAE={st.mae_s * 1e3:.2f} ms",
        f"  base_s              = {st.base_s * 1e3:9.3f} ms",
        f"  prefill_token_s     = {st.prefill_token_s * 1e3:9.4f} ms/token",
        f"  prefill_attn_pair_s = {st.prefill_attn_pair_s * 1e9:9.3f} ns/pair",
        f"  prefill_seq_s       = {st.prefill_seq_s * 1e3:9.3f} ms/prompt",
        f"  decode_row_s        = {st.decode_row_s * 1e3:9.4f} ms/row",
        f"  decode_context_s    = {st.decode_context_s * 1e6:9.4f} us/context token",
        f"  loop_overhead_s     = {st.loop_overhead_s * 1e3:9.3f} ms/iteration (outside the step timer)",
        "  residuals: "
        + ", ".join(
            f"{k} n={v['samples']} MAE={v['mae_s'] * 1e3:.2f} ms ({v['mean_rel_err']:.1%})"
            for k, v in kinds.items()
            if k != "all"
        ),
        f"saturation: {sat.batch_size} requests in flight (mean {sat.mean_running} per iteration), prompts "
        f"{sat.prompt_tokens}, outputs {sat.output_tokens[0]}-{sat.output_tokens[1]} tokens: {sat.generated_tokens} "
        f"tokens in {sat.window_s:.1f} s over {sat.steps} iterations = {sat.decode_tps:.1f} tokens/s "
        f"(fit predicts {sat.predicted_decode_tps} tokens/s; prompt share {sat.prefill_token_share:.1%}, "
        f"mean context {sat.mean_context_tokens:.0f})",
        f"recommended HeteroScale target_decode_tps_per_instance = {rec.fraction_of_saturation} x "
        f"{sat.decode_tps:.1f} = {rec.target_decode_tps_per_instance}",
    ]
    return "\n".join(lines)


async def _main(args: argparse.Namespace) -> int:
    model = args.model or default_model(args.model_dir)
    worker = worker_config(args)
    if worker.num_threads:
        torch.set_num_threads(worker.num_threads)  # as a worker does at start
    sweep = QUICK if args.quick else FULL
    if args.saturation_s is not None:
        sweep = type(sweep)(**{**sweep.report(), "saturation_s": args.saturation_s})
    model_path = ensure_model(args.model_dir, model)
    command = "python -m bench.profile " + shlex.join(sys.argv[1:])
    load_start = os.getloadavg()
    run = await profile_engine(
        model_path,
        worker,
        sweep,
        model_name=model,
        seed=args.seed,
        source_ref=command,
        quick=args.quick,
        created=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        progress=lambda msg: print(f"bench.profile: {msg}", file=sys.stderr, flush=True),
    )
    out = args.out or Path("bench/results") / f"profile_{model}{'_quick' if args.quick else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    # Other processes on the machine slow the steps; the load average says whether there were any.
    machine = {"cpu_count": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg()}
    out.write_text(json.dumps({**run.report(), "machine": machine}, indent=2) + "\n", encoding="utf-8")
    written = [str(out)]
    if (args.profile_out or "").lower() != "none":
        target = Path(args.profile_out) if args.profile_out else profile_path(model, worker)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(run.profile.model_dump(mode="json"), indent=2) + "\n", encoding="utf-8")
        written.append(str(target))
    print(summary(run))
    print(f"wrote {', '.join(written)} in {run.wall_s:.0f} s")
    if len(written) > 1:
        print(f'use it: --policy-params \'{{"worker_profile": "{written[1]}"}}\'')
    return 0


def main() -> None:
    configure_logging("bench.profile", level="warning")
    sys.exit(asyncio.run(_main(_parser().parse_args())))


if __name__ == "__main__":
    main()
