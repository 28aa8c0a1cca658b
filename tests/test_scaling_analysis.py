"""fit_all / plot_all on sweep-like records: every fit, predictions, CIs, bad data, plots."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from sweeper.scaling import bootstrap_chinchilla, fit_all, fit_chinchilla, plot_all

LAW = {"E": 1.7, "A": 400.0, "B": 410.0, "alpha": 0.34, "beta": 0.28}
LR_EXP = -0.1
BUDGETS = [1e17, 3e17, 1e18, 3e18, 1e19]


def law(n, d):
    return LAW["E"] + LAW["A"] / n ** LAW["alpha"] + LAW["B"] / d ** LAW["beta"]


def lr_opt(c):
    return 2.0 * c**LR_EXP


def make_sweep(seed=0, noise=1e-3):
    """IsoFLOP grid (5 budgets x 5 sizes x 3 LRs), each run with 3 intermediate reports."""
    rng = np.random.default_rng(seed)
    records = []
    for c in BUDGETS:
        n_center = 0.1 * c**0.5
        for n in n_center * np.logspace(-0.6, 0.6, 5):
            d = c / (6 * n)
            for mult in (0.5, 1.0, 2.0):
                lr = lr_opt(c) * mult
                penalty = 0.02 * math.log2(mult) ** 2
                for frac in (0.25, 0.5, 1.0):
                    loss = (law(n, d * frac) + penalty + 0.05 * (frac < 1)) * math.exp(
                        rng.normal(0, noise)
                    )
                    records.append(
                        {
                            "N": n,
                            "D": d * frac,
                            "loss": loss,
                            "budget": c,
                            "lr": lr,
                            "batch_size": 2**18 * (c / 1e17) ** 0.3,
                            "final": frac == 1.0,
                        }
                    )
    return records


def test_fit_all_does_every_fit():
    records = make_sweep()
    res = fit_all(records, target_flops=1e21, conventions={"loss_unit": "bpb"})
    json.dumps(res, allow_nan=False)
    assert res["conventions"] == {"params": "total", "flops": "6ND", "loss_unit": "bpb"}
    assert res["n_records"] == res["n_used"] == len(records)
    par = res["parametric"]
    assert par["n_points"] == 25  # one best-LR run per (N, D), intermediates excluded
    assert par["n_excluded_intermediate"] == 150
    assert par["alpha"] == pytest.approx(LAW["alpha"], rel=0.1)
    assert par["beta"] == pytest.approx(LAW["beta"], rel=0.1)
    assert par["E"] == pytest.approx(LAW["E"], rel=0.03)
    iso = res["isoflop"]
    assert len(iso["profiles"]) == 5
    assert iso["a"] == pytest.approx(LAW["beta"] / (LAW["alpha"] + LAW["beta"]), abs=0.03)
    # each budget's optimum LR is a parabola's vertex over the 3 LRs: noise moves it a little
    assert res["hparams"]["lr"]["p"] == pytest.approx(LR_EXP, abs=0.02)
    assert res["hparams"]["lr"]["how"] == ["parabola"] * 5
    # one batch size at each budget, set by a rule: nothing was searched, so no law (the
    # rule's own exponent is no optimum's)
    assert "batch_size" not in res["hparams"] and "batch_size_opt" not in res["predictions"]
    exact = fit_all(make_sweep(noise=0), target_flops=1e21)
    assert exact["hparams"]["lr"]["p"] == pytest.approx(LR_EXP, abs=1e-9)
    assert exact["predictions"]["lr_opt"] == pytest.approx(lr_opt(1e21), rel=1e-6)
    fr = res["frontier"]
    assert fr["n_candidates"] == len(records) and fr["n_points"] >= 4
    pr = res["predictions"]
    for key in (
        "frontier_loss",
        "parametric_N_opt",
        "parametric_D_opt",
        "parametric_loss_opt",
        "parametric_tokens_per_param",
        "isoflop_N_opt",
        "isoflop_D_opt",
        "lr_opt",
    ):
        assert pr[key] > 0, key
    # 4 decades past the largest budget, the noisy vertices' slope is 8% off at most here
    assert pr["lr_opt"] == pytest.approx(lr_opt(1e21), rel=0.15)
    assert pr["parametric_tokens_per_param"] == pytest.approx(
        pr["parametric_D_opt"] / pr["parametric_N_opt"]
    )
    assert not [w for w in res["warnings"] if "parametric" in w or "frontier" in w]


def test_bootstrap_cis_cover_the_truth_and_are_seeded():
    records = make_sweep()
    a = fit_all(records, target_flops=1e21, bootstrap=40, seed=7)
    b = fit_all(records, target_flops=1e21, bootstrap=40, seed=7)
    assert a == b
    ci = a["parametric"]["bootstrap"]["ci95"]
    for key in ("E", "alpha", "beta"):
        lo, hi = ci[key]
        assert lo <= a["parametric"][key] <= hi
    assert set(ci) >= {
        "E",
        "A",
        "B",
        "alpha",
        "beta",
        "a",
        "b",
        "N_opt",
        "D_opt",
        "tokens_per_param",
        "loss_opt",
    }
    assert a["predictions"]["parametric_N_opt_ci95"] == ci["N_opt"]
    fb = a["frontier"]["bootstrap"]
    assert set(fb["ci95"]) == {"E", "A", "alpha", "loss_at_target"}
    assert len(fb["band"]["flops"]) == len(fb["band"]["lo"]) == 60
    assert a["predictions"]["frontier_loss_ci95"] == fb["ci95"]["loss_at_target"]


def test_bootstrap_chinchilla_percentiles():
    rng = np.random.default_rng(0)
    n, d = (v.ravel() for v in np.meshgrid(np.logspace(7, 10, 8), np.logspace(9, 12, 8)))
    loss = law(n, d) * np.exp(rng.normal(0, 2e-3, n.size))
    fit = fit_chinchilla(n, d, loss, grid="small")
    out = bootstrap_chinchilla(n, d, loss, fit, n_boot=50, seed=1)
    assert out["n_boot"] == 50 and out["n_failed"] == 0
    lo, hi = out["ci95"]["alpha"]
    assert lo < LAW["alpha"] < hi and hi - lo < 0.1


@pytest.mark.parametrize(
    "records, expect",
    [
        ([], ["frontier:", "parametric:", "isoflop:"]),
        ([{"N": 1e8, "D": 2e9, "loss": 3.0}] * 3, ["frontier: only 1", "parametric: 1 final"]),
        ([{"N": "abc", "loss": "x"}, {"loss": None}, {}], ["dropped 3 of 3"]),
    ],
)
def test_bad_data_gives_warnings_not_exceptions(records, expect):
    res = fit_all(records)
    json.dumps(res, allow_nan=False)
    for text in expect:
        assert any(w.startswith(text) for w in res["warnings"]), (text, res["warnings"])
    assert res["parametric"] is None and res["frontier"] is None


def test_nan_losses_dropped_with_count_and_rest_fitted():
    records = make_sweep()
    for r in records[:5]:
        r["loss"] = float("nan")
    records[5]["loss"] = float("inf")
    res = fit_all(records)
    assert any(w.startswith("dropped 6 of") for w in res["warnings"])
    assert res["parametric"] is not None and res["frontier"] is not None


def test_single_model_size_skips_parametric_with_reason():
    records = [{"N": 1e8, "D": d, "loss": 2.0 + 100 / d**0.3} for d in np.logspace(9, 11, 8)]
    res = fit_all(records)
    assert res["parametric"] is None
    assert any("single model size" in w for w in res["warnings"])
    assert res["frontier"] is not None


def test_only_the_fits_asked_for_are_made_or_warned_about():
    records = make_sweep()
    res = fit_all(records, target_flops=1e21, fits=("frontier",))
    assert res["frontier"] is not None
    assert res["parametric"] is None and res["isoflop"] is None and res["hparams"] == {}
    assert res["lr_vs_batch"] is None
    assert not [w for w in res["warnings"] if w.startswith(("parametric", "isoflop", "lr-"))]
    assert set(res["predictions"]) == {"frontier_loss"}


def test_an_lr_sweeps_end_fits_only_its_frontier_and_says_why_once():
    from sweeper.report.fit import applicable_fits

    def point(n, budget=None):
        return {"N": n, "D": 1e5, "C": 1e12, "loss": 3.0, "budget": budget}

    fits, not_fitted = applicable_fits([point(3e6), point(3e6)])  # one size, no budgets
    assert fits == ("frontier",) and set(not_fitted) == {"parametric", "isoflop"}
    fits, not_fitted = applicable_fits([point(1e6), point(3e6)])  # a depth sweep
    assert fits == ("frontier", "parametric") and set(not_fitted) == {"isoflop"}
    fits, not_fitted = applicable_fits([point(1e6, 1e13), point(3e6, 1e13)])  # scaling grid
    assert fits == ("frontier", "parametric", "isoflop", "hparams") and not_fitted == {}
    # one model size at several budgets (lr_scaling): the LR law, no IsoFLOP profiles
    fits, not_fitted = applicable_fits([point(3e6, 1e12), point(3e6, 1e13)])
    assert fits == ("frontier", "hparams") and set(not_fitted) == {"parametric", "isoflop"}
    assert not_fitted["isoflop"] == "IsoFLOP optima need several model sizes at each budget"


def test_fixed_tokens_per_param_is_collinear():
    records = [{"N": n, "D": 20 * n, "loss": law(n, 20 * n)} for n in np.logspace(7, 9, 8)]
    res = fit_all(records)
    assert any("collinear" in w for w in res["warnings"])


def test_wrong_shaped_input_and_bad_target():
    res = fit_all(None, target_flops="lots")
    assert res["warnings"] and res["target_flops"] is None
    res = fit_all([1, 2, 3])
    assert any("could not read records" in w for w in res["warnings"])


def test_plot_all_writes_pngs(tmp_path):
    records = make_sweep()
    res = fit_all(records, target_flops=1e21, bootstrap=20)
    paths = plot_all(res, records, tmp_path / "plots")
    names = sorted(p.name for p in paths)
    assert names == ["frontier.png", "hparams.png", "isoflop.png", "optima.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_plot_all_skips_absent_fits(tmp_path):
    records = [{"C": c, "loss": 2 + 30 * c**-0.1} for c in np.logspace(17, 20, 10)]
    res = fit_all(records)
    assert [p.name for p in plot_all(res, records, tmp_path)] == ["frontier.png"]
    assert plot_all(fit_all([]), [], tmp_path / "empty") == []


@pytest.mark.parametrize(
    ("grid", "vertex", "expected", "how"),
    [
        # a loss quadratic in log(lr): the vertex between grid points, found exactly
        ([0.01, 0.02, 0.04, 0.08], 0.03, 0.03, "parabola"),
        ([0.01, 0.02, 0.04, 0.08], 0.05, 0.05, "parabola"),
        # the best value at an end of the grid: it, flagged (the optimum may lie beyond)
        ([0.01, 0.02, 0.04], 0.2, 0.04, "grid end"),
        ([0.01, 0.02, 0.04], 0.001, 0.01, "grid end"),
        # one or two values: no parabola, and the best is always an end of them
        ([0.01, 0.04], 0.03, 0.04, "grid end"),
        ([0.01, 0.04], 0.02, 0.01, "grid end"),
        ([0.02], 0.02, 0.02, "grid end"),
    ],
)
def test_the_optimum_on_a_grid_is_a_parabolas_vertex_in_log_value(grid, vertex, expected, how):
    from sweeper.scaling.hparams import optimum_on_grid

    # every value twice (two model sizes at one budget): each value's lowest loss counts
    values = [v for v in grid for _ in range(2)]
    losses = [2.0 + math.log(v / vertex) ** 2 + extra for v in grid for extra in (0.3, 0.0)]
    value, method = optimum_on_grid(values, losses)
    assert (value, method) == (pytest.approx(expected, rel=1e-9), how)


def lr_grid_records(lr_opt: dict, lrs=(0.01, 0.02, 0.04)) -> list[dict]:
    """One model's final runs at each budget of `lr_opt` (the best LR there) and each LR."""
    return [
        {
            "N": 1e6,
            "C": c,
            "loss": 3.0 - 0.1 * math.log10(c) + 0.1 * math.log2(lr / lr_opt[c]) ** 2,
            "budget": c,
            "lr": lr,
            "batch_size": 1024,
            "final": True,
        }
        for c in lr_opt
        for lr in lrs
    ]


