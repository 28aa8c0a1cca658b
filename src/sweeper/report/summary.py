"""End of a sweep: the stage tables, summary.json, reports.csv, plots, the fit, report.md."""

from __future__ import annotations

import csv
import io
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from sweeper.config.schema import RUN_SECTIONS, RunConfig
from sweeper.config.sweep import SweepSpec, flatten
from sweeper.files import write_json_atomic, write_text_atomic
from sweeper.report.fit import fit_sweep
from sweeper.report.importance import importance_text, stage_importance
from sweeper.report.markdown import counts_text, gain_text, ranked, write_report
from sweeper.report.plots import plot_learning_curves, plot_stage_lr
from sweeper.sweep.baseline import RUN_TIMES
from sweeper.sweep.confirm import confirmation_lines, confirmation_summary
from sweeper.sweep.extend import range_edges, search_ranges, searched_params
from sweeper.sweep.plan import SweepPlan
from sweeper.sweep.results import REPORT_COLUMNS
from sweeper.sweep.stages import (
    SEED_KEY,
    get_dotted,
    reproduce_command,
    reproduce_overrides,
    unresolved_rivals,
)
from sweeper.sweep.state import SweepState
from sweeper.sweep.trainable import RUNG_METRIC
from sweeper.text import hydra_value, rounded_text


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
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, columns, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(reports)
    write_text_atomic(path, text.getvalue())


def seed_note(best: dict, records: list[dict], final: dict) -> dict:
    """For a best ranked by its mean over seeds (a grid with trainer.seed as an axis): the
    seeds, and what its overrides give. They freeze no seed, so they train the one the
    config holds: its own value, not the mean summary.json's `value` is."""
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


def write_all(out: Path, plan: SweepPlan, state: SweepState) -> dict:
    """summary.json, reports.csv, the plots, the fit and report.md/.html of a sweep in its
    run dir `out`, from its state; prints the summary and returns it."""
    spec, base, target = plan.spec, plan.base, plan.target
    records, reports = state.all_records(), state.all_reports()
    write_reports_csv(out / "reports.csv", reports, spec.metric)
    stages, starts = [], stage_starts(state, base)
    for stage, start in zip(state.stages, starts, strict=True):
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
                    plan, stage["name"], start, best, stage.get("extended")
                ),
                **({"extended": stage["extended"]} if stage.get("extended") else {}),
            }
        )
        searched = searched_params(plan, stage["name"], start, stage.get("extended"))
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
        "confirmation": confirmation_summary(plan, state),
        "trials": len(records),
        "total_flops": state.total_flops(),
        "elapsed_s": state.elapsed,
    }
    if carried and "seeds" in carried:
        summary["best"].update(seed_note(carried, records, final))
    plots = [plot_learning_curves(out / "learning_curves.png", reports, spec.metric)]
    for stage, start in zip(state.stages, starts, strict=True):
        name = stage["name"]
        ranges = search_ranges(plan, name, start, stage.get("extended"))
        plots.append(
            plot_stage_lr(
                out / f"stage_{name}.png",
                stage["records"],
                spec,
                stage["best"],
                ranges,
                stage.get("extended"),
                stage["reports"],
            )
        )
    summary["plots"] = [p.name for p in plots if p]
    summary["fit"] = fit_sweep(out, reports, plan)
    try:
        summary["report"] = write_report(out, summary, plan, state).name
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
    started = {k: get_dotted(start, k) for k in best["params"]}
    return (
        f"its best {spec.metric} {best['metric']:.4f} ({_params_text(best['params'])}) is "
        f"worse than the {incumbent['metric']:.4f} of the config it started from "
        f"({_params_text(started)}, stage '{incumbent['stage']}'): that config is kept"
    )


def _overrides(final: dict, reproduce, target: str | None = None) -> list[str]:
    """The overrides that give `python -m sweeper` the config `final`; for a user's
    function, that runs it once (`trainable._target_` first), its own sections added."""
    if not target:
        return reproduce(final)
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


def status_tally(records: list[dict]) -> dict[str, int]:
    """status -> how many of `records` ended so (counts_text words it)."""
    return dict(Counter(r["status"] for r in records))


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
        gain = gain_text(summary["improvement"])
        print(f"  baseline {spec.metric} {base:.4f} -> best {best:.4f} ({gain})")
    if summary.get("confirmation"):
        for line in confirmation_lines(summary["confirmation"], spec.metric):
            print(f"  {line}")
    if summary.get("best"):
        print(f"  reproduce: {reproduce_command(summary['best']['overrides'])}")
    fit = summary.get("fit") or {}
    files = ["reports.csv", *summary["plots"], *(["fit.json"] if fit.get("file") else [])]
    files += fit.get("plots", [])
    first = [summary["report"]] if summary.get("report") else []
    print(f"  outputs: {out}/{', '.join([*first, 'summary.json', *files])}")
