"""`pdmask backbone-scale`: which term of the whole network's step decides the sign of ΔD (docs/method.md §6b).

A token's own plain step changes D by ηA·[(‖h‖² + 1)·G + κ·G_W] when the backbone's kernel in hidden
space is K ≈ κ·I. κ = tr(K)/d with K = J Jᵀ, J = ∂h/∂θ, is estimated per position by Hutchinson's
estimator, tr K = E_v ‖Jᵀv‖² for v ~ N(0, I_d): one backward of vᵀh per probe. μ is π perturbed in logit
space (the kernel scales do not depend on μ; the ratio of the two terms does, a little).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from pdmask import RolloutLogprobs, policy_stats, predicted_change

HELP = "Measure the backbone's kernel scale κ against the LM head's ‖h‖² at response positions (backbone-aware masks)."
PROMPT = "Question: what is 17 + 25? Think step by step, then give the answer. Answer: 17 + 25 = 42 because"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="small", help="small (the lab's SFT-started TinyGPT) or smollm2-135m")
    p.add_argument("--positions", type=int, default=12, help="last positions of the prompt to measure (default 12)")
    p.add_argument("--probes", type=int, default=6, help="Hutchinson probes per position (default 6)")
    p.add_argument("--seed", type=int, default=0)


def _policy_and_prompt(name: str) -> tuple[nn.Module, torch.Tensor]:
    from pdmask.lab.models import build_policy, is_pretrained

    if is_pretrained(name):
        policy = build_policy(name)
        return policy, policy.tokenizer(PROMPT, return_tensors="pt").input_ids
    from pdmask.lab.presets import PRESETS
    from pdmask.lab.sft import warm_start
    from pdmask.lab.tasks import build_task

    cfg = PRESETS["default"].base.replace(model=name)
    policy = build_policy(name, vocab_size=cfg.vocab_size, block_size=cfg.block_size())
    task = build_task(cfg.task, **cfg.task_kwargs())
    warm_start(cfg, policy, task)
    problem = task.sample(1, torch.Generator().manual_seed(0))[0]
    return policy, torch.tensor([[*problem.prompt_ids, *task.answer_ids(problem, torch.Generator().manual_seed(0))]])


def measure(name: str, positions: int, probes: int, seed: int) -> dict[str, list[float]]:
    """Per position: κ, ‖h‖², and |κ·G_W| / |‖h‖²·G| and sign agreement for KL and TV."""
    torch.manual_seed(seed)
    policy, ids = _policy_and_prompt(name)
    policy.eval()
    head = policy.get_submodule("lm_head")
    weight = head.weight
    seen: list[torch.Tensor] = []
    hook = head.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    logits = policy(ids, torch.ones_like(ids))[0]
    hook.remove()
    h = seen[-1][0]
    params = [p for p in policy.parameters() if p is not weight]  # the head's role of W is the head term
    rows = list(range(max(0, h.shape[0] - positions), h.shape[0]))
    out: dict[str, list[float]] = {"kappa": [], "h_sq": []}
    for t in rows:
        total = 0.0
        for _ in range(probes):
            v = torch.randn(h.shape[1])
            grads = torch.autograd.grad((h[t] * v).sum(), params, retain_graph=True, allow_unused=True)
            total += sum(float(g.double().square().sum()) for g in grads if g is not None)
        out["kappa"].append(total / probes / h.shape[1])
        out["h_sq"].append(float(h[t].detach().double().square().sum()))
    z = logits.detach().double()[rows]
    mu_logp = torch.log_softmax(z + 0.3 * torch.randn_like(z), -1)
    a = torch.multinomial(mu_logp.exp(), 1).squeeze(-1)
    mu = RolloutLogprobs(mu_logp.gather(-1, a[:, None]).squeeze(-1), full_logp=mu_logp)
    stats = policy_stats(z, a, mu, head_weight=weight.detach().double())
    kappa, h_sq = torch.tensor(out["kappa"]).double(), torch.tensor(out["h_sq"]).double()
    for kind in ("kl", "tv"):
        g, gw = predicted_change(stats, kind, "full"), predicted_change(stats, kind, "backbone_full")
        out[f"ratio_{kind}"] = ((kappa * gw).abs() / (h_sq * g).abs().clamp_min(1e-300)).tolist()
        out[f"agree_{kind}"] = (torch.sign(g) == torch.sign(gw)).double().tolist()
    return out


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    if args.positions < 1 or args.probes < 1:
        raise SystemExit("--positions and --probes must be >= 1")
    m = measure(args.model, args.positions, args.probes, args.seed)
    table = Table(title=f"{args.model}: backbone kernel scale κ = tr(K)/d vs the head's ‖h‖² ({args.probes} probes)")
    for col in ("position", "κ", "‖h‖²", "κ/‖h‖²", "|κG_W|/|‖h‖²G| KL", "TV", "sign(G)=sign(G_W) KL", "TV"):
        table.add_column(col, justify="right")
    for i, (k, hh) in enumerate(zip(m["kappa"], m["h_sq"], strict=True)):
        table.add_row(
            str(i), f"{k:.1f}", f"{hh:.1f}", f"{k / hh:.2f}", f"{m['ratio_kl'][i]:.2f}", f"{m['ratio_tv'][i]:.2f}",
            "yes" if m["agree_kl"][i] else "no", "yes" if m["agree_tv"][i] else "no",
        )
    console = Console(width=max(Console().width, 120))
    console.print(table)
    med = lambda xs: sorted(xs)[len(xs) // 2]
    console.print(
        f"median κ/‖h‖² = {med([k / h for k, h in zip(m['kappa'], m['h_sq'], strict=True)]):.2f}; median |κG_W|/|‖h‖²G| = "
        f"{med(m['ratio_kl']):.2f} (KL), {med(m['ratio_tv']):.2f} (TV); above 1 the backbone term decides the sign."
    )
    return 0
