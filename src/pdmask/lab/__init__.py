"""The lab: small-scale RL runs that compare the masks under precision mismatch and staleness.

Modules: ``models`` (TinyGPT sizes, Hugging Face / GGUF policies), ``tasks`` (verifiable-reward tasks),
``engine`` (the low-precision rollout engine, fp32/bf16/fp16/fp8, with top-K log-probs), ``config``
(run config, presets), ``sft`` (cached warm start), ``train`` (the RL loop, ``pdmask train``), and
``pdmask compare``: ``sweep`` (running a sweep), ``intervals`` (statistics over seeds), ``run_summary``
(per-run numbers), ``verdicts`` (typed verdicts), ``verdict_words`` (their words), ``summary`` (the three
composed per setting), ``plots`` and ``report``. Nothing here is imported by ``import pdmask``.
"""
