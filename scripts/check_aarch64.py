"""Check, from an x86-64 host, that Blitzmesh would build and install on linux aarch64 (Graviton,
Apple silicon under Linux), Python 3.11, on the torch paths.

Usage: .venv/bin/python scripts/check_aarch64.py [--skip-compile] [--skip-resolve] [--no-per-requirement]
                                                [--out bench/results/aarch64_check.json]

What it checks:

1. The native kernels. Each kernel module's loader (`_compile` / `_load`) is called at the
   "portable" level with `platform.machine()` reporting aarch64 and `build_library` replaced by
   a recorder, so the check sees exactly which sources an aarch64 worker would compile and with
   which flags (`-O3 -std=gnu11 -fPIC -shared -fopenmp`, no vector flags, plus a module's own
   extras such as fused's `-ffp-contract=off`). Every `_SOURCE` (native, varlen, varlen_dot,
   small_gemm, fused) is then compiled with `aarch64-linux-gnu-gcc` (skipped, with the
   `apt-get install gcc-aarch64-linux-gnu` hint, where the cross compiler is missing). A kernel
   that aarch64 builds must compile; one its loader never builds there (AVX-512-only) is
   reported with its compiler error but is not a failure.
2. The dependencies. `pip install --dry-run` against the aarch64 platform (manylinux_2_17 ..
   manylinux_2_28, wheels only) for: every requirement together as `make setup` installs them
   (torch==2.13.0 + the project's dependencies and all its extras), each requirement alone (with
   its own dependencies), everything but ucxx-cu12 (what a `platform_machine` marker on it would
   give), and torch's CPU build from the PyTorch index (only where download.pytorch.org answers).

What it cannot check: it runs nothing on aarch64 (no kernel self-checks, no numerics, no
serving); that the cross-compiled libraries load and are right needs an aarch64 host. The
resolver sees the indexes this host is configured with (PyPI, plus pip.conf's extras); wheels
are picked by tag, not tried. glibc below 2.17 and musl (Alpine) are not covered.

Findings go to bench/results/aarch64_check.json; exit 1 if a kernel aarch64 builds fails to
compile or the install as declared does not resolve.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import tomllib
import urllib.request
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CROSS_CC = "aarch64-linux-gnu-gcc"
APT_HINT = "apt-get install gcc-aarch64-linux-gnu"
BASE_FLAGS = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp"]  # native.build_library's
KERNEL_MODULES = ("native", "varlen", "varlen_dot", "small_gemm", "fused")
TORCH_PIN = "torch==2.13.0"  # the Makefile installs it first
PYTHON_VERSION = "3.11"
# pip (before 24) does not widen a manylinux_2_28 --platform to older glibc tags: name them all.
PLATFORMS = [f"manylinux_2_{v}_aarch64" for v in range(28, 16, -1)] + ["manylinux2014_aarch64"]
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


class _Recorded(Exception):
    """Raised by the stand-in `build_library` once it has recorded a build."""


def kernel_builds() -> dict[str, dict]:
    """Per kernel module: its source and, where an aarch64 worker would build it, the flags it
    would pass to `build_library` (else why it is not built)."""
    import importlib

    out: dict[str, dict] = {}
    for name in KERNEL_MODULES:
        mod = importlib.import_module(f"services.worker.model.{name}")
        calls: list[tuple[str, list[str]]] = []

        def record(source: str, stem: str, extra_flags=(), _calls=calls) -> Path:
            _calls.append((source, list(extra_flags)))
            raise _Recorded

        loader = getattr(mod, "_compile", None) or mod._load
        entry: dict = {"source": mod._SOURCE, "built_on_aarch64": False, "flags": None, "not_built": None}
        with mock.patch("platform.machine", return_value="aarch64"), mock.patch.object(mod, "build_library", record):
            try:
                loader("portable")
                entry["not_built"] = "the loader returned without building"
            except _Recorded:
                source, extra = calls[0]
                entry.update(built_on_aarch64=True, flags=[*BASE_FLAGS, *extra], source=source)
            except Exception as exc:  # the loader refuses the portable level before building
                entry["not_built"] = f"{type(exc).__name__}: {exc}"
        out[name] = entry
    return out


def compiler_version(cc: str = CROSS_CC) -> str | None:
    path = shutil.which(cc)
    if not path:
        return None
    done = subprocess.run([path, "--version"], capture_output=True, text=True)
    return done.stdout.splitlines()[0] if done.stdout else None


def cross_compile(source: str, flags: list[str], workdir: Path, stem: str) -> dict:
    """Compile `source` with the aarch64 cross compiler as build_library would; ok, error, arch."""
    src, lib = workdir / f"{stem}.c", workdir / f"{stem}.so"
    src.write_text(source)
    done = subprocess.run(
        [CROSS_CC, *flags, "-o", str(lib), str(src), "-lm"], capture_output=True, text=True, timeout=300
    )
    result: dict = {"ok": done.returncode == 0, "returncode": done.returncode}
    if done.returncode != 0:
        errors = [ln for ln in done.stderr.splitlines() if "error" in ln]
        result["error"] = "\n".join(errors[:5]) or done.stderr.strip()[-2000:]
    elif done.stderr.strip():
        result["warnings"] = done.stderr.strip()[-2000:]
    if lib.exists():
        result["elf_machine"] = "aarch64" if lib.read_bytes()[18:20] == b"\xb7\x00" else "other"
    return result


def check_kernels() -> dict:
    version = compiler_version()
    if version is None:
        return {"skipped": f"{CROSS_CC} not found: install it with `{APT_HINT}`", "compiler": None, "kernels": {}}
    kernels = {}
    with tempfile.TemporaryDirectory(prefix="aarch64-kernels-") as tmp:
        for name, build in kernel_builds().items():
            flags = build["flags"] or BASE_FLAGS
            res = cross_compile(build["source"], flags, Path(tmp), name)
            res.update(built_on_aarch64=build["built_on_aarch64"], flags=flags)
            if build["not_built"]:
                res["not_built_reason"] = build["not_built"]
            kernels[name] = res
            status = "ok" if res["ok"] else "ERROR"
            role = "built on aarch64" if build["built_on_aarch64"] else "not built on aarch64 (gated)"
            print(f"kernel {name:<11} {status:<5} [{role}] {' '.join(flags)}")
            if not res["ok"]:
                print("    " + res["error"].replace("\n", "\n    "))
    return {"compiler": version, "kernels": kernels}


def project_requirements() -> list[str]:
    """torch's pin, then the project's dependencies and every extra, in order, without repeats."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [TORCH_PIN, *project["dependencies"]]
    for extra in project.get("optional-dependencies", {}).values():
        reqs += extra
    seen, out = set(), []
    for r in reqs:
        r = _for_aarch64(r)
        if r and r not in seen:
            seen.add(r)
            out.append(r)
    return out


