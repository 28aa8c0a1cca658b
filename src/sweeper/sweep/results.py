"""Turn Ray Tune's ResultGrid into plain trial records and per-report rows."""

from __future__ import annotations

import math
import re
from typing import Any

from sweeper.sweep.space import to_builtin
from sweeper.sweep.stages import finite_number
from sweeper.sweep.trainable import (
    REPORT_COLUMNS,
    RUNG_METRIC,
    MissingMetricError,
    TrialContext,
    reported_keys,
    trial_config,
)

# a Python exception line ("ValueError: ...", "ray.exceptions.RayTaskError(...): ...")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b\S*:")


def error_summary(text: str) -> str:
    """One line for a failed trial's error (Tune's error.txt, or str(result.error)): the
    last exception line of a traceback, else the first line of the message, e.g. Ray's
    "2 worker(s) were killed due to the node running low on memory ..." for an OOM kill."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    lines = [line for line in lines if not line.startswith("Failure # ")]
    exceptions = [line for line in lines if _EXCEPTION_LINE.match(line)]
    line = exceptions[-1] if exceptions else (lines[0] if lines else "unknown error")
    return re.sub(r" \(IP: [^)]*\)", "", line)  # the node's address and id: noise here


def trial_status(metrics: dict, error: Any, can_prune: bool = True) -> str:
    """completed | pruned | diverged | failed, from the trial's last report. sweeper's
    own training reports its status; a user's function that reports none counts as
    completed when it ended (Ray's `done`; one a scheduler stopped before its budget was
    marked pruned as it happened, by callbacks.MarksStopped) or when nothing could stop it."""
    if error is not None:
        return "failed"
    status = metrics.get("status")
    if status in ("completed", "diverged"):
        return status
    if status is None and (metrics.get("done") or not can_prune):
        return "completed"
    return "pruned"  # stopped by the scheduler (or a cap) before its budget


def users_figures(rows: list[dict], metric: str) -> list[str]:
    """What a user's function reported besides the columns every report has (its `loss`,
    its own counters): reports.csv keeps them too. Tune's flattened config ("config/...")
    is not a report's."""
    known = {*REPORT_COLUMNS, metric, RUNG_METRIC, "fork_flops", "reused_from"}
    return sorted(
        {k for row in rows for k in reported_keys(row) if "/" not in k and k not in known}
    )


def last_attempt(rows: list[dict]) -> list[dict]:
    """A trial's reports, each once: those a restart trained again replace the earlier
    ones. A trial restarted without a checkpoint (a user's function retried after a
    failure, or resumed by Hyperband) reports again from its first report, one restarted
    from an older checkpoint from there; Tune counts its iterations from there again, and
    keeps every attempt's reports."""
    kept: list[dict] = []
    for row in rows:
        count = row.get("training_iteration")
        while kept and count is not None and (kept[-1].get("training_iteration") or 0) >= count:
            kept.pop()
        kept.append(row)
    return kept


def collect_results(
    results, stage: str, metric: str, base: dict, ctx: TrialContext, can_prune: bool = True
):
    records, reports = [], []
    for result in results:
        metrics = to_builtin(dict(result.metrics or {}))
        params = to_builtin(dict(result.config or {}))
        trial_id = metrics.get("trial_id") or str(result.path).rsplit("/", 1)[-1]
        status = trial_status(metrics, result.error, can_prune)
        effective = trial_config(params, base, ctx)
        trainer_cfg = effective.get("trainer", {})
        value = metrics.get(metric)
        if result.error:  # a report without the metric where every report is ranked, or none
            instead = MissingMetricError.keys_in(str(result.error))
        else:  # only keys Tune adds (reported_keys: []): stopped before a report
            instead = None if metric in metrics else reported_keys(metrics) or None
        records.append(
            {
                "trial_id": trial_id,
                "stage": stage,
                "status": status,
                "params": params,
                "metric": value if finite_number(value) else None,
                "tokens": metrics.get("tokens"),
                "flops": metrics.get("flops"),
                "fork_flops": metrics.get("fork_flops"),  # rung cooldown forks' training
                "batch_size": trainer_cfg.get("total_batch_size"),
                "lr": metrics.get("lr"),
                "error": error_summary(str(result.error)) if result.error else None,
                "reason": metrics.get("reason") if status == "diverged" else None,
                "path": str(result.path),
                # "stage/trial_id" of the run it repeats, replayed rather than trained
                # (runner.reusable_run): its FLOPs were spent once, there
                **({"reused_from": metrics["reused_from"]} if "reused_from" in metrics else {}),
                # a trial that reported, but never the metric (or, where every report is
                # ranked, once without it): what it did report (one a cap stopped before
                # its first report holds only the keys Tune adds)
                **({"reported": instead} if instead is not None else {}),
            }
        )
        optimizer_cfg = effective.get("optimizer", {})
        peak_lr = optimizer_cfg.get("lr" if optimizer_cfg.get("name") == "adamw" else "matrix_lr")
        frame = result.metrics_dataframe
        if frame is None:
            continue
        rows = last_attempt(frame.to_dict("records"))
        own = users_figures(rows, metric) if ctx.target else []
        for i, row in enumerate(rows):
            # the end of a run that trained its whole budget: what the scaling fits read as
            # a run of that many tokens. A stopped trial's last value is from before its
            # LR decayed (wsd), or a diverged or failed one's from a broken run.
            whole = i == len(rows) - 1 and status == "completed"
            reports.append(
                to_builtin(
                    {
                        "trial_id": trial_id,
                        "stage": stage,
                        "status": status,
                        **{c: row.get(c) for c in REPORT_COLUMNS},
                        metric: row.get(metric),
                        # what the scheduler ranked where the sweep forks trials at rungs,
                        # and the forks' training FLOPs so far
                        **{k: row[k] for k in (RUNG_METRIC, "fork_flops") if k in row},
                        "total_batch_size": trainer_cfg.get("total_batch_size"),
                        "peak_lr": peak_lr,
                        # the compute budget of an IsoFLOP grid point, on final reports only
                        "budget": trainer_cfg.get("budget_flops") if whole else None,
                        "final": whole,
                        # runs that differ only in it are averaged by the fits
                        "seed": trainer_cfg.get("seed"),
                        **({"reused_from": row["reused_from"]} if row.get("reused_from") else {}),
                        **{k: row.get(k) for k in own},
                    }
                )
            )
    return records, _clean(reports)


def _clean(rows: list[dict]) -> list[dict]:
    """NaN -> None, so the JSON state file stays valid JSON."""
    for row in rows:
        for key, value in row.items():
            if isinstance(value, float) and not math.isfinite(value):
                row[key] = None
    return rows
