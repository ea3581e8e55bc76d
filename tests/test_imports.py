"""scripts/check_imports.py: the import graph of src/pdmask sees deferred imports and reports a cycle."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "check_imports.py"


def load():
    spec = importlib.util.spec_from_file_location("check_imports", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_function_level_and_relative_imports_are_edges():
    check = load()
    tree = ast.parse("from pdmask.types import PolicyStats\ndef f():\n    from pdmask.methods import get_method\nfrom . import rows\n")
    assert check.imported(tree, "pdmask.stats", False) >= {"pdmask.types", "pdmask.methods", "pdmask.rows"}


def test_a_cycle_is_found_and_a_layering_is_not():
    check = load()
    assert check.find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert check.find_cycle({"loss": {"methods", "stats"}, "methods": {"types"}, "stats": {"types"}, "types": set()}) is None


def test_the_core_imports_no_module_above_it():
    """The data types and the backends are the bottom: none of them reaches the math, the dispatcher or the API."""
    edges = load().graph()
    bottom = {m for m in edges if m in ("pdmask.types", "pdmask.rows", "pdmask.rollout") or m.startswith("pdmask.backends")}
    above = {"pdmask.stats", "pdmask.methods", "pdmask.estimators", "pdmask.backbone", "pdmask.loss", "pdmask.sharded"}
    for module in bottom:
        assert not edges[module] & above, (module, edges[module] & above)
