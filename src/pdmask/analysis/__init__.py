"""The direction-signal analysis behind ``pdmask analyze`` (docs/analysis.md).

Ground truth by autograd (``truth``), the experimental kernel-aware signal G_W (``kernel``), one run
of the experiment (``experiment``) and its agreement tables, verdict and plots (``report``).
"""

from pdmask.analysis.kernel import kernel_change
from pdmask.analysis.truth import (
    adam_preconditioner,
    full_divergence,
    head_change,
    own_change,
)

__all__ = ["adam_preconditioner", "full_divergence", "head_change", "kernel_change", "own_change"]
