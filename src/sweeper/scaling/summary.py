"""Human-readable text summary of a `fit_all` result (what `python -m sweeper.fit` prints)."""

from __future__ import annotations


def _num(x) -> str:
    if x is None:
        return "n/a"
    ax = abs(x)
    if ax != 0 and (ax >= 1e5 or ax < 1e-3):
        return f"{x:.3e}"
    return f"{x:.4g}"


def _val(name: str, value, ci=None) -> str:
    text = f"{name} = {_num(value)}"
    if ci:
        text += f" [{_num(ci[0])}, {_num(ci[1])}]"
    return text


def _cis(section: dict) -> dict:
    return ((section or {}).get("bootstrap") or {}).get("ci95") or {}


def _seed_lines(seeds: dict) -> list[str]:
    k = round(seeds["final_runs"] / max(seeds["final_points"], 1), 1)
    names = ", ".join(str(s) for s in seeds["seeds"])
    return [
        f"Seeds {names}: runs that differ only in their seed are fitted as their mean "
        f"({seeds['final_runs']} final runs -> {seeds['final_points']} points); a final loss "
        f"varies between seeds by sd {seeds['sd']:.4f} (a mean of {k:g}: "
        f"+- {seeds['sd'] / k**0.5:.4f})"
    ]


def _frontier_lines(fr: dict) -> list[str]:
    ci = _cis(fr)
    head = (
        f"Compute frontier  L(C) = E + A*C^-alpha  ({fr['n_points']} envelope points of "
        f"{fr['n_candidates']}; rmse(log L) = {_num(fr['rmse_log'])})"
    )
    vals = "  ".join(_val(k, fr[k], ci.get(k)) for k in ("E", "A", "alpha"))
    return [head, "  " + vals]


def _parametric_lines(par: dict) -> list[str]:
    ci = _cis(par)
    head = (
        f"Parametric law  L(N, D) = E + A/N^alpha + B/D^beta  ({par['n_points']} final points; "
        f"{par['n_starts']} starts, {par['n_refined']} refined; |grad| = {par['grad_norm']:.1e})"
    )
    vals = "  ".join(_val(k, par[k], ci.get(k)) for k in ("E", "A", "B", "alpha", "beta"))
    exps = f"{_val('a', par['a'], ci.get('a'))}  {_val('b', par['b'], ci.get('b'))}"
    return [head, "  " + vals, f"  N_opt ~ C^a, D_opt ~ C^b:  {exps}"]


def _isoflop_lines(iso: dict) -> list[str]:
    profs = iso["profiles"]
    valid = sum(p["valid"] for p in profs)
    line = f"IsoFLOP profiles (parabola in ln N): {len(profs)} budget(s), {valid} usable"
    if iso.get("n_opt_law"):
        r2 = iso["n_opt_law"]["r2"]
        line += f";  a = {iso['a']:.4f}, b = {iso['b']:.4f}"
        if r2 is not None:
            line += f" (R^2 of N_opt fit {r2:.3f})"
    return [line]