# The environment markers of linux aarch64, CPython 3.11: pip evaluates a requirement's marker
# against the interpreter running it (x86-64 here), whatever --platform says, so they are
# evaluated for the target here instead.
AARCH64_ENV = {
    "platform_machine": "aarch64",
    "platform_system": "Linux",
    "sys_platform": "linux",
    "os_name": "posix",
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def _for_aarch64(req: str) -> str | None:
    """`req` without its marker where the marker holds on aarch64; None where it does not."""
    from packaging.requirements import Requirement

    parsed = Requirement(req)
    if parsed.marker is None:
        return req
    if not parsed.marker.evaluate(AARCH64_ENV):
        return None
    parsed.marker = None
    return str(parsed)


def _name(req: str) -> str:
    from packaging.requirements import Requirement

    return Requirement(req).name.lower().replace("_", "-")


def resolve(reqs: list[str], extra_args: list[str] = ()) -> dict:
    """`pip install --dry-run` of `reqs` for linux aarch64; ok, the packages picked, the error."""
    with tempfile.TemporaryDirectory(prefix="aarch64-resolve-") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--only-binary=:all:"]
        for plat in PLATFORMS:
            cmd += ["--platform", plat]
        cmd += ["--python-version", PYTHON_VERSION, "--implementation", "cp", "--target", str(Path(tmp) / "t")]
        cmd += ["--report", str(report), "--disable-pip-version-check", *extra_args, *reqs]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        result: dict = {"ok": done.returncode == 0}
        if done.returncode == 0 and report.exists():
            installs = json.loads(report.read_text())["install"]
            result["packages"] = sorted(
                (
                    {
                        "name": i["metadata"]["name"],
                        "version": i["metadata"]["version"],
                        "file": i["download_info"]["url"].rsplit("/", 1)[-1],
                    }
                    for i in installs
                ),
                key=lambda p: p["name"].lower(),
            )
        else:
            # pip writes the conflict's explanation to stdout and its ERROR lines to stderr.
            lines = [
                ln
                for ln in (done.stdout + done.stderr).splitlines()
                if not ln.startswith("WARNING: Location")
                and "To fix this" not in ln
                and not ln.startswith(("1. ", "2. "))
            ]
            start = next(
                (k for k, ln in enumerate(lines) if ln.startswith(("ERROR", "The conflict"))), max(0, len(lines) - 15)
            )
            result["error"] = "\n".join(ln for ln in lines[start : start + 15] if ln.strip()).strip()
        return result


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=10):
            return True
    except Exception:
        return False


