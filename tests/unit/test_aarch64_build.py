"""The native kernels as an aarch64 worker would build them (scripts/check_aarch64.py): every
source its loader compiles at the portable level (no vector flags) compiles with the aarch64
cross compiler, and a source that does not (AVX-512-only) is one its loader never builds there.
Skips where `aarch64-linux-gnu-gcc` is missing (`apt-get install gcc-aarch64-linux-gnu`)."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_aarch64.py"
_spec = importlib.util.spec_from_file_location("check_aarch64", _SCRIPT)
check_aarch64 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_aarch64)

pytestmark = pytest.mark.skipif(
    shutil.which(check_aarch64.CROSS_CC) is None,
    reason=f"no {check_aarch64.CROSS_CC}: install it with `{check_aarch64.APT_HINT}`",
)


@pytest.fixture(scope="module")
def builds() -> dict[str, dict]:
    return check_aarch64.kernel_builds()


def test_the_portable_kernels_are_built_on_aarch64(builds):
    # Decode attention and the fused ops have portable C levels: aarch64 builds them (the varlen
    # prompt kernel is not built at the portable level: it measured 0.05-0.21x torch there).
    built = {name for name, b in builds.items() if b["built_on_aarch64"]}
    assert built >= {"native", "fused"} and "varlen" not in built
    for b in builds.values():
        if b["built_on_aarch64"]:
            assert not any(f.startswith("-m") for f in b["flags"]), b["flags"]  # no x86 ISA flags


@pytest.mark.parametrize("name", check_aarch64.KERNEL_MODULES)
def test_kernel_cross_compiles_where_aarch64_builds_it(name, builds, tmp_path):
    build = builds[name]
    result = check_aarch64.cross_compile(build["source"], build["flags"] or check_aarch64.BASE_FLAGS, tmp_path, name)
    if build["built_on_aarch64"]:
        assert result["ok"], f"{name} fails to compile for aarch64 with {build['flags']}:\n{result['error']}"
        assert result["elf_machine"] == "aarch64"
    else:
        # Not compiled on aarch64 (its loader refuses the portable level), so an x86-only source is fine.
        assert build["not_built"], name
