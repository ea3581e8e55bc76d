"""Integrations of pdmask's masks into existing trainers; each submodule needs its own extra.

- ``pdmask.integrations.trl``: ``PDMConfig`` / ``PDMTrainer`` on TRL's GRPO trainer (``pip install pdmask[trl]``).
"""
