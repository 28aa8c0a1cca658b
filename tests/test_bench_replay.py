"""bench/bench_search.py replays Ray's ASHA rule, and ASHA as published, over recorded
curves to find what ASHA could at best save (its oracle floor). The rules are written there
by hand, so they are checked here against schedules worked out on paper."""

from __future__ import annotations

import sys

import pytest

from .conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from bench_search import rank_report, replay_asha, replay_asha_promotion  # noqa: E402

# three trials of 4 FLOPs, reported at 1, 2 and 4; rungs at 1 and 2 (grace 1/4, rf 2)
POOL = [
    [(1.0, 5.0), (2.0, 4.0), (4.0, 3.0)],  # A: first at both rungs, so it goes on
    [(1.0, 6.0), (2.0, 5.0), (4.0, 3.5)],  # B: worse than A's 5.0 at rung 1: stopped at 1
    [(1.0, 4.0), (2.0, 3.5), (4.0, 2.5)],  # C: starts when B stops, best everywhere
]


@pytest.mark.parametrize(
    "target, spent",
    [
        # A 0-4, B 0-1, C 1-5: all 4 + 1 + 4 FLOPs are spent when C ends at t=5
        (2.5, 9 / 4),
        # A ends at t=4 (4 FLOPs); B spent 1; C had run 3 of its FLOPs by then
        (3.0, 8 / 4),
    ],
)
def test_replay_follows_ashas_rule_and_counts_what_runs_until_the_target(target, spent):
    assert replay_asha(POOL, [0, 1, 2], target, 0.25, 2, oracle=False) == pytest.approx(spent)


def test_a_trial_stopped_on_its_rung_value_is_kept_by_the_oracle():
    late_bloomer = [(1.0, 6.0), (2.0, 5.0), (4.0, 2.0)]  # B, but best at the end
    pool = [POOL[0], late_bloomer, POOL[2]]
    # recorded values stop it at rung 1 (6.0 > A's 5.0); C's 2.5 never reaches 2.0
    assert replay_asha(pool, [0, 1, 2], 2.0, 0.25, 2, oracle=False) == float("inf")
    # ranked by finals it runs beside A to the end: 4 + 4 FLOPs when both end at t=4
    assert replay_asha(pool, [0, 1, 2], 2.0, 0.25, 2, oracle=True) == pytest.approx(8 / 4)


@pytest.mark.parametrize(
    "target, spent",
    [
        # A and B to rung 1 (t=1); A waits (1 recorded, floor(1/2) = 0 to promote) while C
        # starts; B's value makes 2, so A, the better, goes on (1-2). C reaches rung 1 at t=2
        # and goes on as the best of 3 (2-3); with no draws left A goes on from rung 2 as its
        # leader (2-4), then C (3-5): 1 + 1 + 1 + 1 + 1 + 2 + 2 FLOPs when C ends at t=5
        (2.5, 9 / 4),
        # A ends at t=4: all but the last FLOP of C's last leg
        (3.0, 8 / 4),
    ],
)
def test_the_published_rule_pauses_at_a_rung_and_promotes_the_top_of_each(target, spent):
    assert replay_asha_promotion(POOL, [0, 1, 2], target, 0.25, 2, oracle=False) == (
        pytest.approx(spent)
    )


def test_the_published_rule_does_not_let_the_first_trial_through_unranked():
    pool = [
        [(1.0, 9.0), (2.0, 8.0), (4.0, 7.0)],  # A: first and worst
        [(1.0, 5.0), (2.0, 4.0), (4.0, 3.0)],  # B: the best
        [(1.0, 6.0), (2.0, 5.0), (4.0, 3.5)],
    ]
    # Ray's rule: A and B are each the first or better than the first at both rungs, so
    # both train to the end (4 + 4 FLOPs at t=4)
    assert replay_asha(pool, [0, 1, 2], 3.0, 0.25, 2, oracle=False) == pytest.approx(8 / 4)
    # published: A waits at rung 1 and is never in the top half there; B goes on at t=1
    # and ends at t=4; C trains to rung 2 and waits behind B: A 1 + B 4 + C 2 FLOPs
    assert replay_asha_promotion(pool, [0, 1, 2], 3.0, 0.25, 2, oracle=False) == (
        pytest.approx(7 / 4)
    )


