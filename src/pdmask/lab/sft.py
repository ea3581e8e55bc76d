"""SFT warm start for TinyGPT: teacher-forced cross-entropy on ideal answers, cached on disk.

RL from a random init on these tasks would spend most of its budget finding the answer format; a
short SFT gives every method the same non-trivial starting policy. The cache is keyed by
``Config.sft_key()`` (``Config.warm_start_seed``, model, task, vocabulary and SFT settings) under ``$PDMASK_CACHE``
(default ``~/.cache/pdmask``), and written atomically, so parallel runs can share it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pdmask.lab.config import Config
from pdmask.lab.files import save_atomic
from pdmask.lab.models import build_policy
from pdmask.lab.tasks import SequenceTask


def cache_dir() -> Path:
    return Path(os.environ.get("PDMASK_CACHE", Path.home() / ".cache" / "pdmask"))


def initial_policy(cfg: Config) -> nn.Module:
    """The policy before its warm start, its init drawn from ``cfg.warm_start_seed`` (torch's global seed)."""
    torch.manual_seed(cfg.warm_start_seed)
    return build_policy(cfg.model, vocab_size=cfg.vocab_size, block_size=cfg.block_size())


def sft_path(cfg: Config) -> Path:
    return cache_dir() / "sft" / f"{cfg.model}-{cfg.task}-{cfg.sft_key()}.pt"


def train_sft(cfg: Config, policy: nn.Module, task: SequenceTask) -> None:
    """cfg.sft_steps Adam steps on batches of (prompt, ideal answer); updates ``policy`` in place."""
    g = torch.Generator().manual_seed(10_000 + cfg.warm_start_seed)  # its own stream, apart from RL's
    opt = torch.optim.Adam(policy.parameters(), lr=cfg.sft_lr, fused=True)
    policy.train()
    for _ in range(cfg.sft_steps):
        problems = task.sample(cfg.sft_batch, g)
        seqs = torch.tensor([[*p.prompt_ids, *task.answer_ids(p, g)] for p in problems])  # [B, P + L + 1]
        P = task.prompt_len
        # Only the answer tokens are supervised: positions P-1 .. end predict them.
        logits = policy(seqs[:, :-1], first=P - 1)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, P:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()


def warm_start(cfg: Config, policy: nn.Module, task: SequenceTask) -> Path:
    """Load the cached SFT weights into ``policy``, training and caching them first if missing."""
    path = sft_path(cfg)
    if path.exists():
        policy.load_state_dict(torch.load(path, weights_only=True))
        return path
    train_sft(cfg, policy, task)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_atomic(policy.state_dict(), path)
    return path
