"""The direction-signal analysis behind ``pdmask analyze`` (docs/analysis.md).

Ground truth by autograd (``truth``), one run in resumable rounds (``config``, ``run``; each round's
stages: ``rollouts``, ``stale``, ``signals``, ``targets``, ``step``, composed by ``round``; the per-token
record and results: ``records``; the policy's plumbing: ``model``),
each direction mask's unsafe keeps and wasted drops (``maskview``,
with the intervals of ``rates``), the agreement tables' numbers (``tables``), their words: verdict,
cells and report.md (``render``), and their plots (``figures``).
"""

from pdmask.analysis.maskview import mask_decisions, mask_view, paired_view
from pdmask.analysis.truth import (
    adam_preconditioner,
    full_divergence,
    head_change,
    own_change,
)

__all__ = [
    "adam_preconditioner",
    "full_divergence",
    "head_change",
    "mask_decisions",
    "mask_view",
    "own_change",
    "paired_view",
]