def test_a_hyperparameter_never_varied_has_no_law_and_an_end_of_the_grid_is_named(tmp_path):
    records = lr_grid_records
    res = fit_all(records({1e12: 0.04, 1e13: 0.02, 1e14: 0.02}))
    assert "batch_size" not in res["hparams"]  # 1024 in every run: nothing to fit
    # the plot draws the end of the grid hollow (a bound) and the vertex filled
    from matplotlib.figure import Figure

    from sweeper.scaling.plots import plot_hparams
    from sweeper.scaling.records import to_points

    drawn = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
        plot_hparams(
            res, tmp_path / "unused.png", to_points(records({1e12: 0.04, 1e13: 0.02, 1e14: 0.02}))
        )
    filled, hollow = drawn[0].axes[1].collections
    assert filled.get_offsets().tolist() == [
        [1e13, pytest.approx(0.02)],
        [1e14, pytest.approx(0.02)],
    ]
    assert hollow.get_offsets().tolist() == [[1e12, 0.04]] and not hollow.get_facecolors().size
    assert res["hparams"]["lr"]["best"] == pytest.approx([0.04, 0.02, 0.02])
    assert res["hparams"]["lr"]["how"] == ["grid end", "parabola", "parabola"]
    assert [w for w in res["warnings"] if "vs-compute" in w] == [
        "lr-vs-compute: at C = 1e+12 the best lr (0.04) is at an end of the values tried: "
        "the optimum may lie beyond it"
    ]
    # an end of the grid at every budget: bounds, not optima, so no law through them
    res = fit_all(records({1e12: 0.04, 1e13: 0.05}))
    assert res["hparams"] == {} and "lr_opt" not in res["predictions"]
    assert [w for w in res["warnings"] if "vs-compute" in w] == [
        "lr-vs-compute: the best lr is at an end of the values tried at every budget "
        "(0.04, 0.04): no law; try values beyond"
    ]
    # two values at each budget: whichever wins is an end of them, so no law through them
    # (a law once went through the ends of a {512, 1024} batch grid, without a warning)
    two = [r for r in records({1e12: 0.01, 1e13: 0.01, 1e14: 0.04}) if r["lr"] in (0.01, 0.02)]
    res = fit_all(two)
    assert res["hparams"] == {} and "lr_opt" not in res["predictions"]
    assert [w for w in res["warnings"] if "vs-compute" in w] == [
        "lr-vs-compute: the best lr is at an end of the values tried at every budget "
        "(0.01, 0.01, 0.02): no law; try values beyond"
    ]
    # one optimum and a bound: the slope would be the bound's, so no law either
    res = fit_all(records({1e12: 0.04, 1e13: 0.02}))
    assert res["hparams"] == {} and "lr_opt" not in res["predictions"]
    assert [w for w in res["warnings"] if "vs-compute" in w] == [
        "lr-vs-compute: only one optimum lies inside the values tried (at an end: 1e+12: "
        "0.04): no law, which needs two; try values beyond"
    ]


