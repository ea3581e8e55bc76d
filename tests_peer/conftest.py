"""Peer checks of pdmask.sharded against the hosts' own vocab-parallel functions (Megatron-core, verl), under gloo.

They need megatron-core and verl installed (CI: .ci/verl.sh runs them in .venv-verl); the main suite does not
collect them."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core", reason="the peer checks need megatron-core (pip install --no-deps megatron-core)")
