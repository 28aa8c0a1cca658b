"""`sweep.dry_run=true`: a sweep's plan, printed from the command line with nothing started."""

import math
import re
from pathlib import Path

import pytest

from sweeper.config.compose import compose
from sweeper.config.schema import load_run_config
from sweeper.sweep.estimate import (
    STAGE_START_S,
    Speed,
    estimates_left,
    evaluating_once,
    fraction_text,
    makespan,
    measure_speed,
    opening_line,
    plan_seconds,
    run_cost,
    stage_estimates,
    sweep_totals,
)
from sweeper.sweep.preflight import build_plan
from sweeper.sweep.stage import budget_text
from sweeper.sweep.stages import sweep_run
from sweeper.sweep.state import SweepState
from sweeper.text import flops_text
from sweeper.train.budget import model_counts, planned_flops

from .conftest import REPO, run_cli, run_main

PLAN = ["sweep.dry_run=true", "mlflow.enabled=false"]


def files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_the_plan_of_lr_bs_counts_its_trials_and_flops_and_nothing_is_written(tmp_path):
    proc = run_main(["+sweep=lr_bs", "ray.num_cpus=4", *PLAN], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    # what the trials would train, from the model's shape and the budget
    cfg = compose(["+sweep=lr_bs"])
    plan = build_plan(cfg)
    spec = plan.spec
    _, per_token = model_counts(load_run_config(cfg))
    batch = cfg.trainer.total_batch_size
    trial = math.ceil(spec.budget.tokens_per_trial / batch) * batch * per_token
    assert f"each trial trains {spec.budget.tokens_per_trial:,.0f} tokens" in out
    assert f"tpe search, asha scheduler: 8 trials of {flops_text(trial)} FLOPs" in out
    assert f"grid search, fifo scheduler: 3 trials of {flops_text(trial)} FLOPs" in out
    assert "trainer.total_batch_size grid [4096, 8192, 16384]" in out
    assert "optimizer.matrix_lr log_uniform [0.004, 0.1]" in out
    assert "LRs follow the batch size by sqrt(B / B0)" in out
    rungs = plan.rung_fractions(spec.stages[0])
    assert f"asha may stop a trial at {', '.join(map(fraction_text, rungs))} of" in out
    # every LR trial to its end with a fork at each rung, the batch grid, the baseline
    forks = 1 + spec.rung_cooldown * sum(rungs)
    most = (8 * forks + 3 + 1) * trial
    assert f"at most 12 runs (with the baseline), {flops_text(most)} training FLOPs" in out
    assert "4 trials at once on the local cluster" in out
    # the minutes, from a trial's speed measured on this machine
    assert re.search(
        r"time: ~(\d+ min )?\d+ s of trials here if every trial runs to its end, less", out
    )
    assert re.search(
        r"a trial on 1 thread trains \d\.?\d*e\d+ FLOP/s, measured alone just now", out
    )
    assert files_under(tmp_path) == []  # no run dir, no MLflow store, no Ray session dir


def test_a_grid_over_model_sizes_sums_its_points_and_shows_the_range_of_a_trial():
    cfg = compose(["+sweep=scaling"])
    plan = build_plan(cfg)
    base = plan.base
    (estimate,) = stage_estimates(plan, base)
    flops = [
        planned_flops(
            load_run_config(sweep_run(base, {"trainer.budget_flops": b, "model.depth": d}))
        )
        for b in (1e12, 3e12, 1e13)
        for d in (1, 2, 3, 4, 5)
    ]
    assert estimate.trials == 15 and estimate.rungs == ()  # fifo: every point to its budget
    assert estimate.trial_flops == (min(flops), max(flops))
    assert estimate.most_flops == sum(flops)
    # a sampled stage is counted at its dearest trial: depth sampled in [1, 5] costs most at 5
    sampled = ["sweep.stages.0.search=random", "sweep.stages.0.num_samples=6"]
    depth = "sweep.stages.0.params.model.depth"
    sampled += [f"~{depth}", f"+{depth}={{int:[1,5]}}"]
    plan = build_plan(compose(["+sweep=scaling", *sampled]))
    (estimate,) = stage_estimates(plan, plan.base)
    dearest = max(flops)
    assert estimate.trials == 18 and estimate.most_flops == 18 * dearest  # 6 draws x 3 budgets


def test_a_resumed_sweep_plans_only_what_is_left_from_the_config_its_stages_left(tmp_path):
    cfg = compose(["+sweep=lr_bs"])
    plan = build_plan(cfg)
    spec, base = plan.spec, plan.base
    run_dir = tmp_path / "run"
    state = SweepState.new(run_dir, spec.name, base, plan.definition)
    # the LR stage finished and froze a model two layers deeper (as a stage could)
    left = {**base, "model": {**base["model"], "depth": base["model"]["depth"] + 2}}
    state.finish_stage("lr", [], {}, None, left, 10.0)
    before = {p: p.read_bytes() for p in run_dir.iterdir()}
    args = ["+sweep=lr_bs", f"hydra.run.dir={run_dir}", "sweep.resume=true", *PLAN]
    proc = run_main(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "stage lr          finished in the run dir: skipped (sweep.resume=true)" in out
    deeper = planned_flops(load_run_config(sweep_run(left, {})))
    assert f"3 trials of {flops_text(deeper)} FLOPs" in out
    baseline = planned_flops(load_run_config(sweep_run(base, {})))  # the unmodified config
    assert f"at most 4 runs (with the baseline), {flops_text(3 * deeper + baseline)}" in out
    assert f"run dir: {run_dir}" in out
    assert {p: p.read_bytes() for p in run_dir.iterdir()} == before
    # the sweep's own first line gives the same totals, for what is left, and its caps
    assert opening_line(plan, state).startswith(
        f"sweep 'lr_bs': 1 stage (batch_size), at most 4 runs (with the baseline), "
        f"{flops_text(3 * deeper + baseline)} training FLOPs if no trial is stopped early; "
        "sweep.dry_run=true"
    )
    capped = build_plan(compose(["+sweep=lr_bs", "sweep.max_flops=1e13"]))
    assert "early; capped by sweep.max_flops=1e13; sweep.dry_run" in opening_line(capped, state)


def test_the_plan_says_how_asha_decides_at_its_rungs(tmp_path):
    proc = run_main(["+sweep=lr", *PLAN], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "of its budget (keeps the best 1/3 at each)" in proc.stdout, proc.stdout


def test_a_users_function_has_its_trials_planned_and_no_flops(tmp_path):
    # a module of the user's own in the working directory, as `python -m` finds it
    (tmp_path / "mine.py").write_text("def fit(config, report):\n    report({'loss': 1.0})\n")
    args = ["+sweep=smoke", "trainable._target_=mine.fit", "sweep.metric=loss", *PLAN]
    proc = run_cli(args, cwd=tmp_path, timeout=60, env={"PYTHONDONTWRITEBYTECODE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "trainable: mine.fit (its budget is its own)" in proc.stdout
    assert "random search, asha scheduler: 2 trials\n" in proc.stdout
    assert "FLOPs" not in proc.stdout
    assert files_under(tmp_path) == ["mine.py"]


def test_a_stages_given_points_are_in_its_plan(tmp_path):
    points = "+sweep.stages.0.points=[base,{optimizer.matrix_lr:0.03}]"
    proc = run_main(["+sweep=smoke", points, *PLAN], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("  stage lr "))
    assert lines[at + 2].strip() == (
        "first the given points: base (the config the stage starts from); "
        "{optimizer.matrix_lr=0.03}"
    )
    assert not any("given points" in line for line in lines[at + 3 :])  # the batch stage
    assert files_under(tmp_path) == []


def test_a_multirun_plans_each_of_its_sweeps(tmp_path):
    proc = run_main(["-m", "+sweep=smoke,lr", *PLAN], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("the plan (sweep.dry_run=true") == 2
    assert "sweep 'smoke'" in proc.stdout and "sweep 'lr'" in proc.stdout
    assert files_under(tmp_path) == []  # no multirun dir


def test_a_bad_dry_run_value_is_one_line(tmp_path):
    proc = run_main(["+sweep=smoke", "sweep.dry_run=maybe"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: sweep.dry_run: Value 'maybe' is not a valid bool (type str)"
    ]
    assert proc.stdout == "" and files_under(tmp_path) == []


def test_trials_of_known_length_fill_the_slots_longest_first():
    assert makespan([3.0, 3.0, 3.0], 2) == 6.0
    assert makespan([1.0, 1.0, 1.0, 5.0], 2) == 5.0  # the long one alone, the rest beside it
    assert makespan([2.0] * 8, 3) == 6.0
    assert makespan([], 2) == 0.0


def test_the_time_counts_each_stage_in_rounds_of_its_slots_and_the_baseline_in_the_first():
    cfg = compose(["+sweep=lr_bs", "sweep.stages.0.scheduler=fifo"])
    plan = build_plan(cfg)
    base = plan.base
    plans = stage_estimates(plan, base)
    speed = Speed(train_flops_per_s=1e11, eval_flops_per_s=3e11, setup_s=2.0, threads=1)
    trial = speed.trial_seconds(plans[0].costs[0], 1.0)
    once = speed.trial_seconds(run_cost(evaluating_once(base)), 1.0)
    assert trial > once > 2.0 + plans[0].costs[0].flops / 1e11  # 8 evaluations against 1
    # 8 LR trials and the shorter baseline on 2 slots: 4 rounds, then the baseline in
    # the first free slot; then 3 batch trials, the two longest side by side: the batch of
    # 16384 takes fewer steps, so it evaluates 3 times where the others do 4
    batch, _, shortest = sorted((speed.trial_seconds(c, 1.0) for c in plans[1].costs), reverse=True)
    assert shortest < batch
    starts, batches = 2 * STAGE_START_S, batch + shortest
    assert plan_seconds(plan, plans, speed, 2, True) == starts + 4 * trial + once + batches
    assert plan_seconds(plan, plans, speed, 2, False) == starts + 4 * trial + batches
    assert plan_seconds(plan, plans, speed, 11, True) == starts + trial + batch


def test_the_speed_is_measured_on_the_real_training_loop_and_not_for_a_model_too_big():
    plan = build_plan(compose(["+sweep=smoke"]))
    speed = measure_speed(plan.base, threads=1)
    assert speed.threads == 1 and speed.setup_s >= 0
    assert 1e8 < speed.train_flops_per_s < 1e14 and 1e8 < speed.eval_flops_per_s < 1e14
    # ~700M params: steps of minutes on a CPU, not timed
    big = plan.base
    big = {**big, "model": {**big["model"], "depth": 24, "aspect_ratio": 64}}
    assert measure_speed(big, threads=1) is None


def test_a_stage_names_its_trials_budget_on_its_own_time_axis():
    assert budget_text("tokens", 160000.0) == "160,000 tokens"
    assert budget_text("flops", 3.67e12) == "3.67e12 FLOPs"
    assert budget_text("training_iteration", 8.0) == "8 reports"
    assert budget_text("training_iteration", 1.0) == "1 report"


def test_the_most_flops_count_the_forks_of_the_trials_past_a_ranges_end():
    """`lr`'s LR stage: 12 trials, then up to 4 more past a range's end, each run by the
    stage's ASHA, so each forks at every rung too (they were counted without forks)."""

    def most(cooldown: float) -> float:
        plan = build_plan(compose(["+sweep=lr", f"sweep.rung_cooldown={cooldown}"]))
        return plan, sweep_totals(plan, stage_estimates(plan, plan.base), None).most_flops

    plan, forked = most(0.25)
    _, plain = most(0.0)
    (stage,) = stage_estimates(plan, plan.base)
    assert (stage.trials, stage.extend_trials) == (12, 4)
    rungs = plan.rung_fractions(plan.stages[0])
    trial = stage.trial_flops[1]
    assert forked - plain == pytest.approx((12 + 4) * trial * 0.25 * sum(rungs))


def test_a_resume_with_more_time_plans_the_stage_the_time_cap_cut_short(tmp_path):
    plan = build_plan(compose(["+sweep=lr_bs", "sweep.max_seconds=60"]))
    state = SweepState.new(tmp_path, plan.spec.name, plan.base, plan.definition)
    state.finish_stage("lr", [], {}, None, plan.base, 70.0, capped=True)
    # the same cap: the resume has no time for it, and the plan says the stage is done
    assert [p.finished for p in estimates_left(plan, state)] == [True, False]
    # more time: the stage goes on (runner.reopen_capped_stage); it was planned as done
    more = build_plan(compose(["+sweep=lr_bs", "sweep.max_seconds=600"]))
    assert [p.finished for p in estimates_left(more, state)] == [False, False]
    assert "2 stages" in opening_line(more, state)


def test_the_readmes_example_sweep_file_plans_as_its_comments_say(tmp_path):
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Writing a sweep") :]
    example = section[section.index("```yaml\n") + len("```yaml\n") :]
    example = example[: example.index("```")]
    (tmp_path / "mine" / "sweep").mkdir(parents=True)
    (tmp_path / "mine" / "sweep" / "my_sweep.yaml").write_text(example)
    args = [f"hydra.searchpath=[file://{tmp_path}/mine]", "+sweep=my_sweep", *PLAN]
    proc = run_main(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "sweep 'my_sweep': the plan" in out
    assert "each trial trains 300,000 tokens" in out
    assert re.search(r"stage lr +tpe search, asha scheduler: 12 trials", out), out
    # its batch stage runs every grid point to its budget, as lr_bs's does
    assert re.search(r"stage batch_size +grid search, fifo scheduler: 3 trials", out), out
    assert "then 4 more trials past a range's end" in out


def test_the_dry_run_says_when_it_does_not_time_and_times_nothing_for_a_finished_sweep(tmp_path):
    # a model whose few probe steps would cost more than a dry run spends
    args = ["+sweep=lr_bs", "model.depth=8", *PLAN]
    proc = run_main(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "(not timed: a few steps of this model train over 2e12 FLOPs" in proc.stdout
    assert "time: ~" not in proc.stdout and "training FLOPs" in proc.stdout
    # every stage and the baseline done: nothing is left to time or train
    cfg = compose(["+sweep=lr_bs"])
    plan = build_plan(cfg)
    spec, base = plan.spec, plan.base
    run_dir = tmp_path / "run"
    state = SweepState.new(run_dir, spec.name, base, plan.definition)
    for stage in spec.stages:
        state.finish_stage(stage.name, [], {}, None, base, 10.0)
    state.set_baseline({"value": 3.0, "status": "completed"})
    args = ["+sweep=lr_bs", f"hydra.run.dir={run_dir}", "sweep.resume=true", *PLAN]
    proc = run_main(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "timing" not in proc.stdout and "time: ~" not in proc.stdout
    assert "in all: at most 0 runs, 0 training FLOPs" in proc.stdout