def test_an_lr_law_that_rises_and_a_far_prediction_are_warned_of():
    def records(lr_opt):  # lr_opt: the optimum at each budget, inside the values tried
        return lr_grid_records(lr_opt, lrs=(0.01, 0.02, 0.04, 0.08))

    def warned(res):
        return [w for w in res["warnings"] if "vs-compute" in w]

    falls = fit_all(records({1e12: 0.04, 1e13: 0.02}), target_flops=1e15)
    assert falls["hparams"]["lr"]["p"] == pytest.approx(-math.log10(2))
    assert warned(falls) == []  # 100x: the scaling sweeps' own extrapolation, not noted
    rises = fit_all(records({1e12: 0.02, 1e13: 0.04}), target_flops=1e16)
    assert rises["predictions"]["lr_opt"] == pytest.approx(0.04 * 2**3)
    assert warned(rises) == [
        "lr-vs-compute: the best lr rises with compute (C^+0.301), where it falls in every "
        "published law: more seeds or budgets before trusting it",
        "lr-vs-compute: C = 1e+16 is 1,000x the largest budget fitted (1e+13): an exponent "
        "off by 0.1 moves the prediction 2x",
    ]


def test_a_grid_of_lr_by_batch_size_gives_a_law_for_each():
    """lr_bs_scaling's data: at each budget a grid of LR x batch size, one model. With a
    loss quadratic in log(lr) and in log(batch) around optima that follow power laws of C,
    each hyperparameter's lowest loss at each value (the other at its best there) puts both
    optima on the vertex, so both laws come back exactly."""

    def lr_opt(c):
        return 0.04 * (c / 1e12) ** -0.2

    def batch_opt(c):
        return 1500 * (c / 1e12) ** 0.3

    records = [
        {
            "N": 3e6,
            "C": c,
            "loss": 3.0
            - 0.1 * math.log10(c)
            + 0.2 * math.log(lr / lr_opt(c)) ** 2
            + 0.1 * math.log(batch / batch_opt(c)) ** 2,
            "budget": c,
            "lr": lr,
            "batch_size": batch,
            "final": True,
        }
        for c in (1e12, 1e13, 1e14)
        for lr in (0.005, 0.01, 0.02, 0.04, 0.08)
        for batch in (512, 1024, 2048, 4096, 8192, 16384)
    ]
    res = fit_all(records, target_flops=1e16)
    for name, opt, exponent in (("lr", lr_opt, -0.2), ("batch_size", batch_opt, 0.3)):
        law = res["hparams"][name]
        assert law["how"] == ["parabola"] * 3
        assert law["best"] == pytest.approx([opt(c) for c in (1e12, 1e13, 1e14)], rel=1e-9)
        assert law["p"] == pytest.approx(exponent, rel=1e-9)
        assert res["predictions"][f"{name}_opt"] == pytest.approx(opt(1e16), rel=1e-9)
    assert not [w for w in res["warnings"] if "vs-compute" in w]


def test_the_hparams_plot_draws_each_budgets_lowest_loss_at_each_value_above_its_best(
    tmp_path, monkeypatch
):
    from matplotlib.figure import Figure

    from sweeper.scaling.plots import plot_hparams
    from sweeper.scaling.records import to_points

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    records = make_sweep(noise=0)
    res = fit_all(records)
    plot_hparams(res, tmp_path / "h.png", to_points(records))
    curves = drawn[0].axes[0].get_lines()
    budget = BUDGETS[0]
    at = [r for r in records if r["final"] and r["budget"] == budget]
    lrs = sorted({r["lr"] for r in at})
    lowest = [min(r["loss"] for r in at if r["lr"] == lr) for lr in lrs]
    solid = [line for line in curves if line.get_linestyle() == "-"]
    assert list(solid[0].get_xdata()) == pytest.approx(lrs)
    assert list(solid[0].get_ydata()) == pytest.approx([y - min(lowest) for y in lowest])
    assert len(solid) == len(BUDGETS)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_isoflop_points_without_a_budget_label_say_where_a_csv_gives_one():
    records = [
        {"N": n, "C": c, "loss": 3.0 + (math.log10(n) - 7) ** 2, "final": True}
        for c in (1e17, 1e18)
        for n in (1e6, 1e7, 1e8)
    ]
    warnings = fit_all(records)["warnings"]
    assert any(
        w.startswith("isoflop: no final points with a budget label and N; skipped")
        and "--budget-col" in w
        for w in warnings
    ), warnings


