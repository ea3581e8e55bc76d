"""Integrations of pdmask's masks into existing trainers and rollout engines; each needs its own extra.

- ``pdmask.integrations.trl``: ``PDMConfig`` / ``PDMTrainer`` on TRL's GRPO trainer (``pip install pdmask[trl]``).
- ``pdmask.integrations.vllm``: vLLM outputs -> tokens, ``RolloutLogprobs`` and response mask; the engine and
  sampling arguments pdmask needs (``pdmask[vllm]``, its own virtual environment).
- ``pdmask.integrations.verl``: ``pdmask_<method>`` policy losses and the top-K trainer mode for verl
  (``pdmask[verl]``, its own virtual environment; loaded by verl through the ``verl.plugins`` entry point).
"""
