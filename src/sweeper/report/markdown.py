"""report.md and report.html: a finished sweep on one page, its plots beside its numbers.

Everything on the page is also in summary.json, fit.json and the tables the sweep printed;
the page puts it in the order a reader asks (what won, by how much, how to run it again,
what each stage tried) and shows the PNGs inline. Markdown, because it renders where people
share results (GitHub, editors, notebooks) and diffs as text; it lies in the run dir beside
the images it links. The same page as HTML with the images inside it (data URIs) is what
the MLflow UI can show: it renders an HTML artifact, where a Markdown one is plain text and
a relative image link leads nowhere.
"""

from __future__ import annotations

import base64
import datetime
import html
import json
import math
import re
from pathlib import Path

from sweeper.config.sweep import SweepSpec, flatten
from sweeper.files import write_text_atomic
from sweeper.report.importance import importance_text
from sweeper.sweep.confirm import confirmation_lines
from sweeper.sweep.plan import SweepPlan
from sweeper.sweep.stages import reproduce_command
from sweeper.sweep.state import SweepState
from sweeper.text import duration_text, flops_text, mask_secrets, rounded_text

REPORT_NAME = "report.md"
HTML_NAME = "report.html"
STYLE = """
body { font-family: system-ui, sans-serif; max-width: 72rem; margin: 2rem auto; padding: 0 1rem;
       line-height: 1.45; color: #222; }
table { border-collapse: collapse; margin: 0.5rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.2rem 0.6rem; }
pre { background: #f4f4f4; padding: 0.6rem; overflow-x: auto; white-space: pre-wrap; }
img { max-width: 100%; }
"""


def write_report(out: Path, summary: dict, plan: SweepPlan, state: SweepState) -> Path:
    """Write report.md (and report.html) into the run dir `out`, whole or not at all."""
    path = out / REPORT_NAME
    page = mask_secrets(render_report(summary, plan, state, out))
    write_text_atomic(path, page)
    write_text_atomic(out / HTML_NAME, as_html(page, out, plan.spec.name))
    return path


def as_html(page: str, out: Path, title: str) -> str:
    """The Markdown page as one HTML file: each image that lies in `out` embedded in it."""
    import markdown

    body = markdown.markdown(page, extensions=["tables", "fenced_code"])

    def embedded(match: re.Match) -> str:
        image = out / html.unescape(match.group(2))
        if image.suffix != ".png" or image.parent != out or not image.is_file():
            return match.group(0)
        data = base64.b64encode(image.read_bytes()).decode("ascii")
        return f'{match.group(1)}"data:image/png;base64,{data}"'

    body = re.sub(r'(<img[^>]*\bsrc=)"([^"]+)"', embedded, body)
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8">'
        f"<title>sweep {html.escape(title)}</title><style>{STYLE}</style></head>\n"
        f"<body>\n{body}\n</body></html>\n"
    )


def render_report(summary: dict, plan: SweepPlan, state: SweepState, out: Path) -> str:
    spec, base = plan.spec, plan.base
    metric = spec.metric
    lines = [f"# Sweep `{spec.name}`", "", *_outcome(summary, metric), ""]
    lines.append(
        f"{summary['trials']} trial{'s' * (summary['trials'] != 1)} in "
        f"{duration_text(summary['elapsed_s'])}, {flops_text(summary['total_flops'])} training FLOPs; "
        f"written {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}."
    )
    if launched := launch_overrides(out, state):
        lines += ["", f"Launched with `{reproduce_command(launched)}`."]
    final = state.stages[-1]["base_after"] if state.stages else base
    tuned = {k for stage in summary["stages"] for k in stage["params"]} | set(spec.lr_keys)
    if changed := changes_table(base, final, tuned):
        lines += ["", "What the sweep changed:", "", *changed]
    if summary.get("best"):
        lines += ["", "Run the best config again:", "", "```"]
        lines += [reproduce_command(summary["best"]["overrides"]), "```"]
    if summary.get("confirmation"):
        lines += ["", "On fresh seeds:", ""]
        lines += [f"- {line}" for line in confirmation_lines(summary["confirmation"], metric)]
    plots = set(summary.get("plots") or [])  # the ones drawn this time
    for number, (stage, recorded) in enumerate(zip(summary["stages"], state.stages), 1):
        lines += ["", *_stage_section(number, stage, recorded, spec, plots)]
    if "learning_curves.png" in plots:
        lines += ["", "## Learning curves", ""]
        lines.append("![every trial's learning curve](learning_curves.png)")
    lines += _fit_section(summary.get("fit") or {}, out)
    return "\n".join(lines) + "\n"


def _outcome(summary: dict, metric: str) -> list[str]:
    """The page's first sentence: the best value against the unmodified config's."""
    best = (summary.get("best") or {}).get("value")
    baseline = summary.get("baseline") or {}
    if best is None:
        return ["No trial finished with a value to rank."]
    text = f"**Best {metric} {best:.4f}**"
    base = baseline.get("value")
    if baseline.get("status") in ("diverged", "failed"):
        return [f"{text}; the unmodified config {baseline['status']} under the same budget."]
    if base is None or not math.isfinite(base):
        return [f"{text}."]
    verdict = gain_text(summary["improvement"])
    return [
        f"{text} against {base:.4f} for the unmodified config under the same budget: {verdict}."
    ]


def gain_text(gain: float) -> str:
    """The best's improvement over the unmodified config, as the console and report.md
    word it: "+0.0234 better", "0.3124 worse: ...", or the same where 4 decimals show none."""
    if abs(gain) < 5e-5:
        return "the same to 4 decimals: the sweep found nothing better"
    if gain > 0:
        return f"+{gain:.4f} better"
    return f"{-gain:.4f} worse: the unmodified config did better"


