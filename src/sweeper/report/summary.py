"""End of a sweep: the baseline run, the tables, summary.json, reports.csv, plots, fit."""

from __future__ import annotations

import csv
import dataclasses
import math
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

from sweeper.config.schema import BUDGET_KEYS
from sweeper.report.importance import importance_text, stage_importance
from sweeper.sweep.results import REPORT_COLUMNS
from sweeper.sweep.space import LIST_KINDS, ParamSpec, range_edge
from sweeper.sweep.spec import SweepSpec, flatten, flatten_params, stage_space
from sweeper.sweep.stages import fit_micro_batch, rounded_text, unresolved_rivals
from sweeper.sweep.state import SweepState, write_json_atomic
from sweeper.sweep.trainable import RUNG_METRIC

# --- the baseline: the unmodified config under the same budget --------------------------
RUN_TIMES = ("started_ms", "ended_ms")  # train_once's, for its MLflow run


def train_once(base: dict, metric: str, target: str | None, threads: int, gpus: float) -> dict:
    """One run of a config outside Tune, placed as a trial is (the baseline, confirmations).
    Its result holds when it started and ended (ms): the driver logs it to MLflow later."""
    started_ms = int(time.time() * 1000)
    result = _train_once(base, metric, target, threads, gpus)
    return {**result, RUN_TIMES[0]: started_ms, RUN_TIMES[1]: int(time.time() * 1000)}


def _train_once(base: dict, metric: str, target: str | None, threads: int, gpus: float) -> dict:
    import torch

    if target:
        from sweeper.sweep.trainable import Diverged, load_target, penalise, plain_numbers

        seen: list[dict] = []

        def report(metrics: dict, state=None) -> None:
            seen.append(plain_numbers(metrics, metric))
            if penalise(seen[-1], metric, math.nan)[1]:  # ended as a trial would be
                raise Diverged

        try:
            load_target(target)(base, report)
        except Diverged:
            return {"value": None, "status": "diverged"}
        return {"value": seen[-1].get(metric) if seen else None, "status": "completed"}
    from sweeper.sweep.trainable import placed

    base = placed(base, threads, gpus)  # as a trial is: the comparison is like for like
    if base["trainer"]["workers"] > 1:
        import json
        import tempfile

        from sweeper.train.distributed import train_ddp

        with tempfile.TemporaryDirectory() as folder:
            train_ddp(
                base,
                cpus_per_worker=threads,
                storage_path=folder,
                name="baseline",
                inside_tune=False,
                result_path=f"{folder}/result.json",
            )
            with open(f"{folder}/result.json") as f:
                result = json.load(f)
            if result.get("out_of_memory"):  # the ranks recorded it quietly (distributed.py)
                raise RuntimeError(result["error"])
    else:
        from sweeper.train.loop import train

        torch.set_num_threads(threads)
        result = train(base, verbose=False)
    return {
        "value": result.get(metric),
        "status": result["status"],
        "tokens": result["tokens"],
        "flops": result["flops"],
        "params": result["params"],
        "steps": result.get("steps"),
    }


def launch_once(config: dict, spec: SweepSpec, target: str | None):
    """`train_once` as a Ray task holding one trial's resources; returns its ObjectRef."""
    import ray

    ddp = not target and config["trainer"]["workers"] > 1
    # a DDP run only launches a TorchTrainer, whose ranks hold the resources
    remote = ray.remote(
        num_cpus=0 if ddp else spec.cpus_per_trial,
        num_gpus=0 if ddp else spec.gpus_per_trial,
    )(train_once)
    return remote.remote(config, spec.metric, target, spec.trial_threads, spec.gpus_per_trial)