def check_resolve(per_requirement: bool) -> dict:
    reqs = project_requirements()
    out: dict = {"platforms": PLATFORMS, "python": PYTHON_VERSION, "requirements": reqs}

    print(f"resolving all {len(reqs)} requirements together for aarch64 ...", flush=True)
    out["as_declared"] = resolve(reqs)
    print(f"  as declared: {'ok' if out['as_declared']['ok'] else 'FAILED'}")
    if not out["as_declared"]["ok"]:
        print("    " + out["as_declared"]["error"].replace("\n", "\n    "))

    if per_requirement:
        out["per_requirement"] = {}
        for req in reqs:
            res = resolve([req])
            out["per_requirement"][req] = res
            print(f"  {req:<40} {'ok' if res['ok'] else 'FAILED: ' + res['error'].splitlines()[-1]}", flush=True)

    without = [r for r in reqs if _name(r) != "ucxx-cu12"]
    res = resolve(without)
    out["without_ucxx"] = res
    print(f"  everything but ucxx-cu12: {'ok' if res['ok'] else 'FAILED'}")

    if _reachable(f"{TORCH_CPU_INDEX}/torch/"):
        cpu = [TORCH_PIN.replace("==2.13.0", "==2.13.0+cpu"), *reqs[1:]]
        res = resolve(cpu, ["--extra-index-url", TORCH_CPU_INDEX])
    else:
        res = {"ok": None, "skipped": f"{TORCH_CPU_INDEX} not reachable from this host"}
    out["torch_cpu_index"] = res
    print(f"  torch 2.13.0+cpu from {TORCH_CPU_INDEX}: {res.get('skipped') or ('ok' if res['ok'] else 'FAILED')}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-compile", action="store_true", help="do not cross-compile the kernels")
    p.add_argument("--skip-resolve", action="store_true", help="do not run the pip resolves")
    p.add_argument("--no-per-requirement", action="store_true", help="skip resolving each requirement alone")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "aarch64_check.json")
    args = p.parse_args(argv)

    findings: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": f"{platform.machine()} {platform.system()} {platform.release()}",
        "pip": subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True, text=True).stdout.split(
            " from "
        )[0],
    }
    failed = []
    if not args.skip_compile:
        findings["compile"] = check_kernels()
        if "skipped" in findings["compile"]:
            print(f"kernels: skipped: {findings['compile']['skipped']}")
        failed += [
            f"kernel {name}"
            for name, k in findings["compile"]["kernels"].items()
            if k["built_on_aarch64"] and not k["ok"]
        ]
    if not args.skip_resolve:
        findings["resolve"] = check_resolve(not args.no_per_requirement)
        if not findings["resolve"]["as_declared"]["ok"]:
            failed.append("resolve as declared")
    findings["failed"] = failed

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(findings, indent=1) + "\n")
    print(f"wrote {os.path.relpath(args.out)}; {'FAILED: ' + ', '.join(failed) if failed else 'all checks passed'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