def test_each_budgets_curve_on_the_hparams_plot_is_that_budgets_runs_alone(tmp_path):
    """Budgets 10% apart were drawn together (runs picked by compute within 20%), and runs
    without a C crashed the plot (an empty pick)."""
    from matplotlib.figure import Figure

    from sweeper.scaling.plots import plot_hparams
    from sweeper.scaling.records import to_points

    lrs = (0.01, 0.02, 0.04, 0.08)
    optima = {1e12: 0.015, 1.1e12: 0.06, 1.2e12: 0.03, 1.3e12: 0.05}
    for with_c in (True, False):
        records = lr_grid_records(optima, lrs=lrs)
        if not with_c:
            records = [{k: v for k, v in r.items() if k != "C"} for r in records]
        res = fit_all(records)
        assert res["hparams"]["lr"]["budgets"] == list(optima)
        drawn = []
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Figure, "savefig", lambda fig, *a, seen=drawn, **k: seen.append(fig))
            plot_hparams(res, tmp_path / "unused.png", to_points(records))
        curves = [line for line in drawn[0].axes[0].lines if len(line.get_xdata()) > 2]
        assert len(curves) == len(optima)
        for line, best in zip(curves, optima.values(), strict=True):
            x, y = line.get_xdata(), line.get_ydata()
            assert list(x) == list(lrs) and y.min() == 0
            # this budget's own lowest loss: the value tried nearest its optimum (in log)
            assert x[np.argmin(y)] == min(lrs, key=lambda lr: abs(math.log(lr / best)))


def test_a_flat_hparam_law_is_drawn_on_an_axis_of_some_height(tmp_path):
    from sweeper.scaling.plots import plot_hparams
    from sweeper.scaling.records import to_points

    # batch 512 best at both budgets: a law of slope 0, whose log axis would have no height
    records = [
        {
            "N": 1e6,
            "C": c,
            "loss": 4.0 - 0.1 * math.log10(c) + abs(math.log2(b / 512)) / 10 + abs(lr - 0.04),
            "budget": c,
            "lr": lr,
            "batch_size": b,
            "final": True,
        }
        for c in (4e9, 1.2e10)
        for b in (256, 512, 1024)
        for lr in (0.005, 0.04)
    ]
    res = fit_all(records)
    assert res["hparams"]["batch_size"]["best"] == pytest.approx([512, 512])
    path = plot_hparams(res, tmp_path / "h.png", to_points(records))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def lr_by_batch_grid(exponent: float, lrs) -> list[dict]:
    """A loss quadratic in log(lr) around lr_opt = 0.02 (B / 1024)^exponent (C / 1e12)^-0.2
    at each batch size B and budget C, and in log(B) around a batch optimum."""
    return [
        {
            "N": 3e6,
            "C": c,
            "loss": 3.0
            - 0.1 * math.log10(c)
            + 0.2 * math.log(lr / (0.02 * (b / 1024) ** exponent * (c / 1e12) ** -0.2)) ** 2
            + 0.1 * math.log(b / 1500) ** 2,
            "budget": c,
            "lr": lr,
            "batch_size": b,
            "final": True,
        }
        for c in (1e12, 1e13, 1e14)
        for b in (512, 1024, 2048, 4096)
        for lr in lrs
    ]


@pytest.mark.parametrize(("exponent", "rule"), [(1.0, "linear"), (0.5, "sqrt"), (0.0, "none")])
def test_the_best_lr_against_the_batch_size_names_the_closest_lr_rule(exponent, rule):
    from sweeper.scaling.summary import format_summary

    res = fit_all(lr_by_batch_grid(exponent, [0.001 * 2**k for k in range(9)]))
    lvb = res["lr_vs_batch"]
    assert [b["budget"] for b in lvb["budgets"]] == [1e12, 1e13, 1e14]
    for b in lvb["budgets"]:
        assert b["batch_size"] == [512, 1024, 2048, 4096] and b["how"] == ["parabola"] * 4
        expected = [
            0.02 * (x / 1024) ** exponent * (b["budget"] / 1e12) ** -0.2 for x in b["batch_size"]
        ]
        assert b["lr"] == pytest.approx(expected, rel=1e-9)
        assert b["exponent"] == pytest.approx(exponent, abs=1e-9)
    assert lvb["exponent"] == pytest.approx(exponent, abs=1e-9) and lvb["closest_lr_rule"] == rule
    pooled = (
        f"pooled g = {lvb['exponent']:.2f}: the nearest lr_rule for this LR over these batches "
        f"is {rule} (sqrt 0.5, linear 1)"
    )
    assert pooled in format_summary(res)


def test_best_lrs_at_an_end_of_the_grid_are_left_out_of_the_lr_batch_slope(tmp_path):
    from sweeper.scaling.summary import format_summary

    # LRs 0.005-0.04: at 1e12 the best LRs of batches 2048 and 4096 (0.04, 0.08) are ends
    res = fit_all(lr_by_batch_grid(1.0, [0.005, 0.01, 0.02, 0.04]))
    first = res["lr_vs_batch"]["budgets"][0]
    assert first["how"] == ["parabola", "parabola", "grid end", "grid end"]
    assert first["exponent"] == pytest.approx(1.0, abs=1e-9)  # from 512 and 1024 alone
    assert any(
        w.startswith("lr-vs-batch: ") and "left out of the slopes" in w for w in res["warnings"]
    )
    assert "0.04*" in format_summary(res)
    # no budget with two optima inside the grid: no slope, no rule, and the lines say so
    res = fit_all(lr_by_batch_grid(1.0, [0.0001, 0.0002, 0.0004]))
    lvb = res["lr_vs_batch"]
    assert lvb["exponent"] is None and lvb["closest_lr_rule"] is None
    assert all(b["exponent"] is None for b in lvb["budgets"])
    assert "pooled g" not in format_summary(res) and "g = - (512: " in format_summary(res)
    assert any(
        w.endswith("no budget has two optima inside the grid, so no slope") for w in res["warnings"]
    )
    names = [
        p.name for p in plot_all(res, lr_by_batch_grid(1.0, [0.0001, 0.0002, 0.0004]), tmp_path)
    ]
    assert "lr_vs_batch.png" in names