def _fixed(x, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _seed_law(entry: dict) -> str:
    law = "no law" if entry["p"] is None else f"C^{entry['p']:.3f}"
    return f"{law} (seed {entry['seed']})"


def _hparam_lines(hp: dict) -> list[str]:
    lines = []
    for name, law in hp.items():
        how = law.get("how") or []  # fit.json files written before it was kept lack it
        ends = how.count("grid end")
        optima = ", ".join(f"{_num(c)}: {_num(v)}" for c, v in zip(law["budgets"], law["best"]))
        lines.append(
            f"Optimal {name} vs compute: {name} = {_num(law['k'])} * C^{law['p']:.4f} "
            f"({law['n_points']} budgets; optima {optima}"
            + (f"; {ends} at an end of the values tried" if ends else "")
            + ")"
        )
        if law.get("per_seed"):
            own = ", ".join(_seed_law(e) for e in law["per_seed"])
            lines.append(f"  each seed alone: {own}")
    return lines


def _lr_vs_batch_lines(lvb: dict) -> list[str]:
    lines = ["Optimal lr vs batch size at each budget (lr ~ B^g; * at an end of the LRs tried):"]
    for b in lvb["budgets"]:
        optima = ", ".join(
            f"{_num(batch)}: {_num(lr)}{'*' if how == 'grid end' else ''}"
            for batch, lr, how in zip(b["batch_size"], b["lr"], b["how"])
        )
        g = "-" if b["exponent"] is None else f"{b['exponent']:.2f}"
        lines.append(f"  C = {_num(b['budget'])}: g = {g} ({optima})")
    if lvb["exponent"] is not None:
        lines.append(
            f"  pooled g = {lvb['exponent']:.2f}: the nearest lr_rule for this LR over these "
            f"batches is {lvb['closest_lr_rule']} (sqrt 0.5, linear 1)"
        )
        if lvb.get("per_seed"):
            own = ", ".join(
                f"{_fixed(e['exponent'], 2)} (seed {e['seed']})" for e in lvb["per_seed"]
            )
            lines.append(f"  each seed alone: g = {own}")
    return lines


def _prediction_lines(result: dict) -> list[str]:
    pr = result["predictions"]
    if result.get("target_flops") is None or not pr:
        return []
    lines = [f"Predictions at C = {result['target_flops']:.3e} FLOPs:"]
    if "frontier_loss" in pr:
        lines.append(
            "  frontier: " + _val("loss", pr["frontier_loss"], pr.get("frontier_loss_ci95"))
        )
    if "parametric_N_opt" in pr:
        parts = [
            _val(label, pr[f"parametric_{key}"], pr.get(f"parametric_{key}_ci95"))
            for key, label in (
                ("N_opt", "N_opt"),
                ("D_opt", "D_opt"),
                ("tokens_per_param", "tokens/param"),
                ("loss_opt", "loss"),
            )
        ]
        # L(N, D)'s optimum along C = 6 N D, N all parameters (Chinchilla's convention): a
        # sweep's C also counts attention, 0-7% more on the scaling sweep's shapes
        lines.append("  parametric (C = 6ND): " + "  ".join(parts))
    if "isoflop_N_opt" in pr:
        lines.append(
            f"  isoflop: {_val('N_opt', pr['isoflop_N_opt'])}  {_val('D_opt', pr['isoflop_D_opt'])}"
        )
    for name in ("lr", "batch_size"):
        if f"{name}_opt" in pr:
            own = [
                e.get("prediction")
                for e in (result.get("hparams") or {}).get(name, {}).get("per_seed") or []
            ]
            spread = ", ".join(_num(x) for x in own)
            lines.append(
                f"  optimal {name}: {_num(pr[f'{name}_opt'])}"
                + (f" (each seed's own law: {spread})" if own else "")
            )
    return lines


def format_summary(result: dict) -> str:
    """Multi-line text: each fit's parameters with 95% CIs, predictions, warnings."""
    conv = result["conventions"]
    lines = [
        f"{result['n_used']} of {result['n_records']} records used "
        f"(params={conv['params']}, flops={conv['flops']}, loss={conv['loss_unit']})"
    ]
    if result.get("seeds"):
        lines += _seed_lines(result["seeds"])
    if result.get("frontier"):
        lines += _frontier_lines(result["frontier"])
    if result.get("parametric"):
        lines += _parametric_lines(result["parametric"])
    if result.get("isoflop"):
        lines += _isoflop_lines(result["isoflop"])
    if result.get("hparams"):
        lines += _hparam_lines(result["hparams"])
    if result.get("lr_vs_batch"):
        lines += _lr_vs_batch_lines(result["lr_vs_batch"])
    lines += _prediction_lines(result)
    if any(_cis(result.get(k)) for k in ("frontier", "parametric")):
        lines.append("[brackets: 95% percentile bootstrap intervals]")
    if result["warnings"]:
        lines.append("Warnings:")
        lines += [f"  - {w}" for w in result["warnings"]]
    return "\n".join(lines)