class Baseline:
    """The baseline run on Ray, holding one trial's resources. It starts in the first slot
    a stage leaves idle (callbacks.IdleSlot), or after the stages if none did."""

    def __init__(self, base: dict, spec: SweepSpec, target: str | None):
        self.base, self.spec, self.target = base, spec, target
        self.job = None

    def launch(self, where: str) -> None:
        if self.job is not None:
            return
        print(f"baseline: training the unmodified config under the same budget, {where}")
        self.job = launch_once(self.base, self.spec, self.target)

    def collect(self, timeout: float | None = None) -> dict | None:
        """Its result; None if `timeout` (what sweep.max_seconds leaves, in seconds) ran
        out first, or had run out before it started: it is stopped, and a resume trains it."""
        import ray

        if timeout is not None and timeout <= 0 and self.job is None:
            return None
        self.launch("after the stages")
        try:
            return ray.get(self.job, timeout=timeout if timeout is None else max(timeout, 0.0))
        except ray.exceptions.GetTimeoutError:
            ray.cancel(self.job, force=True)
            return None
        except Exception as error:  # a failed baseline must not lose the sweep's results
            return {"value": None, "status": "failed", "error": str(error).splitlines()[0]}


# --- best values at the edge of their range --------------------------------------------
def range_edges(
    spec: SweepSpec,
    stage_name: str,
    start: dict,
    best: dict | None,
    extended: dict[str, list] | None = None,
    own_trainable: bool = True,
) -> list[dict]:
    """The stage's best values that sit at an end of their search range (`range_edge`)
    with values past it (not `nothing_past`): the optimum may lie outside it. `start` is
    the config the stage started from (its lr_rule=retune bands are centred on that
    config's LRs); `extended`, the ranges an extend_trials round searched past the stage's
    own. Each edge names the override that searches past it in the next sweep (`widen`,
    None where the range just past it makes no run or no override reaches it), and its
    note says it."""
    from sweeper.sweep.extend import nothing_past, widening_override

    if best is None:
        return []
    index, stage = _stage_spec(spec, stage_name)
    declared = set(flatten_params(stage.params))
    edges = []
    for param in searched_params(spec, stage_name, start, extended):
        if param.name in COMPUTE_KEYS:
            continue  # more compute trains to a lower loss: its largest value is no optimum
        value = best["params"].get(param.name)
        side = range_edge(param, value)
        if side is None or nothing_past(param, side, start, own_trainable):
            continue
        if param.low is not None:
            scope, hint = (
                f"range [{rounded_text(param.low)}, {rounded_text(param.high)}]",
                "widen the range",
            )
        else:
            scope, hint = f"values {list(param.values)}", "add values beyond it"
        widen = None
        if param.name not in declared:  # an lr_rule=retune band around a frozen LR
            hint = f"raise sweep.stages.{index}.retune_factor ({stage.retune_factor:g})"
        else:
            widen = widening_override(index, stage.params, param, side, start, own_trainable)
        if widen:
            hint += ": " + shlex.quote(widen)  # quoted: zsh refuses an unmatched [...] glob
            # `++`: most sweep files do not set the key, and `+` fails where one does
            if not stage.extend_trials:
                hint += (
                    f" (or ++sweep.stages.{index}.extend_trials=4: the sweep looks there itself)"
                )
        edges.append(
            {
                "param": param.name,
                "value": value,
                "side": side,
                "widen": widen,
                "note": f"best {param.name}={rounded_text(value)} is at the {side} end of its "
                f"{scope}: the optimum may lie {'above' if side == 'high' else 'below'} "
                f"it; {hint}",
            }
        )
    return edges


# a run's compute budget (config.BUDGET_KEYS), which a scaling grid searches over
COMPUTE_KEYS = frozenset(f"trainer.{key}" for key in BUDGET_KEYS)


def _stage_spec(spec: SweepSpec, stage_name: str):
    return next((i, s) for i, s in enumerate(spec.stages) if s.name == stage_name)