def test_one_batch_size_per_budget_has_no_lr_batch_slope():
    records = [r for r in lr_by_batch_grid(1.0, [0.01, 0.02, 0.04]) if r["batch_size"] == 1024]
    assert fit_all(records)["lr_vs_batch"] is None


def seeded_lr_grid(seeds=(0, 1), wobble=0.01, tilt=0.0) -> list[dict]:
    """An LR grid at 3 budgets, loss quadratic in log(lr) around lr_opt(c), run on each seed.
    Seeds 0 and 1 add +-wobble * (1 + tilt * j) at the j-th LR, opposite ways, so the seeds'
    mean is the noise-free loss; with a tilt, the lowest over seeds leans to the higher LRs."""
    records = []
    for c in (1e12, 1e13, 1e14):
        for j, mult in enumerate((0.25, 0.5, 1.0, 2.0, 4.0)):
            for s in seeds:
                sign = (1 if s % 2 == 0 else -1) * (1 if j % 2 else -1)
                records.append(
                    {
                        "N": 3e6,
                        "C": c,
                        "loss": 3.0
                        - 0.1 * math.log10(c)
                        + 0.05 * math.log(mult) ** 2
                        + sign * wobble * (1 + tilt * j),
                        "budget": c,
                        "lr": lr_opt(c) * mult,
                        "final": True,
                        "seed": s,
                    }
                )
    return records


def test_runs_that_differ_only_in_their_seed_are_fitted_as_their_mean():
    records = seeded_lr_grid(tilt=1.0)
    res = fit_all(records, target_flops=1e16)
    law = res["hparams"]["lr"]
    # the means are the noise-free parabola: its vertex is the true optimum at every budget
    assert law["best"] == pytest.approx([lr_opt(c) for c in (1e12, 1e13, 1e14)], rel=1e-9)
    assert law["p"] == pytest.approx(LR_EXP, rel=1e-9)
    # the j-th LR's two runs lie +-0.01 (1 + j) around their mean: a variance of
    # 2 (0.01 (1 + j))^2, pooled over j = 0..4 (mean of (1 + j)^2: 11)
    assert res["seeds"] == {
        "seeds": [0, 1],
        "final_runs": 30,
        "final_points": 15,
        "points_with_repeats": 15,
        "sd": pytest.approx(0.01 * math.sqrt(22), rel=1e-9),
    }
    assert res["n_used"] == 30
    # without the seed column each LR's lowest run is its lucky draw, and the optima move
    unseeded = fit_all([{k: v for k, v in r.items() if k != "seed"} for r in records])
    assert unseeded["seeds"] is None
    moved = np.array(unseeded["hparams"]["lr"]["best"]) / np.array(law["best"])
    assert (moved > 1.05).all()


def test_one_seed_or_none_averages_nothing():
    for records in (seeded_lr_grid(seeds=(3,)), make_sweep()):
        res = fit_all(records)
        assert res["seeds"] is None
        assert res["n_used"] == len(records)


def test_within_a_seed_the_lowest_of_runs_the_records_cannot_tell_apart_is_taken():
    from sweeper.scaling.records import average_seeds, to_points

    point = {"N": 1e6, "C": 1e12, "budget": 1e12, "lr": 0.02, "final": True}
    # seed 0 ran twice (another weight decay, say): 3.0 and 3.4; seed 1 once: 3.2
    records = [{**point, "loss": y, "seed": s} for y, s in ((3.0, 0), (3.4, 0), (3.2, 1))]
    pts, info = average_seeds(to_points(records))
    assert list(pts.loss) == pytest.approx([3.1])
    assert pts.by_seed == [{0.0: 3.0, 1.0: 3.2}]  # each seed's lowest
    assert info["sd"] == pytest.approx(np.std([3.0, 3.2], ddof=1))
    # a record without a seed stays a point of its own
    pts, _ = average_seeds(to_points(records + [{**point, "loss": 2.5}]))
    assert sorted(pts.loss) == pytest.approx([2.5, 3.1])


@pytest.mark.parametrize("wobble, named", [(0.05, True), (0.0001, False)])
def test_an_optimum_not_best_on_every_seed_is_named(wobble, named):
    # the best LR leads its neighbours by 0.05 * ln(2)^2 = 0.024 in the mean; seed 1 puts
    # +wobble on it and -wobble on them, so at 0.05 it loses there
    res = fit_all(seeded_lr_grid(wobble=wobble))
    notes = [w for w in res["warnings"] if "not resolved" in w]
    assert bool(notes) == named
    if named:
        assert len(notes) == 3
        # both neighbours lose to the best in the mean and win on seed 1; the LRs two steps
        # away lose on both seeds
        assert notes[0] == (
            f"lr-vs-compute: at C = 1e+12 the best ({lr_opt(1e12):.4g}) beats the next "
            f"({lr_opt(1e12) / 2:.4g}) on 1 of 2 seeds: not resolved; nor against "
            f"{lr_opt(1e12) * 2:.4g} (the best won on 1 of 2 seeds)"
        )
        spread = [0.5, 2.0]
    else:
        spread = [1.0, 1.0]
    within = np.array(res["hparams"]["lr"]["within_noise"])
    expected = [[lr_opt(c) * f for f in spread] for c in (1e12, 1e13, 1e14)]
    assert within == pytest.approx(np.array(expected))


def test_luck_a_seed_shares_across_the_grid_does_not_unresolve_an_optimum():
    # seed 1 trains 0.5 worse at every point (its data order, say): single runs spread
    # widely, but every seed ranks the LRs the same way
    records = seeded_lr_grid(wobble=0.0)
    for r in records:
        r["loss"] += 0.5 * r["seed"]
    res = fit_all(records)
    assert res["seeds"]["sd"] == pytest.approx(0.5 / math.sqrt(2))
    assert not [w for w in res["warnings"] if "not resolved" in w]
    assert res["hparams"]["lr"]["best"] == pytest.approx([lr_opt(c) for c in (1e12, 1e13, 1e14)])


