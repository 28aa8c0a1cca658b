"""`python -m sweeper.fit PATH`: fit scaling laws to a CSV or to a finished sweep.

The work is done by sweeper.scaling; this module only parses arguments, reads the input,
writes fit.json / PNGs and prints. Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from sweeper.config.errors import OneLineParser
from sweeper.files import write_json_atomic
from sweeper.scaling.records import SWEEP_COLUMNS, InputError, read_csv_records
from sweeper.signals import end_quietly_when_output_closes

MIN_ROWS = 3
INPUT_KEY = "_input"  # which PATH a record came from (1, 2, ...)
# record field -> its --<flag>-col option
COLUMN_FLAGS = (
    ("N", "n"),
    ("D", "d"),
    ("C", "c"),
    ("loss", "loss"),
    ("budget", "budget"),
    ("seed", "seed"),
)

DESCRIPTION = """\
Fit scaling laws: the compute frontier L(C) = E + A C^-alpha, the parametric law
L(N, D) = E + A/N^alpha + B/D^beta, IsoFLOP optima N_opt ~ C^a, D_opt ~ C^b, and optimal
learning rate / batch size vs compute -- whichever the data allow.

PATH is a CSV file, or a finished sweep's directory (its reports.csv is read: params -> N,
tokens -> D, flops -> C, val_bpb -> loss). Several PATHs are fitted as one set of runs: the
same sweep on other seeds (trainer.seed=1), say, whose runs then average per point.

CSV columns are detected case-insensitively
(N: n, params, parameters, "model size", num_params; D: d, tokens, "training tokens";
C: c, flops, "training flop", compute; loss: loss, val_loss, val_bpb; budget: budget,
flops_budget; also lr, batch_size, final, seed). With N and C only, D = C/(6N); with N and D,
C = 6ND. Rows that differ only in their seed are fitted as their mean.

