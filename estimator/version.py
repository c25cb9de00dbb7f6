"""The installed distribution's version, without importing the control plane: profiles are cached
per version, since a new release may change what a profile measures."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "bullet-serve"


def package_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "0+unknown"
