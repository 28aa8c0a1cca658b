"""The loss-vs-compute fits a sweep ends with, and the run they predict at fit.target_flops."""

from __future__ import annotations

import math
from pathlib import Path

from sweeper.config.schema import BUDGET_KEYS
from sweeper.files import write_json_atomic
from sweeper.sweep.plan import SweepPlan
from sweeper.sweep.stages import fit_micro_batch, reproduce_command, reproduce_overrides


def fit_sweep(out: Path, reports: list[dict], plan: SweepPlan) -> dict | None:
    """Loss against compute over every report of every trial (the frontier), plus the
    parametric law, IsoFLOP optima and LR-vs-compute where the sweep's grid allows."""
    from sweeper.scaling import fit_all, plot_all
    from sweeper.scaling.summary import format_summary

    spec, fit_cfg = plan.spec, plan.fit
    points = [
        {
            "N": r.get("params"),
            "D": r.get("tokens"),
            "C": r.get("flops"),
            "loss": r.get(spec.metric),
            "final": bool(r.get("final")),
            "budget": r.get("budget"),
            "lr": r.get("peak_lr"),
            "batch_size": r.get("total_batch_size"),
            "seed": r.get("seed"),
        }
        for r in reports
        # a replayed run's reports are its earlier run's, which the fits already have
        if r.get("status") != "diverged"
        and r.get(spec.metric) is not None
        and not r.get("reused_from")
    ]
    conventions = {"params": "total", "flops": "per_token_with_attention", "loss_unit": spec.metric}
    fits, not_fitted = applicable_fits(points)
    try:
        result = fit_all(
            points,
            target_flops=fit_cfg.get("target_flops"),
            bootstrap=int(fit_cfg.get("bootstrap") or 0),
            conventions=conventions,
            fits=fits,
        )
        result["not_fitted"] = not_fitted
        result["predicted_run"] = predicted_run(result, plan.base, points)
        write_json_atomic(out / "fit.json", result)
    except Exception as error:  # a fit that can't be made must not lose the sweep
        return {"error": str(error).splitlines()[0] if str(error) else type(error).__name__}
    try:
        plots = plot_all(result, points, out)
    except Exception as error:  # nor a plot the fit written above, with its summary
        plots = []
        print(f"warning: the fit's plots failed: {type(error).__name__}: {error}")
    print("\nloss against compute (fit.json):")
    print(format_summary(result))
    if result["predicted_run"]:
        print(f"run it at C = {result['target_flops']:.3g} FLOPs:")
        print(f"  {reproduce_command(result['predicted_run'])}")
        if note := predicted_run_note(result, points):
            print(f"  {note}")
    if not_fitted:
        print(f"not fitted: {'; '.join(not_fitted.values())} (+sweep=scaling trains such a grid)")
    return {
        "file": "fit.json",
        "plots": [Path(p).name for p in plots],
        "warnings": result.get("warnings", []),
    }


def predicted_run(result: dict, base: dict, points: list[dict]) -> list[str] | None:
    """fit.target_flops's run as overrides of `python -m sweeper`: the sweep's config with
    its budget at the target and the LR and batch size the laws predict there. A varied
    hyperparameter without a law (its optima all grid ends) takes its best value at the
    largest budget, where the laws were measured, not the base config's. The batch is
    rounded to whole sequences, which a run requires, and trains in the largest micro-batch
    up to the sweep's that divides it, as the sweep's trials did. None where no law
    predicts, or the config is a user function's."""
    predictions, target = result.get("predictions") or {}, result.get("target_flops")
    if target is None or not {"lr_opt", "batch_size_opt"} & predictions.keys():
        return None
    try:
        values = {
            name: predictions.get(f"{name}_opt") or _best_at_largest_budget(points, name)
            for name in ("lr", "batch_size")
        }
        config = {**base, "trainer": dict(base["trainer"]), "optimizer": dict(base["optimizer"])}
        trainer, optimizer = config["trainer"], config["optimizer"]
        trainer.update({key: None for key in BUDGET_KEYS}, budget_flops=target)
        if values["batch_size"]:
            sequence = base["model"]["seq_len"] * trainer["workers"]
            trainer["total_batch_size"] = whole_sequences(values["batch_size"], sequence)
        if values["lr"]:  # the LR the sweep varied: its peak_lr
            key = "lr" if optimizer.get("name") == "adamw" else "matrix_lr"
            optimizer[key] = float(f"{values['lr']:.4g}")
        return reproduce_overrides(fit_micro_batch(config))
    except Exception:  # a user's function's config (no run of sweeper's to predict), odd records
        return None