def searched_params(
    spec: SweepSpec, stage_name: str, start: dict, extended: dict[str, list] | None = None
) -> list[ParamSpec]:
    """The params a stage searched, as ParamSpecs (its retune bands included), each range
    spanning what an extend_trials round added to it."""
    _, stage = _stage_spec(spec, stage_name)
    params = list(stage_space(spec, stage, flatten(start)).params)
    for i, p in enumerate(params):
        if extended and p.name in extended and p.kind in LIST_KINDS:
            params[i] = dataclasses.replace(p, values=tuple(sorted({*p.values, *extended[p.name]})))
        elif extended and p.name in extended:
            low, high = extended[p.name]
            params[i] = dataclasses.replace(p, low=min(p.low, low), high=max(p.high, high))
    return params


def search_ranges(
    spec: SweepSpec, stage_name: str, start: dict, extended: dict[str, list] | None = None
) -> dict[str, tuple]:
    """name -> (low, high) of each ranged param the stage searched (for its plot)."""
    params = searched_params(spec, stage_name, start, extended)
    return {p.name: (p.low, p.high) for p in params if p.low is not None}


def stage_starts(state: SweepState, base: dict) -> list[dict]:
    """The config each finished stage started from: the one before it ended with."""
    starts = [base] + [stage["base_after"] for stage in state.stages]
    return starts[: len(state.stages)]


# --- tables ----------------------------------------------------------------------------
def print_stage_table(
    stage: str,
    records: list[dict],
    best: dict | None,
    spec: SweepSpec,
    edges: Sequence[dict] = (),
) -> None:
    keys = sorted({k for r in records for k in r["params"]})

    def ranked(r: dict) -> bool:  # a diverged trial's value is the searcher's penalty
        return r["metric"] is not None and r["status"] not in ("diverged", "failed")

    order = sorted(records, key=lambda r: (not ranked(r), _signed(r["metric"], spec.mode)))
    count = f"{len(records)} trial{'s' * (len(records) != 1)}"
    print(f"\n[{stage}] {count}, sorted by {spec.metric}:")
    print("  " + " | ".join([f"{spec.metric:>9}", f"{'status':>9}", *(f"{k:>22}" for k in keys)]))
    for r in order:
        value = f"{r['metric']:.4f}" if ranked(r) else "-"
        cells = [
            f"{value:>9}",
            f"{r['status']:>9}",
            *(f"{rounded_text(r['params'].get(k)):>22}" for k in keys),
        ]
        mark = ""
        if best is not None and r["trial_id"] in best.get("trial_ids", [best["trial_id"]]):
            mark = "  <- best" if "seeds" not in best else "  <- best (mean over seeds)"
        if r.get("reused_from"):
            mark += f"  (= {r['reused_from']}'s run, replayed: not trained again)"
        print("  " + " | ".join(cells) + mark)
    if best is not None and "seeds" in best:
        seeds = ", ".join(map(str, best["seeds"]))
        print(f"  best by the mean over seeds {seeds}: {spec.metric} {best['metric']:.4f}")
        rivals = unresolved_rivals(records, best, spec.mode)
        if rivals:
            named = "; ".join(f"{_params_text(r['params'])} ({r['note']})" for r in rivals[:5])
            more = f"; and {len(rivals) - 5} more" if len(rivals) > 5 else ""
            print(f"  not resolved: the seeds cannot tell it from {named}{more}")
    for edge in edges:
        print(f"  note: {edge['note']}")
    print()


def _params_text(params: dict) -> str:
    return " ".join(f"{k}={rounded_text(v)}" for k, v in sorted(params.items()))


def _signed(value, mode):
    return 0.0 if value is None else (value if mode == "min" else -value)


