"""DPPO and predictive divergence masks in verl (``pip install pdmask[verl]``); see docs/verl.md.

Loaded by verl itself on every ``import verl`` (entry point group ``verl.plugins``, Ray workers
included), which registers the binary-information masks as verl policy losses ``pdmask_<method>``
(``pdmask_ppo_clip``, ``pdmask_pg_is``, ``pdmask_dppo_binary_tv``, ``pdmask_dppo_binary_kl``).
Top-K methods run as an engine loss function (``pdmask.integrations.verl.topk``).
"""

from __future__ import annotations

import warnings

from pdmask.integrations._version import SUPPORTED, in_range

#: verl releases this integration was written and tested against: [VERL_MIN, VERL_MAX).
VERL_MIN, VERL_MAX = SUPPORTED["verl"]


def check_verl_version(version: str) -> None:
    """Raises ImportError unless ``version`` lies in [VERL_MIN, VERL_MAX)."""
    if not in_range(version, VERL_MIN, VERL_MAX):
        raise ImportError(
            f"pdmask.integrations.verl supports verl >={VERL_MIN},<{VERL_MAX} but verl {version} is installed: "
            "install a supported verl with `pip install 'pdmask[verl]'`."
        )


try:
    import verl
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("pdmask.integrations.verl needs verl: `pip install 'pdmask[verl]'`.") from err
try:
    check_verl_version(verl.__version__)
except ImportError as err:
    # verl loads plugins with errors logged at debug level only; say it where the user will see it.
    warnings.warn(str(err), stacklevel=2)
    raise

import pdmask.integrations.verl.cpu  # noqa: E402, F401  (registers VERL_PLATFORM=pdmask_cpu, chosen only by that)
from pdmask.integrations.verl.losses import BINARY_METHODS, loss_name, verl_thresholds  # noqa: E402
from pdmask.integrations.verl.topk import TOPK_IDS, TOPK_LOGP, TOPK_METHODS, PDMLoss, enable_topk_forward  # noqa: E402

try:  # verl's v1 trainer needs its rollout stack (TransferQueue, FastAPI, ...); without it verl cannot run one either
    import verl.trainer.ppo.v1  # noqa: F401
except ImportError:
    pass
else:
    import pdmask.integrations.verl.trainer  # noqa: F401  (registers trainer.v1.trainer_mode=pdmask_sync)

__all__ = [
    "BINARY_METHODS",
    "TOPK_IDS",
    "TOPK_LOGP",
    "TOPK_METHODS",
    "VERL_MAX",
    "VERL_MIN",
    "PDMLoss",
    "check_verl_version",
    "enable_topk_forward",
    "loss_name",
    "verl_thresholds",
]