def whole_sequences(tokens: float, sequence: int) -> int:
    """The batch of whole `sequence`-token sequences nearest `tokens` on a log scale, where
    batch optima are read and fitted (377 tokens of 256-token sequences: 512, not 256), at
    least one sequence."""
    count = tokens / sequence
    if count <= 1:
        return sequence
    below = math.floor(count)
    return (below + 1 if (below + 1) / count < count / below else below) * sequence


def predicted_run_note(result: dict, points: list[dict]) -> str | None:
    """Where the predicted run's batch is not the one meant (the batch law's prediction, or
    without a law the best batch at the largest budget) by more than a tenth, rounded to
    whole sequences, a line that says so: a law through batch optima at a grid's end can
    predict fewer tokens than one sequence."""
    run = [
        o for o in result.get("predicted_run") or [] if o.startswith("trainer.total_batch_size=")
    ]
    if not run:
        return None
    predicted = (result.get("predictions") or {}).get("batch_size_opt")
    meant = predicted or _best_at_largest_budget(points, "batch_size")
    batch = int(run[-1].split("=", 1)[1])
    if not meant or abs(batch - meant) <= 0.1 * meant:
        return None
    what = "the batch law predicts" if predicted else "the best batch at the largest budget is"
    return (
        f"({what} {meant:.4g} tokens; the run takes {batch}, the nearest whole number of "
        "sequences (model.seq_len tokens) on a log scale, at least one)"
    )


def _best_at_largest_budget(points: list[dict], name: str) -> float | None:
    """The value of `name` ("lr" or "batch_size") with the lowest final loss at the largest
    budget (seeds averaged, as the fits read it); None where the sweep did not vary it."""
    import numpy as np

    from sweeper.scaling.hparams import optimum_on_grid
    from sweeper.scaling.records import average_seeds, to_points

    pts, _ = average_seeds(to_points(points))
    budgets = np.array([b if isinstance(b, float | int) else np.nan for b in pts.budget], float)
    ok = pts.final & pts.has(name) & np.isfinite(budgets)
    values = getattr(pts, name)
    if len(set(values[ok])) < 2:
        return None
    at = ok & (budgets == np.nanmax(budgets[ok]))
    return optimum_on_grid(values[at], pts.loss[at])[0]


def applicable_fits(points: list[dict]) -> tuple[tuple[str, ...], dict[str, str]]:
    """The fits a sweep's points can support, and why each other one is left out. An LR
    sweep trains one model size with no compute-budget labels: its L(N, D), IsoFLOP and
    hyperparameter-vs-compute fits could only fail, and saying so at the end of every such
    sweep would read as a fault. `python -m sweeper.fit <run dir>` still tries them all."""
    fits, not_fitted = ["frontier"], {}
    if len({p["N"] for p in points if p["N"]}) > 1:
        fits.append("parametric")
    else:
        not_fitted["parametric"] = "L(N, D) needs several model sizes"
    if not any(p["budget"] is not None for p in points):
        not_fitted["isoflop"] = "IsoFLOP optima and LR-vs-compute need budget-labelled runs"
    elif "parametric" in fits:
        fits += ["isoflop", "hparams"]
    else:
        not_fitted["isoflop"] = "IsoFLOP optima need several model sizes at each budget"
        fits.append("hparams")
    return tuple(fits), not_fitted
