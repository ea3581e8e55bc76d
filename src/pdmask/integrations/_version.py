"""The host-version check every integration runs at import."""

from __future__ import annotations

from packaging.version import Version


def in_range(version: str, low: str, high: str) -> bool:
    """Whether ``version`` (pre-/post-/dev-release tags ignored) lies in [low, high)."""
    return Version(low) <= Version(Version(version).base_version) < Version(high)
