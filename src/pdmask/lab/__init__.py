"""The lab: small-scale RL runs that compare the masks under precision mismatch and staleness.

Modules: ``models`` (TinyGPT sizes, Hugging Face / GGUF policies), ``tasks`` (verifiable-reward tasks),
``engine`` (the low-precision rollout engine with top-K log-probs), ``config`` (run config, presets),
``sft`` (cached warm start), ``train`` (the RL loop, ``pdmask train``), ``compare`` (sweeps and reports,
``pdmask compare``). Nothing here is imported by ``import pdmask``.
"""