def test_rank_report_gives_each_reports_rank_correlation_with_the_final_value():
    # report 1 ranks A, B, C as the end does; report 2 in reverse; D diverged (one report)
    pool = [
        [(1.0, 5.0), (2.0, 3.0), (4.0, 3.0)],
        [(1.0, 6.0), (2.0, 2.0), (4.0, 3.5)],
        [(1.0, 7.0), (2.0, 1.0), (4.0, 4.0)],
        [(1.0, 9.0)],
    ]
    line = rank_report(pool)
    assert line.endswith("(3 trials), by fraction: 0.25: 1.00, 0.5: -1.00"), line


@pytest.mark.parametrize(
    "space, names",
    [
        ("lr2", {"optimizer.matrix_lr", "optimizer.embedding_lr"}),
        ("lr3", {"optimizer.matrix_lr", "optimizer.embedding_lr", "optimizer.unembedding_lr"}),
    ],
)
def test_the_search_bench_spaces_compose_into_the_stages_they_name(space, names):
    from bench_search import COMMON, SPACES

    from sweeper.config.compose import compose
    from sweeper.config.sweep import load_sweep_spec
    from tests.conftest import plan_for

    spec = load_sweep_spec(compose([*COMMON, *SPACES[space]]).sweep)
    searched = plan_for(spec).space(spec.stages[0])
    assert set(searched.names) == names
    assert all(param.log for param in searched.params)


def test_the_seed_noise_bench_trains_one_configuration_over_a_grid_of_seeds():
    from bench_search_noise import seed_grid_overrides

    from sweeper.config.compose import compose
    from sweeper.config.sweep import load_sweep_spec
    from tests.conftest import plan_for

    cfg = compose(seed_grid_overrides(0.09, 0.3, 5))
    spec = load_sweep_spec(cfg.sweep)
    searched = plan_for(spec).space(spec.stages[0])
    assert [(p.name, p.kind, list(p.values)) for p in searched.params] == [
        ("trainer.seed", "grid", [0, 1, 2, 3, 4])
    ]
    assert (cfg.optimizer.matrix_lr, cfg.optimizer.embedding_lr) == (0.09, 0.3)
    # the search bench's trials otherwise
    assert (cfg.trainer.eval_tokens, cfg.trainer.total_batch_size) == (8192, 1024)


def test_a_replay_within_a_margin_of_the_best_counts_a_trial_inside_it():
    from bench_search import replay_report

    # every search holds all three, so its best is the late bloomer's 2.0; its rung values
    # are the worst, so the recorded ranking stops it and the best is never reached. Within
    # 1.0 of it, the two trials that finish at 3.0 count
    twin = [(1.0, 5.0), (2.0, 4.0), (4.0, 3.0)]
    pool = [twin, list(twin), [(1.0, 6.0), (2.0, 5.0), (4.0, 2.0)]]

    def recorded(line: str) -> list[float]:
        cells = [cell.split() for cell in line.split(" | ")[1:]]
        return [float(cell[2].rstrip("x")) for cell in cells if cell[1] == "recorded"]

    exact, loose = (replay_report(pool, 3, 3, 0.25, 2, within) for within in (0.0, 1.0))
    assert "within 1:" in loose and "within" not in exact.split(" | ")[0]
    assert recorded(exact) == [float("inf")] * 2  # Ray's rule and the published one
    assert all(0 < value < 1 for value in recorded(loose))


def test_a_saved_run_is_read_back_whole_and_not_trained_again(tmp_path):
    from bench_search import compute_to_reach, saved_run

    # two trials as reports.csv holds them (strings); b completes at 3.0 after 20 FLOPs
    reports = [
        {"trial_id": "a", "flops": "10", "val_bpb": "4.0", "final": "False",
         "status": "pruned", "wall_time": "1.0"},
        {"trial_id": "b", "flops": "20", "val_bpb": "3.0", "final": "True",
         "status": "completed", "wall_time": "2.0"},
    ]  # fmt: skip
    trained = []

    def train() -> list[dict]:
        trained.append(1)
        return reports

    path = tmp_path / "saved" / "0-asha.csv"
    assert saved_run(path, train) == reports and trained == [1]
    assert [p.name for p in path.parent.iterdir()] == ["0-asha.csv"]  # no partial file left
    assert saved_run(path, train) == reports and trained == [1]  # read back, not trained
    assert compute_to_reach(saved_run(path, train), 3.0) == (30.0, 30.0, 3.0)
    assert saved_run(None, train) == reports and trained == [1, 1]  # nothing saved: trains
