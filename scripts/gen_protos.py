"""Regenerate the committed Python code of proto/blitzmesh/v1 into blitzmesh/v1.

Usage: python scripts/gen_protos.py [--check]

--check regenerates into a temporary tree and fails when the committed code differs, so CI
catches protos edited without regenerating. Needs the pinned grpcio-tools and mypy-protobuf
(the `dev` extra).
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PACKAGE = Path("blitzmesh") / "v1"


def generate(out_dir: Path) -> list[Path]:
    protos = sorted((PROTO_DIR / PACKAGE).glob("*.proto"))
    if not protos:
        raise SystemExit(f"no .proto files under {PROTO_DIR / PACKAGE}")
    include = Path(protoc.__file__).parent / "_proto"
    # protoc finds the mypy plugins on PATH; they live beside this interpreter in a venv.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    args = [
        "protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *(str(p.relative_to(PROTO_DIR)) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    generated = sorted(p for p in (out_dir / PACKAGE).iterdir() if p.is_file())
    return generated


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if committed code drifts")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_dir = Path(tmp)
        files = generate(tmp_dir)
        target = ROOT / PACKAGE
        if args.check:
            drift = [
                f.name
                for f in files
                if not (target / f.name).exists() or not filecmp.cmp(f, target / f.name, shallow=False)
            ]
            if drift:
                print(f"generated code drifted from proto/: {drift}; run scripts/gen_protos.py")
                return 1
            print(f"generated code matches proto/ ({len(files)} files)")
            return 0
        for f in files:
            shutil.copyfile(f, target / f.name)
        print(f"wrote {len(files)} files to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