# --- files -----------------------------------------------------------------------------
def write_reports_csv(path: Path, reports: list[dict], metric: str) -> None:
    # peak_lr and budget (on final rows of a budget grid): what `python -m sweeper.fit <dir>`
    # refits LR-vs-compute and IsoFLOP profiles from, as the sweep's own fit did
    columns = [
        "trial_id",
        "stage",
        "status",
        *REPORT_COLUMNS,
        "total_batch_size",
        "peak_lr",
        "budget",
        "final",
        "seed",
    ]
    if metric not in columns:
        columns.insert(columns.index("val_bpb"), metric)
    if any(RUNG_METRIC in r for r in reports):  # a stage forked trials at its rungs
        columns.insert(columns.index("val_bpb") + 1, RUNG_METRIC)
        columns.insert(columns.index("flops") + 1, "fork_flops")
    if any(r.get("reused_from") for r in reports):  # a trial replayed an earlier run
        columns.append("reused_from")
    # what a user's function reported besides (results.users_figures)
    columns += sorted({k for r in reports for k in r} - set(columns))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(reports)


def seed_note(best: dict, records: list[dict], final: dict) -> dict:
    """For a best ranked by its mean over seeds (a grid with trainer.seed as an axis): the
    seeds, and what its overrides give. They freeze no seed, so they train the one the
    config holds: its own value, not the mean summary.json's `value` is."""
    from sweeper.sweep.stages import SEED_KEY

    seed = final.get("trainer", {}).get("seed")
    own = next(
        (
            r["metric"]
            for r in records
            if r["trial_id"] in best.get("trial_ids", ()) and r["params"].get(SEED_KEY) == seed
        ),
        None,
    )
    return {
        "seeds": best["seeds"],
        "value_is": f"the mean over seeds {', '.join(map(str, best['seeds']))}",
        **({"overrides_value": own, "overrides_seed": seed} if own is not None else {}),
    }


def write_all(
    out: Path,
    spec: SweepSpec,
    state: SweepState,
    base: dict,
    fit_cfg: dict | None = None,
    target: str | None = None,
) -> dict:
    from sweeper.report.markdown import write_report
    from sweeper.report.plots import plot_learning_curves, plot_stage_lr
    from sweeper.sweep.confirm import confirmation_summary
    from sweeper.sweep.runner import reproduce_overrides

    records, reports = state.all_records(), state.all_reports()
    write_reports_csv(out / "reports.csv", reports, spec.metric)
    stages = []
    for stage, start in zip(state.stages, stage_starts(state, base), strict=True):
        best = stage["best"]
        stages.append(
            {
                "name": stage["name"],
                "params": sorted({k for r in stage["records"] for k in r["params"]}),
                "trials": len(stage["records"]),
                "statuses": status_tally(stage["records"]),
                "best_value": best["metric"] if best else None,
                "best_params": best["params"] if best else None,
                "at_range_edge": range_edges(
                    spec, stage["name"], start, best, stage.get("extended"), not target
                ),
                **({"extended": stage["extended"]} if stage.get("extended") else {}),
            }
        )
        searched = searched_params(spec, stage["name"], start, stage.get("extended"))
        importance = stage_importance(searched, stage["records"], stage["reports"], spec.metric)
        if importance:
            stages[-1]["importance"] = importance
        carried = stage.get("carried", best)
        if carried is not None and carried != best:  # the stage froze nothing
            stages[-1]["kept_from"] = {"stage": carried["stage"], "value": carried["metric"]}
        if best and "seeds" in best:
            rivals = unresolved_rivals(stage["records"], best, spec.mode)
            stages[-1]["not_resolved_from"] = rivals
    final = state.stages[-1]["base_after"] if state.stages else base
    carried = state.carried()
    best_value = carried["metric"] if carried else None
    baseline = state.baseline or {}
    summary = {
        "sweep": spec.name,
        "metric": spec.metric,
        "mode": spec.mode,
        "stages": stages,
        "best": {
            "value": best_value,
            spec.metric: best_value,
            "overrides": _overrides(final, reproduce_overrides, target),
        }
        if carried
        else None,
        "baseline": {
            spec.metric: baseline.get("value"),
            **{k: v for k, v in baseline.items() if k not in RUN_TIMES},
        }
        if baseline
        else None,
        "improvement": (baseline["value"] - best_value) * (1 if spec.mode == "min" else -1)
        if baseline.get("value") is not None and best_value is not None
        else None,
        "confirmation": confirmation_summary(spec, state, base),
        "trials": len(records),
        "total_flops": state.total_flops(),
        "elapsed_s": state.elapsed,
    }
    if carried and "seeds" in carried:
        summary["best"].update(seed_note(carried, records, final))
    plots = [plot_learning_curves(out / "learning_curves.png", reports, spec.metric)]
    for stage, start in zip(state.stages, stage_starts(state, base), strict=True):
        name = stage["name"]
        ranges = search_ranges(spec, name, start, stage.get("extended"))
        path = out / f"stage_{name}.png"
        plots.append(
            plot_stage_lr(
                path,
                stage["records"],
                spec,
                stage["best"],
                ranges,
                stage.get("extended"),
                stage["reports"],
            )
        )
    summary["plots"] = [p.name for p in plots if p]
    summary["fit"] = _fit(out, reports, spec, fit_cfg or {}, base)
    try:
        summary["report"] = write_report(out, summary, spec, state, base).name
    except Exception as error:  # a page that cannot be written must not lose the sweep
        summary["report"] = None
        print(f"note: report.md not written: {type(error).__name__}: {error}")
    write_json_atomic(out / "summary.json", finite_or_null(summary))
    _print_summary(summary, spec, out)
    return summary


