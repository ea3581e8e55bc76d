"""The statistics backends, leaves below the one dispatcher (``pdmask.stats``; docs/architecture.md).

``inputs`` (validated inputs), ``shard`` (a vocabulary shard and the ranks' agreement), ``sums`` (per-block
reductions), ``accumulators`` (partial sums and their combine over ranks), ``driver`` (the one pass),
``dense`` (chunks of materialised logits), ``hidden`` (blocks made from hidden states and the LM head),
``from_set`` (statistics from what a trainer's forward already has).
"""