Output: fit.json and PNG plots in --out (default: the sweep directory, or ./<csv-name>-fit/
in the current directory for a CSV, or ./combined-fit/ for several PATHs; a default dir
there that holds the fit of other inputs is kept, not overwritten), and a summary (or the
JSON, with --json) on stdout."""


def _at_least_zero(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # argparse would name this function in its message
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, got {text}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _above_zero(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan  # refused below, in the same words
    if not 0 < value < math.inf:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="python -m sweeper.fit",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "paths", metavar="PATH", nargs="+", help="CSV file or sweep directory (or several)"
    )
    for fld, flag in COLUMN_FLAGS:
        p.add_argument(
            f"--{flag}-col",
            dest=f"col_{fld}",
            metavar="NAME",
            help=f"column holding {fld} (default: auto-detected)",
        )
    p.add_argument(
        "--drop-highest",
        type=_at_least_zero,
        default=0,
        metavar="K",
        help="drop the K rows with the highest loss first (default 0)",
    )
    p.add_argument(
        "--target-flops",
        type=_above_zero,
        metavar="X",
        help="predict loss and compute-optimal N, D (and lr) at X FLOPs (default for a "
        "sweep's directory: the sweep's fit.target_flops)",
    )
    p.add_argument(
        "--bootstrap",
        type=_at_least_zero,
        metavar="K",
        help="bootstrap replicates for 95%% CIs (e.g. 1000; default for a sweep's directory: "
        "the sweep's fit.bootstrap, as its own fit had; else 0 = none)",
    )
    p.add_argument("--seed", type=_at_least_zero, default=0, help="bootstrap seed (default 0)")
    p.add_argument(
        "--grid",
        choices=("full", "small"),
        default="full",
        help="start grid of the parametric fit (default full: 4500 starts)",
    )
    p.add_argument("--out", type=Path, metavar="DIR", help="output directory (see above)")
    p.add_argument("--json", action="store_true", help="print the fit.json content to stdout")
    p.add_argument("--no-plots", action="store_true", help="do not write PNG plots")
    p.add_argument(
        "--params-convention",
        choices=("total", "non_embedding", "matmul"),
        default="total",
        help="what the data's N counts, written into fit.json; it converts nothing "
        "(default total, what a sweep's run dir holds)",
    )
    p.add_argument(
        "--flops-convention",
        choices=("6ND", "per_token_with_attention", "given"),
        help="how the data's C was computed, written into fit.json; it converts nothing "
        "(default: per_token_with_attention for a sweep's run dir; given if other data "
        "have a compute column, else 6ND)",
    )
    p.add_argument(
        "--loss-unit",
        metavar="UNIT",
        help="unit of the loss column (default: a sweep's metric for its run dir; bpb if "
        "the column's name says so, else nats)",
    )
    return p


def load_records(args) -> tuple[list[dict], Path, dict, dict | None]:
    """Records, output directory, conventions, and the first sweep directory's config
    (`sweep_config`) for the parsed arguments. Several paths must agree on what their
    columns hold; their records are fitted as one set."""
    explicit = {fld: getattr(args, f"col_{fld}") for fld, _ in COLUMN_FLAGS}
    records, sweep = [], None
    first: tuple[Path, tuple] | None = None  # the first path, and what its columns hold
    seen: dict[Path, Path] = {}
    for path in map(Path, args.paths):
        if path.resolve() in seen:  # its runs would count twice, as if on other seeds
            before = seen[path.resolve()]
            also = "" if str(before) == str(path) else f" (as {before} too)"
            raise InputError(f"{path} is given twice{also}: its runs would count twice")
        seen[path.resolve()] = path
        if path.is_dir():
            csv_path, preferred, out = path / "reports.csv", SWEEP_COLUMNS, path
            if not csv_path.is_file():
                raise InputError(f"{path} is a directory without reports.csv")
        elif path.is_file():
            csv_path, preferred, out = path, None, Path.cwd() / f"{path.stem}-fit"
        else:
            raise InputError(f"{path}: no such file or directory")
        rows, columns = read_csv_records(csv_path, explicit, preferred, return_columns=True)
        config = sweep_config(path) if path.is_dir() else None
        if "seed" not in columns and config is not None:
            # a sweep from before reports.csv had a seed column ran every trial on one
            seed = config["base"].get("trainer", {}).get("seed")
            rows = [{**r, "seed": float(seed)} for r in rows] if seed is not None else rows
        held = (sorted(set(columns) - {"seed"}), _conventions(args, columns, path.is_dir()))
        if first is None:
            first, default_out, sweep = (path, held), out, config
        elif held != first[1]:
            raise InputError(
                f"{path} holds other columns than {first[0]} "
                f"({', '.join(held[0])} as {_words(held[1])} against {', '.join(first[1][0])} "
                f"as {_words(first[1][1])}): fit them separately"
            )
        elif sweep is None:
            sweep = config
        records += [{**r, INPUT_KEY: len(seen)} for r in rows]
    if args.drop_highest:
        finite = sorted(
            (r for r in records if r["loss"] == r["loss"]), key=lambda r: r["loss"], reverse=True
        )
        dropped = {id(r) for r in finite[: args.drop_highest]}
        records = [r for r in records if id(r) not in dropped]
    usable = sum(1 for r in records if r["loss"] == r["loss"] and r["loss"] > 0)
    if usable < MIN_ROWS:
        named = csv_path if len(args.paths) == 1 else f"{len(args.paths)} inputs"
        raise InputError(
            f"{named}: {usable} usable row(s) of {len(records)}, with a loss that is a number "
            f"> 0; need >= {MIN_ROWS}"
        )
    if len(args.paths) > 1:
        default_out = Path.cwd() / "combined-fit"
    return records, args.out or default_out, first[1][1], sweep


def _words(conventions: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in conventions.items())


def _conventions(args, columns: dict, sweep_dir: bool) -> dict:
    """As the flags say, else as the data are: a sweep's reports.csv has its model's
    FLOPs per token, attention included, and its loss column is the sweep's metric, which
    the fit a sweep writes names them (so a refit labels them the same)."""
    if sweep_dir:
        flops, unit = "per_token_with_attention", columns["loss"]
        # the flags name what a file's columns hold; they convert nothing, and a sweep's
        # reports.csv holds total params and FLOPs per token with attention
        for flag, given, held in (
            ("--params-convention", args.params_convention, "total"),
            ("--flops-convention", args.flops_convention, flops),
        ):
            if given not in (None, held):
                raise InputError(
                    f"{flag} {given}: a sweep's run dir holds {held} (the flag names what "
                    "a CSV's columns hold; it converts nothing)"
                )
    else:
        flops = "given" if "C" in columns else "6ND"
        unit = "bpb" if "bpb" in columns["loss"].lower() else "nats"
    return {
        "params": args.params_convention,
        "flops": args.flops_convention or flops,
        "loss_unit": args.loss_unit or unit,
    }


def repeated_across_inputs(records: list[dict]) -> int:
    """Final runs whose point (N, D, C, LR, batch size, budget) and seed another input
    holds too: two sweeps of the same grid on one seed, say, which the seeds' average
    would not see (`records.average_seeds` takes a seed's lowest)."""
    inputs: dict[tuple, set] = {}
    for r in records:
        if r.get("final") is False:  # read_csv_records made it a bool (None: unknown)
            continue
        key = tuple(str(r.get(k)) for k in ("N", "D", "C", "lr", "batch_size", "budget", "seed"))
        inputs.setdefault(key, set()).add(r[INPUT_KEY])
    return sum(len(held) - 1 for held in inputs.values() if len(held) > 1)


def sweep_config(path: Path) -> dict | None:
    """For a sweep's run dir: its fit.target_flops and its trials' base config, composed
    again from the overrides Hydra kept (.hydra/overrides.yaml), so that a refit predicts
    where the sweep's own fit did and can name the run there. None where the directory
    has no such file, the sweep swept a user's function, or the overrides no longer
    compose (a config dir of the user's that is gone)."""
    overrides_file = path / ".hydra" / "overrides.yaml"
    if not overrides_file.is_file():
        return None
    try:
        from omegaconf import OmegaConf

        from sweeper.config.compose import compose
        from sweeper.sweep.preflight import build_plan

        kept = [str(o) for o in OmegaConf.load(overrides_file) if not str(o).startswith("hydra.")]
        cfg = compose(kept)
        if "sweep" not in cfg:
            return None
        plan = build_plan(cfg)
        if plan.target:
            return None
        return {
            "target_flops": plan.fit.get("target_flops"),
            "bootstrap": plan.fit.get("bootstrap"),
            "base": plan.base,
        }
    except Exception:  # the refit stands without it
        return None


def run(args) -> int:
    from sweeper.scaling.analysis import fit_all
    from sweeper.scaling.summary import format_summary

    records, out_dir, conventions, sweep = load_records(args)
    inputs = sorted(str(Path(p).resolve()) for p in args.paths)
    in_place = len(args.paths) == 1 and Path(args.paths[0]).is_dir()
    if not (in_place and out_dir.resolve() == Path(args.paths[0]).resolve()):
        check_out_dir(out_dir, inputs)  # before the fit's work: it would not be written
    target = args.target_flops or (sweep or {}).get("target_flops")
    bootstrap = args.bootstrap
    if bootstrap is None:
        bootstrap = int((sweep or {}).get("bootstrap") or 0)
    repeated = repeated_across_inputs(records)
    result = fit_all(
        records,
        target_flops=target,
        bootstrap=bootstrap,
        seed=args.seed,
        conventions=conventions,
        grid=args.grid,
    )
    if repeated:
        result["warnings"].insert(
            0,
            f"{repeated} final run(s) appear in more than one input on the same seed (the same "
            "point trained twice?): each point takes its lowest loss, as if one run",
        )
    if not any(result[k] for k in ("frontier", "parametric", "isoflop", "hparams")):
        raise InputError("no fit could be made: " + "; ".join(result["warnings"]))
    if sweep:
        from sweeper.report.fit import predicted_run

        result["predicted_run"] = predicted_run(result, sweep["base"], records)
    result["inputs"] = inputs
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise InputError(f"--out {out_dir}: {error.strerror or error}") from None
    write_json_atomic(out_dir / "fit.json", result, allow_nan=False)
    written = [out_dir / "fit.json"]
    if not args.no_plots:
        from sweeper.scaling.plots import plot_all

        try:
            written += plot_all(result, records, out_dir)
        except Exception as exc:  # a plot is never worth losing the fit over
            print(f"warning: plotting failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=2, allow_nan=False))
    else:
        print(format_summary(result))
        if result.get("predicted_run"):
            from sweeper.report.fit import predicted_run_note
            from sweeper.sweep.stages import reproduce_command

            print(f"Run it at C = {result['target_flops']:.3g} FLOPs:")
            print(f"  {reproduce_command(result['predicted_run'])}")
            if note := predicted_run_note(result, records):
                print(f"  {note}")
        print("Wrote " + ", ".join(p.name for p in written) + f" to {out_dir}")
    return 0


def check_out_dir(out_dir: Path, inputs: list[str]) -> None:
    """A fit's output dir that holds the fit of other inputs is kept, not overwritten:
    the default in the current directory (./combined-fit, ./<csv-name>-fit) is shared by
    every fit made from there, and a `--out` can name another sweep's dir (its report.md
    reads its own fit.json). A fit of the same inputs is simply made again, as is a sweep
    dir's own fit in place."""
    try:
        earlier = json.loads((out_dir / "fit.json").read_text()).get("inputs")
    except (OSError, ValueError, AttributeError):
        return  # no fit there (or none readable as one): nothing to lose
    if earlier == inputs:
        return
    held = ", ".join(earlier) if isinstance(earlier, list) else "inputs it does not name"
    if earlier is None and (out_dir / "summary.json").exists():
        held = "the sweep there"  # a sweep writes its own fit without naming inputs
    raise InputError(
        f"{out_dir} holds the fit of other inputs ({held}): "
        "name another directory with --out DIR, or remove it"
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # safe here: the fit's files are written before its summary is printed
    end_quietly_when_output_closes()
    try:
        return run(args)
    except InputError as exc:
        msg = str(exc)
    except OSError as exc:
        msg = f"{exc.filename or ''}: {exc.strerror or exc}".lstrip(": ")
    except Exception as exc:  # no tracebacks for whatever odd input gets through
        msg = f"unexpected failure: {type(exc).__name__}: {exc}"
    print(f"error: {' '.join(msg.split())}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
