"""`python -m sweeper [+sweep=NAME] [key=value ...]`: one training run, or a sweep.

The overrides are composed and checked first (`command.py`: a mistake is one line, exit 2,
nothing written); then Hydra runs the job in its run dir as usual, with the plan (or run
config) that was checked.
"""

from __future__ import annotations

import sys

from sweeper.command import Job, check, check_config, multirun_jobs, print_plans
from sweeper.config.compose import hydra_setting, other_budgets_cleared
from sweeper.config.errors import ConfigError, fail
from sweeper.config.paths import config_dir
from sweeper.rundir import mask_hydra_records, new_default_dir, take_run_dir
from sweeper.signals import (
    end_quietly_when_output_closes,
    skip_the_collection_at_exit,
    stop_on_sigterm_as_on_ctrl_c,
)

MAX_CHECKED_JOBS = 64  # of a multirun, before it starts; the rest as each job starts
CHECKED: dict[str, Job] = {}  # the job checked before Hydra started it (one run, no -m)


def run_job(cfg) -> float | None:
    """Hydra's task function: the run (or sweep) in the Hydra run dir."""
    from hydra.core.hydra_config import HydraConfig

    out_dir = HydraConfig.get().runtime.output_dir
    try:
        job = CHECKED.pop("job", None) or check_config(cfg)  # -m: checked as each job starts
        take_run_dir(out_dir)  # held already, unless a -m job or a dir only Hydra resolves
        mask_hydra_records(out_dir)
    except ConfigError as error:
        fail(str(error))
    if job.plan is not None:
        return run_sweep_job(job, out_dir)
    from sweeper.single_run import run_single, run_user_function

    if job.target:
        return run_user_function(cfg, job.target, out_dir)
    return run_single(cfg, job.run, out_dir)


def run_sweep_job(job: Job, out_dir: str) -> float | None:
    from sweeper.sweep.runner import SweepFailed, run_sweep

    try:
        return run_sweep(job.plan, out_dir)
    except ConfigError as error:  # found inside the job (an unreachable MLflow server)
        fail(str(error))
    except SweepFailed as error:  # not the command's fault: exit 1, not 2
        print(f"error: {error}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)  # the runner said where the state is and how to resume


def hydra_arguments():
    """The command line as Hydra itself reads it (its own parser)."""
    from hydra._internal.utils import get_args_parser

    parser = get_args_parser()
    parser.error = lambda message: fail(f"{message} (python -m sweeper --help)")  # one line
    return parser.parse_args(sys.argv[1:])


def add_cleared_budgets(overrides: list[str]) -> list[str]:
    """`trainer.max_steps=100` means "train 100 steps": the trainer preset's own budget is
    cleared beside it, on Hydra's command line too (right after the user's overrides)."""
    cleared = other_budgets_cleared(overrides)
    if cleared:
        at = sys.argv.index(overrides[-1]) + 1
        sys.argv[at:at] = cleared
    return overrides + cleared


def take_the_run_dir(overrides: list[str], multirun: bool) -> None:
    """This command's dir, for it alone: the one it names, or Hydra's default made here
    (two commands in the same second get two dirs). A -m run's jobs take theirs as each
    starts (run_job)."""
    key, root = ("hydra.sweep.dir", "multirun") if multirun else ("hydra.run.dir", "outputs")
    named = hydra_setting(overrides, key)
    if named is None:
        named = new_default_dir(root)
        sys.argv.append(f"{key}={named}")
    if not multirun and "${" not in str(named):  # `${hydra:...}`: taken as the job starts
        take_run_dir(str(named), key)


def main() -> None:
    skip_the_collection_at_exit()
    stop_on_sigterm_as_on_ctrl_c()
    args = hydra_arguments()
    if args.config_path or args.config_name or args.config_dir or args.experimental_rerun:
        fail(
            "sweeper composes its own conf/; add config files of your own with "
            "hydra.searchpath=[file://DIR] (e.g. DIR/sweep/NAME.yaml for +sweep=NAME)"
        )
    overrides = add_cleared_budgets(list(args.overrides))
    prints = args.help or args.hydra_help or args.info or args.cfg
    if prints or args.shell_completion:  # Hydra's own output: `--help | head` ends quietly
        end_quietly_when_output_closes()
    else:
        try:
            # a multirun's jobs are checked before Hydra makes its multirun dir: the first
            # MAX_CHECKED_JOBS of a large product, the rest as each job starts (run_job)
            jobs = multirun_jobs(overrides) if args.multirun else [overrides]
            checked = [check(job, multirun=args.multirun) for job in jobs[:MAX_CHECKED_JOBS]]
            if any(job.dry_run for job in checked):
                if len(jobs) > MAX_CHECKED_JOBS:
                    raise ConfigError(
                        f"sweep.dry_run=true: {len(jobs)} multirun jobs; plan at most "
                        f"{MAX_CHECKED_JOBS} at once"
                    )
                print_plans(jobs, checked, args.multirun)
                return
        except ConfigError as error:
            fail(str(error))
        if not args.multirun:
            CHECKED["job"] = checked[0]
        take_the_run_dir(overrides, args.multirun)
    import hydra

    hydra.main(config_path=str(config_dir()), config_name="config", version_base="1.3")(run_job)()


if __name__ == "__main__":
    main()
