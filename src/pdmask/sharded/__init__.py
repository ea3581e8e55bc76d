"""The statistics on a vocabulary split over the ranks of a tensor-parallel group (docs/sharded.md).

Megatron's convention: rank r of ``tp_group`` holds the logits (and the LM head's rows) of the ids
[r·w, (r+1)·w), w the shard width; the padded vocabulary tp·w may exceed the real one V (``vocab_size=``),
and padded ids never enter π (each rank reduces only its real columns). A pass is the unsharded pass on
each shard, relative to the shard's own row max m_r, followed by

1. one all-reduce MAX of m_r [N] and one all-reduce SUM of the rescaled partial sums
   (Σ e, Σ_{j∉S} e, Σ_{j∉S} e², the logits at S's ids, 0 on the ranks that do not own them) [N, 3 + C],
   plus Σ_{j∉S} e_j w_j [N, d] for the backbone-aware masks;
2. only for the sums that need the final log-normaliser, one more all-reduce SUM: the full-μ reductions
   [N, 5] (with a sharded full μ), the ``exactpi`` estimator's TV sums [N, 2] (``need_exactpi=True``), and
   with the LM head the backbone-aware sums of S's rows of W [N, 2d] (Σ_S π_j w_j, w_a), [N, 4d] with top-K
   (also Σ_S μ_j w_j, Σ_S s_j π_j w_j), and with a full μ Wᵀμ and Σ sign(π − μ)·π·w [N, 2d].

So a call communicates 4·(C + 4) bytes per position in float32 (C = K + 1; 100 bytes at K = 20), never
O(V). The backbone-aware sums add 4·d bytes per position in the first stage and, in the second, 4·2d (w_a,
Σ_S π_j w_j), 4·2d more with top-K and 4·2d more with a full μ. The masks communicate nothing: everything
they read is summed in the pass. Before any of this,
every rank checks its inputs and the ranks agree on the outcome with one small collective, so a bad
input on one rank raises the same error on all of them.

Each rank reduces with its own max and the ranks rescale afterwards (instead of reducing the max first):
the same two collectives, and the hidden-state path keeps its single online-log-sum-exp sweep.

The passes are ``pdmask.policy_stats`` and ``pdmask.policy_stats_from_hidden`` with ``tp_group=``: every backend
sums its shard, and the combine above (``pdmask.backends.accumulators``) reduces the partial sums over the
ranks (docs/architecture.md). This package is the tensor-parallel API: those two under their sharded names,
``host`` (statistics from what a host already has) and ``sequence`` (μ sliced along the sequence).
"""

from pdmask.backends.shard import VocabShard, agreed, count_traffic
from pdmask.sharded.host import HOST_REFUSED_ESTIMATORS, gather_set_logits, stats_from_shard
from pdmask.sharded.sequence import SEQUENCE_LAYOUTS, sequence_shard, shard_rollout
from pdmask.stats import policy_stats as sharded_policy_stats
from pdmask.stats import policy_stats_from_hidden as sharded_policy_stats_from_hidden

__all__ = [
    "HOST_REFUSED_ESTIMATORS",
    "SEQUENCE_LAYOUTS",
    "VocabShard",
    "agreed",
    "count_traffic",
    "gather_set_logits",
    "sequence_shard",
    "shard_rollout",
    "sharded_policy_stats",
    "sharded_policy_stats_from_hidden",
    "stats_from_shard",
]
