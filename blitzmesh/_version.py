"""The SDK's version, read from the installed package metadata (pyproject.toml is the source)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("blitzmesh")
except PackageNotFoundError:  # running from a source checkout that was never installed
    __version__ = "0+unknown"
