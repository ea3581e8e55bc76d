"""The verdicts of ``pdmask.lab.verdicts`` in plain words, and as the JSON of report.json."""

from __future__ import annotations

from typing import Any

from pdmask.lab.verdicts import Facts, Learning, Methods, PdmVsDppo, Questions, Ranking, Replication, TrustRegion


def _including(interval_excludes_zero: bool) -> str:
    return "excluding" if interval_excludes_zero else "including"


def ranking_words(r: Ranking, methods: Methods, label: str) -> str:
    """The methods in order of one metric, and which are clearly behind the leader."""
    order, leader, diffs = r.comparison["order"], r.comparison["leader"], r.comparison["diff_to_leader"]
    words = (
        f"{label.capitalize()} over {r.seeds} seed{'s' if r.seeds > 1 else ''}: "
        + ", ".join(f"{m} {methods[m][r.metric]['mean']:.3f}" for m in order)
        + "."
    )
    if r.identical:
        return words + " Identical for every method on every seed: no mask changed it."
    if r.seeds < 2:
        return words + f" {leader} is ahead, but with one seed there is no seed-to-seed spread to judge the difference against."
    clear, tied = r.clear, r.tied
    if not clear:
        return words + (
            f" {leader} has the highest mean, but its lead over every other method is within the seed-to-seed spread "
            f"(seed standard deviation about {r.spread:.3f}; every paired 95% interval of the difference includes 0)."
        )
    behind = ", ".join(
        f"{m} ({diffs[m]['mean']:+.3f}, 95% CI [{diffs[m]['low']:+.3f}, {diffs[m]['high']:+.3f}])" for m in clear
    )
    words += f" {leader} is ahead; clearly behind it, beyond the seed-to-seed spread (paired over seeds): {behind}."
    if tied:
        words += f" Not distinguishable from {leader} at this number of seeds: {', '.join(tied)}."
    return words


def learning_words(q: Learning) -> str:
    answer = {"yes": "Yes", "fell": "No, it fell", "not measurably": "Not measurably"}[q.answer]
    words = (
        f"Did RL learn? {answer}: the best "
        f"masked method, {q.best_masked}, ends {q.gain.fmt(signed=True)} in held-out accuracy against its SFT start of {q.start:.3f} "
        f"(paired 95% CI over {q.gain.n} seeds, {_including(q.gain.excludes_zero)} 0)"
    )
    if q.pg_is_gain is not None:
        words += f"; pg_is (no trust region) changes by {q.pg_is_gain.fmt(signed=True)}"
    if q.other_gain is not None:
        words += f". By the other held-out accuracy, {q.best_masked} changes by {q.other_gain.fmt(signed=True)}"
    return words + "."


def trust_region_words(q: TrustRegion) -> str:
    gap, speed, growth, best = q.accuracy_gap, q.mean_accuracy_gap, q.mismatch_growth_gap, q.best_masked
    return (
        f"Did the trust region matter? {'Yes' if q.mattered else 'Not measurably'}: the best masked method, {best}, "
        f"ends {gap.fmt(signed=True)} in final held-out accuracy against pg_is (no trust region; paired 95% CI over "
        f"{gap.n} seeds, {_including(gap.excludes_zero)} 0) and {speed.fmt(signed=True)} in mean "
        f"held-out accuracy over the run ({_including(speed.excludes_zero)} 0); pg_is's mismatch TV grows "
        f"{growth.fmt(4, signed=True)} more than {best}'s from the first to the last tenth of the run "
        f"({_including(growth.excludes_zero)} 0)."
    )


def pdm_words(q: PdmVsDppo) -> str:
    parts = []
    for pdm, p in q.pairs.items():
        if p.identical_runs:
            parts.append(f"{pdm} and {p.dppo} gave identical runs on every seed (their masks never differed)")
        else:
            clear = "beyond" if p.accuracy_diff.excludes_zero else "within"
            power = f"; these seeds detect a true ±{p.detectable:.3f} with 80% power" if p.accuracy_diff.n > 1 else ""
            parts.append(
                f"{pdm} − {p.dppo} = {p.accuracy_diff.fmt(signed=True)} in final held-out accuracy, {clear} the seed spread{power}"
            )
    return f"Did PDM differ from DPPO? {'Yes' if q.differed else 'Not measurably'} (paired 95% CIs over seeds): " + "; ".join(parts) + "."