def _stage_section(
    number: int, stage: dict, recorded: dict, spec: SweepSpec, plots: set[str]
) -> list[str]:
    stage_spec = next(s for s in spec.stages if s.name == stage["name"])
    search, scheduler = stage_spec.search, stage_spec.scheduler
    statuses = counts_text(stage["statuses"])
    lines = [f"## Stage {number}: `{stage['name']}`", ""]
    lines.append(f"{search} search, {scheduler} scheduler; {stage['trials']} trials ({statuses}).")
    if stage["best_value"] is not None:
        chosen = ", ".join(
            f"`{k}={rounded_text(v)}`" for k, v in sorted((stage["best_params"] or {}).items())
        )
        lines.append(f"Best {spec.metric} {stage['best_value']:.4f} with {chosen}.")
    notes = []
    if stage.get("importance"):
        notes.append(importance_text(stage["importance"]))
    if kept := stage.get("kept_from"):
        notes.append(
            f"froze nothing: the config from stage `{kept['stage']}` "
            f"({spec.metric} {kept['value']:.4f}) goes on"
        )
    notes += [edge["note"] for edge in stage["at_range_edge"]]
    if rivals := stage.get("not_resolved_from"):
        notes.append(f"its seeds cannot tell this best from {len(rivals)} other configuration(s)")
    if notes:
        lines += ["", *(f"- {note}" for note in notes)]
    lines += ["", *trial_table(recorded["records"], recorded["best"], spec)]
    if f"stage_{stage['name']}.png" in plots:
        lines += ["", f"![stage {stage['name']}](stage_{stage['name']}.png)"]
    return lines


def counts_text(statuses: dict[str, int]) -> str:
    """'2 diverged, 1 pruned': how a set of trials ended (`summary.status_tally`'s tally)."""
    return ", ".join(f"{n} {status}" for status, n in sorted(statuses.items()))


def ranked(record: dict) -> bool:
    """False where the value is the searcher's penalty (diverged, failed), not a measurement."""
    return record["metric"] is not None and record["status"] not in ("diverged", "failed")


def trial_table(records: list[dict], best: dict | None, spec: SweepSpec) -> list[str]:
    """The stage's trials as a Markdown table, best first; an unranked trial shows no value."""
    keys = sorted({k for r in records for k in r["params"]})
    best_ids = set(best.get("trial_ids", [best["trial_id"]])) if best else set()

    def rank(record: dict) -> tuple:  # unranked trials last, in their order
        if not ranked(record):
            return (True, 0.0)
        return (False, record["metric"] if spec.mode == "min" else -record["metric"])

    rows = [
        f"| {spec.metric} | status | tokens | " + " | ".join(f"`{k}`" for k in keys) + " |",
        "| ---: | --- | ---: |" + " ---: |" * len(keys),
    ]
    for record in sorted(records, key=rank):
        value = f"{record['metric']:.4f}" if ranked(record) else "-"
        if record["trial_id"] in best_ids:
            value = f"**{value}**"
        status = record["status"]
        if record.get("reused_from"):
            status += f" (replays {record['reused_from']})"
        tokens = record.get("tokens")
        cells = [value, status, f"{tokens:,.0f}" if tokens else "-"]
        cells += [rounded_text(record["params"].get(k)) for k in keys]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def changes_table(base: dict, final: dict, keys: set[str]) -> list[str]:
    """Of `keys` (what the stages searched, and the LRs a batch-size rule may move), those
    whose value differs between the config the sweep started with and the one it ends with.
    Other differences are the trials' placement (device, threads), not hyperparameters."""
    before, after = flatten(base), flatten(final)
    changed = sorted(k for k in keys if k in after and before.get(k) != after[k])
    if not changed:
        return []
    rows = ["| key | started at | ends at |", "| --- | ---: | ---: |"]
    rows += [
        f"| `{k}` | {rounded_text(before.get(k))} | {rounded_text(after[k])} |" for k in changed
    ]
    return rows


def _fit_section(fit: dict, out: Path) -> list[str]:
    """Loss against compute: the fit's own summary (sweeper.scaling.summary) and its plots."""
    if fit.get("error"):
        return ["", "## Loss against compute", "", f"No fit: {fit['error']}."]
    if not fit.get("file") or not (out / fit["file"]).exists():
        return []
    from sweeper.scaling.summary import format_summary

    result = json.loads((out / fit["file"]).read_text())
    lines = ["", "## Loss against compute", "", "```", format_summary(result), "```"]
    if result.get("predicted_run"):
        lines += ["", f"The run at C = {result['target_flops']:.3g} FLOPs the laws predict:"]
        lines += ["", "```", reproduce_command(result["predicted_run"]), "```"]
    for name in fit.get("plots", []):
        lines += ["", f"![{Path(name).stem}]({name})"]
    return lines


def launch_overrides(out: Path, state: SweepState) -> list[str] | None:
    """The overrides the sweep was started with: kept in its state when it started, as
    Hydra's record in the run dir is the last command's (a resume's). A state from before
    they were kept: that record, less the resume."""
    if state.launched is not None:
        return state.launched
    overrides = command_overrides(out)
    return [o for o in overrides if not o.startswith("sweep.resume=")] if overrides else None


def command_overrides(out: Path) -> list[str] | None:
    """The command line's overrides, from Hydra's record of them in the run dir."""
    path = out / ".hydra" / "overrides.yaml"
    if not path.exists():
        return None
    from omegaconf import OmegaConf

    return [mask_secrets(str(o)) for o in OmegaConf.load(path)]