def test_each_seed_alone_is_fitted_as_if_it_were_the_only_one(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from sweeper.scaling.plots import plot_hparams
    from sweeper.scaling.records import average_seeds, to_points
    from sweeper.scaling.summary import format_summary

    # seed 0's best LR grows linearly with the batch, seed 1's as its square root: the mean
    # lies between them, and each seed's own fit must say which is which
    lrs = [0.001 * 2**k for k in range(9)]
    runs = {0: lr_by_batch_grid(1.0, lrs), 1: lr_by_batch_grid(0.5, lrs)}
    for seed, records in runs.items():
        for r in records:
            r["seed"] = seed
            r["loss"] += 0.01 * seed * math.log(r["lr"])  # seed 1 leans to lower LRs too
    res = fit_all(runs[0] + runs[1], target_flops=1e16)
    for seed, records in runs.items():
        alone = fit_all(
            [{k: v for k, v in r.items() if k != "seed"} for r in records], target_flops=1e16
        )
        own = res["hparams"]["lr"]["per_seed"][seed]
        law = alone["hparams"]["lr"]
        assert own["seed"] == seed
        assert own["p"] == pytest.approx(law["p"], rel=1e-12)
        assert own["best"] == pytest.approx(law["best"], rel=1e-12)
        assert own["prediction"] == pytest.approx(alone["predictions"]["lr_opt"], rel=1e-12)
        g = res["lr_vs_batch"]["per_seed"][seed]
        assert g == {"seed": seed, "exponent": pytest.approx(alone["lr_vs_batch"]["exponent"])}
    # the parabola through an exact quadratic finds each seed's own slope
    assert [e["exponent"] for e in res["lr_vs_batch"]["per_seed"]] == pytest.approx([1.0, 0.5])
    assert 0.5 < res["lr_vs_batch"]["exponent"] < 1.0
    # seed 1's tilt moves its optima, so the seeds' laws differ
    p0, p1 = (e["p"] for e in res["hparams"]["lr"]["per_seed"])
    assert p0 != pytest.approx(p1, abs=1e-3)

    text = format_summary(res)
    assert f"  each seed alone: C^{p0:.3f} (seed 0), C^{p1:.3f} (seed 1)" in text
    assert "  each seed alone: g = 1.00 (seed 0), 0.50 (seed 1)" in text
    own = [e["prediction"] for e in res["hparams"]["lr"]["per_seed"]]
    assert f"(each seed's own law: {own[0]:.4g}, {own[1]:.4g})" in text

    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    plot_hparams(res, tmp_path / "h.png", average_seeds(to_points(runs[0] + runs[1]))[0])
    law_panel = drawn[0].axes[1]
    grey = [line for line in law_panel.get_lines() if line.get_linestyle() == "--"]
    assert len(grey) == 2
    c = np.asarray(grey[1].get_xdata())
    assert list(grey[1].get_ydata()) == pytest.approx(own_law(res, 1, c))


def own_law(res: dict, seed: int, c: np.ndarray) -> np.ndarray:
    entry = res["hparams"]["lr"]["per_seed"][seed]
    return entry["k"] * c ** entry["p"]


def test_a_seed_whose_optima_are_all_grid_ends_has_no_law_of_its_own():
    from sweeper.scaling.summary import format_summary

    records = seeded_lr_grid(seeds=(0, 1, 2), wobble=0.0)
    for r in records:
        if r["seed"] == 2:  # the higher the LR, the lower its loss, at every budget
            r["loss"] -= 0.1 * math.log2(r["lr"] / lr_opt(r["C"]))
    res = fit_all(records)
    law = res["hparams"]["lr"]
    assert law["p"] is not None  # the means still bottom out inside the grid
    assert [e["p"] is None for e in law["per_seed"]] == [False, False, True]
    assert law["per_seed"][0]["p"] == pytest.approx(LR_EXP, rel=1e-9)
    assert law["per_seed"][2]["best"] is None
    assert f"C^{LR_EXP:.3f} (seed 1), no law (seed 2)" in format_summary(res)


def test_without_seeds_there_is_no_per_seed_fit():
    res = fit_all(seeded_lr_grid(seeds=(3,)), target_flops=1e16)
    assert "per_seed" not in res["hparams"]["lr"]


def test_the_summary_and_the_hparams_plot_show_the_seeds(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from sweeper.scaling.plots import plot_hparams
    from sweeper.scaling.records import average_seeds, to_points
    from sweeper.scaling.summary import format_summary

    records = seeded_lr_grid()
    res = fit_all(records)
    text = format_summary(res)
    assert "Seeds 0, 1: runs that differ only in their seed are fitted as their mean" in text
    assert "(30 final runs -> 15 points)" in text
    assert f"sd {0.01 * math.sqrt(2):.4f} (a mean of 2: +- 0.0100)" in text
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    pts, _ = average_seeds(to_points(records))
    plot_hparams(res, tmp_path / "h.png", pts)
    ax = drawn[0].axes[0]
    solid = [line for line in ax.get_lines() if line.get_linestyle() == "-"]
    # the first budget's curve is its means (the noise-free parabola) above their lowest
    mults = (0.25, 0.5, 1.0, 2.0, 4.0)
    assert list(solid[0].get_ydata()) == pytest.approx([0.05 * math.log(m) ** 2 for m in mults])
    # and each seed's own curve, dashed, above its own lowest: +-0.01 at alternate LRs
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    assert len(dashed) == 2 * 3  # two seeds at each of three budgets
    for seed, line in enumerate(dashed[:2]):
        sign = [(1 if seed == 0 else -1) * (1 if j % 2 else -1) for j in range(len(mults))]
        own = np.array([0.05 * math.log(m) ** 2 + 0.01 * g for m, g in zip(mults, sign)])
        assert list(line.get_ydata()) == pytest.approx(own - own.min())
    assert "mean over seeds (dashed: each seed's own)" in ax.get_title()


def test_the_predicted_run_is_the_sweeps_config_at_the_target_with_the_laws_values():
    from sweeper.config.compose import compose
    from sweeper.config.schema import load_run_config
    from sweeper.report.fit import predicted_run
    from sweeper.sweep.preflight import build_plan

    cfg = compose(["+sweep=lr_bs_scaling"])
    base = build_plan(cfg).base
    sequence = base["model"]["seq_len"]  # 256 tokens; micro-batches of 2 sequences

    def run(predictions, points=()):
        overrides = predicted_run({"target_flops": 1e15, "predictions": predictions}, base, points)
        return None if overrides is None else load_run_config(compose(overrides))

    both = run({"lr_opt": 0.0123456, "batch_size_opt": 4.2 * sequence})
    assert both.trainer.budget_flops == 1e15 and both.trainer.budget_tokens is None
    assert both.optimizer.matrix_lr == 0.01235  # 4 significant digits
    assert both.trainer.total_batch_size == 4 * sequence  # the nearest whole sequences
    assert both.trainer.device_batch_size == 2  # the sweep's micro-batch divides it
    # 3 sequences: no whole number of micro-batches of 2, so micro-batches of 1, as the
    # sweep's trials would have run it
    three = run({"batch_size_opt": 2.9 * sequence}).trainer
    assert (three.total_batch_size, three.device_batch_size) == (3 * sequence, 1)
    # nearest on a log scale: 1.45 sequences is 2 (x1.38), not 1 (x1.45)
    assert run({"batch_size_opt": 1.45 * sequence}).trainer.total_batch_size == 2 * sequence
    assert run({"batch_size_opt": 0.2 * sequence}).trainer.total_batch_size == sequence  # >= 1
    # an LR law but no batch law over a batch grid: the best batch at the largest budget
    grid = [
        {
            "N": 3e6,
            "C": c,
            "loss": 3 + abs(b - 1024) / 1e4 - c / 1e13,
            "budget": c,
            "lr": 0.02,
            "batch_size": b,
            "final": True,
        }
        for c in (1e12, 1e13)
        for b in (512, 1024, 2048)
    ]
    assert run({"lr_opt": 0.01}, grid).trainer.total_batch_size == 1024
    assert run({"lr_opt": 0.01}).trainer.total_batch_size == base["trainer"]["total_batch_size"]
    assert run({"frontier_loss": 2.0}) is None  # no hyperparameter law: nothing to run
    assert predicted_run({"target_flops": 1e15, "predictions": {"lr_opt": 0.01}}, {}, []) is None


def test_a_predicted_batch_the_run_cannot_take_is_said_beside_the_run():
    from sweeper.config.compose import compose
    from sweeper.report.fit import predicted_run, predicted_run_note
    from sweeper.sweep.preflight import build_plan

    cfg = compose(["+sweep=lr_bs_scaling"])
    base = build_plan(cfg).base  # sequences of 256 tokens

    def note(batch):
        result = {"target_flops": 1e15, "predictions": {"lr_opt": 0.01, "batch_size_opt": batch}}
        result["predicted_run"] = predicted_run(result, base, [])
        return predicted_run_note(result, [])

    assert note(180.3) == (
        "(the batch law predicts 180.3 tokens; the run takes 256, the nearest whole number of "
        "sequences (model.seq_len tokens) on a log scale, at least one)"
    )
    assert note(377.5).startswith("(the batch law predicts 377.5 tokens; the run takes 512,")
    assert note(700.0) is None  # 768: within 10% of the law
    assert note(1500.0) is None  # 1536
    assert (
        predicted_run_note({"predictions": {"lr_opt": 0.01}, "predicted_run": ["x=1"]}, []) is None
    )
    # no batch law: the best batch at the largest budget (256, one sequence) in a config
    # whose micro-batches hold two: the run takes it in micro-batches of one, as the grid did
    grid = [
        {"N": 3e6, "C": c, "budget": c, "lr": 0.01, "batch_size": b, "final": True,
         "loss": 3 + b / 1e4 - c / 1e13}
        for c in (1e12, 1e13) for b in (256, 512, 1024)
    ]  # fmt: skip
    result = {"target_flops": 1e15, "predictions": {"lr_opt": 0.01}}
    result["predicted_run"] = predicted_run(result, base, grid)
    assert "trainer.total_batch_size=256" in result["predicted_run"]
    assert "trainer.device_batch_size=1" in result["predicted_run"]
    assert predicted_run_note(result, grid) is None


def margin_grid(margins: list[float], far: list[float] | None = None) -> list[dict]:
    """LRs 0.01, 0.02, 0.04 at two budgets on len(margins) seeds: 0.02 is best, and on
    seed s the next best (0.01) trails it by margins[s]; 0.04 trails by far[s] (1)."""
    records = []
    far = far or [1.0] * len(margins)
    for c in (1e12, 1e13):
        for s, margin in enumerate(margins):
            luck = 0.3 * s  # a seed's own luck, shared by its runs
            for lr, extra in ((0.01, margin), (0.02, 0.0), (0.04, far[s])):
                loss = 3.0 + luck + extra
                records.append({"N": 3e6, "C": c, "budget": c, "lr": lr, "loss": loss,
                                "final": True, "seed": s})  # fmt: skip
    return records


def test_from_three_seeds_a_paired_interval_decides_whether_an_optimum_is_resolved():
    # five seeds, four clear wins and one loss by a hair: two seeds' "all must agree" would
    # call it unresolved; the paired interval does not (mean 0.0428, sd 0.0252: lower
    # bound 0.0428 - t(0.95, 4) 0.0113 = 0.0188 with t(0.95, 4) = 2.132)
    clear = fit_all(margin_grid([0.05, 0.06, 0.055, 0.05, -0.001]))
    assert not [w for w in clear["warnings"] if "not resolved" in w]
    # three seeds that all agree, by margins that scatter: mean 0.1003, sd 0.0995, lower
    # bound 0.1003 - 2.920 * 0.0995 / sqrt(3) = -0.0674 (t(0.95, 2) = 2.920)
    res = fit_all(margin_grid([0.001, 0.1, 0.2]))
    notes = [w for w in res["warnings"] if "not resolved" in w]
    margins = np.array([0.001, 0.1, 0.2])
    lower = margins.mean() - 2.919986 * margins.std(ddof=1) / math.sqrt(3)
    assert notes == [
        f"lr-vs-compute: at C = {c:.3g} the best (0.02) beats the next (0.01) by 0.1 on "
        f"average over 3 seeds (won on 3), but the paired 95% lower bound is {lower:.3g}: "
        "not resolved"
        for c in (1e12, 1e13)
    ]


def test_every_value_the_best_does_not_clearly_beat_is_named_not_only_the_next():
    t2 = 2.919986  # t(0.95, 2)

    def lower(m):
        m = np.array(m)
        return m.mean() - t2 * m.std(ddof=1) / math.sqrt(len(m))

    # 0.01 trails clearly on every seed; 0.04, further behind in the mean, scatters
    far = [0.3, 0.001, 0.2]
    res = fit_all(margin_grid([0.05, 0.06, 0.055], far))
    notes = [w for w in res["warnings"] if "not resolved" in w]
    assert notes[0] == (
        f"lr-vs-compute: at C = 1e+12 the best (0.02) beats 0.04 by {np.mean(far):.3g} on "
        f"average over 3 seeds (won on 3), but the paired 95% lower bound is {lower(far):.3g}: "
        "not resolved"
    )
    # the range runs from the optimum (the parabola's vertex, below 0.02 here) to 0.04
    law = res["hparams"]["lr"]
    assert all(v < 0.02 for v in law["best"])
    assert law["within_noise"] == [[v, 0.04] for v in law["best"]]
    # both unresolved: the next first, then the other
    near = [0.001, 0.1, 0.2]
    res = fit_all(margin_grid(near, [0.3, 0.001, 0.25]))
    notes = [w for w in res["warnings"] if "not resolved" in w]
    assert notes[0].endswith(
        f"lower bound is {lower(near):.3g}: not resolved; nor against 0.04 (paired lower bound "
        f"{lower([0.3, 0.001, 0.25]):.3g})"
    )
    assert res["hparams"]["lr"]["within_noise"] == [[0.01, 0.04], [0.01, 0.04]]
    # all resolved: the range is the optimum alone
    law = fit_all(margin_grid([0.05, 0.06, 0.055]))["hparams"]["lr"]
    assert law["within_noise"] == [[v, 0.02] for v in law["best"]]


def test_the_hparams_plot_draws_the_values_within_the_noise(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from sweeper.scaling.plots import plot_hparams
    from sweeper.scaling.records import average_seeds, to_points

    records = margin_grid([0.001, 0.1, 0.2], [0.3, 0.001, 0.25])
    res = fit_all(records)
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: drawn.append(fig))
    plot_hparams(res, tmp_path / "h.png", average_seeds(to_points(records))[0])
    bars = [line for line in drawn[0].axes[1].get_lines() if line.get_linewidth() == 6]
    assert [list(b.get_xdata()) for b in bars] == [[1e12, 1e12], [1e13, 1e13]]
    assert [list(b.get_ydata()) for b in bars] == [[0.01, 0.04], [0.01, 0.04]]


def test_in_a_joint_grid_lrs_are_compared_at_the_best_batch_and_batches_at_their_best_lr():
    # the best LR is 0.02 at batch 512 and 0.04 at 1024; each seed's luck is its own at
    # each batch (another batch, another data order): seed 0 is 0.02 better at 512 and
    # 0.02 worse at 1024, seed 1 the other way round by 0.03
    luck = {(0, 512): -0.02, (0, 1024): 0.02, (1, 512): 0.03, (1, 1024): -0.03}
    records = [
        {"N": 3e6, "C": c, "budget": c, "lr": lr, "batch_size": b, "final": True, "seed": s,
         "loss": 3.0 + 0.05 * math.log(lr / (0.02 if b == 512 else 0.04)) ** 2 + luck[s, b]}
        for c in (1e12, 1e13) for b in (512, 1024) for lr in (0.01, 0.02, 0.04) for s in (0, 1)
    ]  # fmt: skip
    notes = [w for w in fit_all(records)["warnings"] if "not resolved" in w]
    # batch 1024 (at LR 0.04) against 512 (at its best LR, 0.02): the seeds split
    assert notes == [
        f"batch_size-vs-compute: at C = {c:.3g} the best (1024) beats the next (512) on 1 of 2 "
        "seeds: not resolved"
        for c in (1e12, 1e13)
    ]
    # at batch 1024, LR 0.04 beats 0.02 on both seeds; compared with 0.02 at its own best
    # batch (512), the batch split would have read as an LR split too


def test_one_model_size_is_named_as_why_the_size_fits_are_skipped():
    # an LR grid at three budgets: plenty of points, but every run has N = 3e6
    warnings = fit_all(seeded_lr_grid(seeds=(0,)))["warnings"]
    assert "parametric: a single model size N = 3e+06 (need >= 2); L(N, D) not fitted" in warnings
    isoflop = [w for w in warnings if w.startswith("isoflop")]
    assert isoflop == [
        "isoflop: a single model size N = 3e+06 at every budget (need >= 3 per budget); skipped"
    ]


def test_an_excluded_isoflop_vertex_far_off_the_sizes_tried_is_not_drawn(tmp_path, monkeypatch):
    """A budget's parabola can put its (excluded) vertex decades away, at a negative loss:
    drawn, it stretched the plot over 9 decades. One inside the sizes tried is drawn, as
    an x, with no edge colour for matplotlib to warn about."""
    import warnings

    from matplotlib.axes import Axes

    from sweeper.scaling.plots import plot_isoflop
    from sweeper.scaling.records import to_points

    records = make_sweep()
    res = fit_all(records)
    profiles = [p for p in res["isoflop"]["profiles"] if p.get("coeffs")]
    far, near = profiles[0], profiles[1]
    far.update(valid=False, n_opt=3.5e-4, loss_opt=-0.26)
    near.update(valid=False, n_opt=float(np.sqrt(np.prod(near["n_range"]))))
    drawn = []
    scatter = Axes.scatter
    monkeypatch.setattr(
        Axes,
        "scatter",
        lambda ax, x, y, **kw: drawn.append((x[0], kw.get("marker"))) or scatter(ax, x, y, **kw),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_isoflop(res, to_points(records), tmp_path / "isoflop.png")
    vertices = {x: marker for x, marker in drawn if marker in ("*", "x")}
    assert far["n_opt"] not in vertices and vertices[near["n_opt"]] == "x"


def test_a_frontier_of_reports_before_their_schedules_end_says_so():
    """One budget's sweep: the envelope is a learning curve, points before its decay."""
    curve = [{"C": c, "loss": 2.0 + 3e3 * c**-0.3, "final": False} for c in np.logspace(9, 12, 8)]
    curve[-1]["final"] = True
    res = fit_all(curve)
    assert res["frontier"] is not None
    assert any("7 of its 8 points are reports from before" in w for w in res["warnings"]), res[
        "warnings"
    ]
    annealed = [{**point, "final": True} for point in curve]  # a run per budget, each ended
    assert not any("before their run's" in w for w in fit_all(annealed)["warnings"])