def finite_or_null(tree):
    """`tree` with NaN and infinities as None: JSON has no literal for them, and Python's
    `NaN` makes the file unreadable to strict parsers (a diverged baseline's value)."""
    if isinstance(tree, dict):
        return {k: finite_or_null(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [finite_or_null(v) for v in tree]
    if isinstance(tree, float) and not math.isfinite(tree):
        return None
    return tree


def kept_note(spec: SweepSpec, incumbent: dict, best: dict, start: dict) -> str:
    """Why a stage froze nothing (stages.keeps_its_start), in one line; `start`: the config
    the stage started from."""
    from sweeper.sweep.stages import get_dotted

    started = {k: get_dotted(start, k) for k in best["params"]}
    return (
        f"its best {spec.metric} {best['metric']:.4f} ({_params_text(best['params'])}) is "
        f"worse than the {incumbent['metric']:.4f} of the config it started from "
        f"({_params_text(started)}, stage '{incumbent['stage']}'): that config is kept"
    )


def _overrides(final: dict, reproduce, target: str | None = None) -> list[str]:
    """The overrides that give `python -m sweeper` the config `final`; for a user's
    function, that runs it once (`trainable._target_` first), its own sections added."""
    from sweeper.config.schema import RUN_SECTIONS
    from sweeper.sweep.spec import flatten
    from sweeper.sweep.stages import hydra_value

    if not target:
        return reproduce(final)
    from sweeper.config.schema import RunConfig

    own = {k: v for k, v in final.items() if k not in RUN_SECTIONS}
    added = [f"+{k}={hydra_value(v)}" for k, v in sorted(flatten(own).items())]
    sections = {k: v for k, v in final.items() if k in RUN_SECTIONS}
    try:
        overrides = reproduce(sections)
    except Exception:  # sweeper's sections need not make a valid run for a user's function
        # (`+model.dropout=0.1`): the changes from the default config, as for a run, a key
        # the defaults lack added with `+`, as it was on the sweep's command line
        before, after = flatten(RunConfig().to_dict()), flatten(sections)
        overrides = [
            f"{'' if k in before else '+'}{k}={hydra_value(after[k])}"
            for k in sorted(after)
            if k not in before or before[k] != after[k]
        ]
    return [f"trainable._target_={target}", *overrides, *added]


def counts_text(statuses: dict[str, int]) -> str:
    """'2 diverged, 1 pruned': how a set of trials ended (`status_tally`'s tally)."""
    return ", ".join(f"{n} {status}" for status, n in sorted(statuses.items()))


def status_tally(records: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    return counts


def _fit(out: Path, reports: list[dict], spec: SweepSpec, fit_cfg: dict, base: dict) -> dict | None:
    """Loss against compute over every report of every trial (the frontier), plus the
    parametric law, IsoFLOP optima and LR-vs-compute where the sweep's grid allows."""
    from sweeper.scaling import fit_all, plot_all
    from sweeper.scaling.summary import format_summary

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
        result["predicted_run"] = predicted_run(result, base, points)
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
    hyperparameter without a law (its optima were all grid ends) takes its best value at
    the largest budget instead: the laws were measured there, not at the base config's
    value. The batch is rounded to a whole number of sequences (`whole_sequences`), which a
    run requires, and trains in the largest micro-batch up to the sweep's that divides it
    (fit_micro_batch), as the sweep's own trials did. None where no law predicts (or the
    config is a user function's, not a sweeper run)."""
    from sweeper.sweep.runner import reproduce_overrides

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

    from sweeper.scaling.analysis import optimum_on_grid
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
    budgets = any(p["budget"] is not None for p in points)
    if budgets and "parametric" in fits:
        fits.append("isoflop")
    elif budgets:
        not_fitted["isoflop"] = "IsoFLOP optima need several model sizes at each budget"
    if budgets:
        fits.append("hparams")
    else:
        not_fitted["isoflop"] = "IsoFLOP optima and LR-vs-compute need budget-labelled runs"
    return tuple(fits), not_fitted


def _print_summary(summary: dict, spec: SweepSpec, out: Path) -> None:
    print(f"sweep '{spec.name}': {summary['trials']} trials in {summary['elapsed_s']:.0f}s")
    for stage in summary["stages"]:
        value = stage["best_value"]
        if value is None:
            print(
                f"  stage {stage['name']:<14} no trial to rank ({counts_text(stage['statuses'])})"
            )
        else:
            print(
                f"  stage {stage['name']:<14} best {spec.metric} {value:.4f} with "
                f"{_params_text(stage['best_params'] or {})}"
            )
        if stage.get("importance"):
            print(f"    {importance_text(stage['importance'])}")
        if kept := stage.get("kept_from"):
            print(
                f"    note: froze nothing; the config from stage '{kept['stage']}' "
                f"({spec.metric} {kept['value']:.4f}) goes on"
            )
        for edge in stage["at_range_edge"]:
            print(f"    note: {edge['note']}")
        if stage.get("not_resolved_from"):
            n = len(stage["not_resolved_from"])
            print(
                f"    note: its seeds cannot tell this best from {n} other "
                f"configuration{'s' * (n != 1)} (the stage table names them)"
            )
    baseline = summary.get("baseline") or {}
    base = baseline.get("value")
    best = (summary.get("best") or {}).get("value")
    if baseline.get("status") in ("diverged", "failed"):
        print(f"  baseline (the unmodified config) {baseline['status']} under the same budget")
    elif base is not None and best is not None and math.isfinite(base):
        from sweeper.report.markdown import gain_text

        gain = gain_text(summary["improvement"])
        print(f"  baseline {spec.metric} {base:.4f} -> best {best:.4f} ({gain})")
    if summary.get("confirmation"):
        from sweeper.sweep.confirm import confirmation_lines

        for line in confirmation_lines(summary["confirmation"], spec.metric):
            print(f"  {line}")
    if summary.get("best"):
        print(f"  reproduce: {reproduce_command(summary['best']['overrides'])}")
    fit = summary.get("fit") or {}
    files = ["reports.csv", *summary["plots"], *(["fit.json"] if fit.get("file") else [])]
    files += fit.get("plots", [])
    first = [summary["report"]] if summary.get("report") else []
    print(f"  outputs: {out}/{', '.join([*first, 'summary.json', *files])}")


def reproduce_command(overrides: list[str]) -> str:
    """The shell line that runs the best config again. Quoted where a shell would read an
    override otherwise: a shard glob (zsh refuses an unmatched one), a path with spaces."""
    return shlex.join(["python", "-m", "sweeper", *overrides])