def masks_words(q: PdmVsDppo) -> str | None:
    """How often each top-K PDM mask and DPPO-TopK's decided differently, on the updates of the two runs."""
    shares = {pdm: p for pdm, p in q.pairs.items() if p.masks_differ is not None}
    if not shares:
        return None
    return "How often did the masks differ? " + "; ".join(
        f"{pdm} and {p.dppo} decided differently on {p.masks_differ:.2%} of response tokens" for pdm, p in shares.items()
    ) + " (both runs' updates, each mask on the same logits and μ; only there can their runs differ)."


def question_words(questions: Questions) -> list[str]:
    """The words of each question asked, in order."""
    out = []
    if questions.learning is not None:
        out.append(learning_words(questions.learning))
    if questions.trust_region is not None:
        out.append(trust_region_words(questions.trust_region))
    if questions.pdm_vs_dppo is not None:
        out.append(pdm_words(questions.pdm_vs_dppo))
        masks = masks_words(questions.pdm_vs_dppo)
        out += [masks] if masks else []
    return out


def facts_words(f: Facts, methods: Methods) -> str:
    mean = lambda m, k: methods[m][k]["mean"]
    words = (
        f"Held-out accuracy at the start (after SFT): {f.start:.3f}. "
        f"Tokens masked: from {mean(f.least_dropped, 'dropped_frac'):.2%} ({f.least_dropped}) "
        f"to {mean(f.most_dropped, 'dropped_frac'):.2%} ({f.most_dropped}). "
        + (
            f"Largest fall from a run's best held-out accuracy to its final one: {f.most_unstable} "
            f"({mean(f.most_unstable, 'peak_to_final_drop'):.3f} on average). "
            if mean(f.most_unstable, "peak_to_final_drop") > 0
            else "No run fell below its best held-out accuracy. "
        )
        + f"Mismatch between the trainer and the rollout engine: TV {f.mismatch_tv:.4f} on average per token, "
        f"{f.mismatch_tv_max:.3f} at most. "
        + "The top-K predictive estimators' masks (the paper's aggregated and uniform tails, pdmask's proportional "
        f"and exactpi) differed on {f.tail_masks_differ:.3%} of "
        f"response tokens on average; π kept {f.pi_rest:.2%} of its mass outside TopK(μ) ∪ {{a}}."
    )
    if f.identical_groups:
        words += " " + " ".join(f"{' and '.join(g)} gave identical metrics on every seed." for g in f.identical_groups)
    return words


def setting_words(name: str, methods: Methods, final: Ranking, speed: Ranking, questions: Questions, facts: Facts) -> str:
    """The setting's summary (markdown): one bullet per question, then both rankings and the facts."""
    bullets = [
        *question_words(questions),
        ranking_words(final, methods, "final held-out accuracy"),
        ranking_words(speed, methods, "mean held-out accuracy over the run (learning speed)"),
        facts_words(facts, methods),
    ]
    return f"**{name}**\n\n" + "\n".join(f"- {b}" for b in bullets)


def questions_json(questions: Questions) -> dict[str, dict[str, Any] | None]:
    """The questions as report.json holds them, each with its words."""
    learning = trust = pdm = None
    if (q := questions.learning) is not None:
        learning = {"best_masked": q.best_masked, "gain": q.gain.as_dict(), "answer": q.answer, "words": learning_words(q)}
    if (t := questions.trust_region) is not None:
        trust = {
            "best_masked": t.best_masked,
            "accuracy_gap": t.accuracy_gap.as_dict(),
            "mean_accuracy_gap": t.mean_accuracy_gap.as_dict(),
            "mismatch_growth_gap": t.mismatch_growth_gap.as_dict(),
            "mattered": t.mattered,
            "answer": t.answer,
            "words": trust_region_words(t),
        }
    if (p := questions.pdm_vs_dppo) is not None:
        pairs = {
            m: {
                "dppo": r.dppo, "accuracy_diff": r.accuracy_diff.as_dict(), "identical_runs": r.identical_runs,
                "answer": r.answer, "masks_differ": r.masks_differ, "paired_sd": r.spread, "detectable_80": r.detectable,
            }
            for m, r in p.pairs.items()
        }  # fmt: skip
        pdm = {"pairs": pairs, "differed": p.differed, "words": pdm_words(p)}
    return {"learning": learning, "trust_region": trust, "pdm_vs_dppo": pdm}


def replication_json(rep: Replication | None) -> dict[str, Any] | None:
    if rep is None:
        return None
    rows = {key: {"all": r.all, "halves": r.halves, "replicates": r.replicates} for key, r in rep.verdicts.items()}
    return {"halves": rep.halves, "verdicts": rows}
