"""Validation against published data in ../shared/reference-data (skipped where absent).

The data are read in place and never copied into the project (see that folder's README).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sweeper.scaling import fit_chinchilla, fit_frontier, fit_isoflop, optima_exponent

REF = Path(__file__).resolve().parents[2] / "shared" / "reference-data"
SRC = Path(__file__).resolve().parents[1] / "src"
EPOCH = REF / "chinchilla_epoch_svg_extracted.csv"
PORIAN_OPTIMA = REF / "porian2024_isoflop_optima.csv"
PORIAN_POINTS = REF / "porian2024_isoflop_points.csv"
# The configuration quoted in the README: a = 0.4970 by OLS over their optima.
PORIAN_CONFIG = {
    "dataset": "rw",
    "hparams": "tuned",
    "warmup": "short",
    "decay": "const",
    "param_count": "standard",
}


def need(path: Path) -> Path:
    if not path.is_file():
        pytest.skip(f"reference data not available: {path}")
    return path


def epoch_points():
    """Epoch's 245 points minus the 5 highest losses (their procedure): 240 (N, D, L)."""
    with open(need(EPOCH), newline="") as fh:
        rows = list(csv.DictReader(fh))
    n = np.array([float(r["Model Size"]) for r in rows])
    c = np.array([float(r["Training FLOP"]) for r in rows])
    loss = np.array([float(r["loss"]) for r in rows])
    keep = np.argsort(loss, kind="stable")[:-5]
    return n[keep], c[keep] / (6 * n[keep]), loss[keep]


def porian_rows(path: Path) -> list[dict]:
    with open(need(path), newline="") as fh:
        return [r for r in csv.DictReader(fh) if all(r[k] == v for k, v in PORIAN_CONFIG.items())]


def test_epoch_chinchilla_via_cli(tmp_path):
    need(EPOCH)
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sweeper.fit",
            str(EPOCH),
            "--json",
            "--drop-highest",
            "5",
            "--no-plots",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    par = json.loads(proc.stdout)["parametric"]
    assert par["n_points"] == 240
    assert par["E"] == pytest.approx(1.8172, rel=0.01)
    assert par["alpha"] == pytest.approx(0.3473, rel=0.01)
    assert par["beta"] == pytest.approx(0.3672, rel=0.01)
    assert par["A"] == pytest.approx(477.8, rel=0.10)
    assert par["B"] == pytest.approx(2143.0, rel=0.10)
    assert par["grad_norm"] < 1e-5


def test_epoch_single_start_reaches_the_same_optimum():
    n, d, loss = epoch_points()
    grid = fit_chinchilla(n, d, loss)
    single = fit_chinchilla(n, d, loss, x0=[6.0, 7.0, 0.5, 0.3, 0.3])
    assert single.objective == pytest.approx(grid.objective, rel=1e-9)
    assert single.alpha == pytest.approx(grid.alpha, rel=1e-5)


@pytest.mark.slow
def test_epoch_best_64_starts_match_the_full_4500_start_grid():
    """Refining only the 64 starts with the lowest initial objective (the default) finds the
    optimum that refining all 4500 finds (Hoffmann et al.'s procedure); ~30 s."""
    n, d, loss = epoch_points()
    top = fit_chinchilla(n, d, loss)
    full = fit_chinchilla(n, d, loss, n_refine=None)
    assert full.n_refined == 4500
    assert top.objective <= full.objective * (1 + 1e-9)
    for key in ("E", "A", "B", "alpha", "beta"):
        assert getattr(top, key) == pytest.approx(getattr(full, key), rel=1e-5)


def test_porian_ols_over_published_optima():
    rows = porian_rows(PORIAN_OPTIMA)
    assert len(rows) == 12
    flops = [float(r["flops"]) for r in rows]
    n_opt = [float(r["n_opt"]) for r in rows]
    assert optima_exponent(flops, n_opt) == pytest.approx(0.4970, abs=5e-4)


def test_porian_frontier_over_published_optima():
    rows = porian_rows(PORIAN_OPTIMA)
    c = np.array([float(r["flops"]) for r in rows])
    loss = np.array([float(r["loss_opt"]) for r in rows])
    sel = (c > 1e16) & (c < 5e17)
    fit = fit_frontier(c[sel], loss[sel])
    assert fit.E == pytest.approx(2.006, abs=0.002)
    assert fit.A == pytest.approx(128.9, rel=0.01)
    assert fit.alpha == pytest.approx(0.106, abs=0.001)


def test_porian_parabola_method_on_raw_points():
    """Parabolas on the raw points give a different a than their optima (README: 0.01-0.08
    away); ours is 0.514. The method matters, so the result records it."""
    rows = porian_rows(PORIAN_POINTS)
    n, d, loss, c = (
        np.array([float(r[k]) for r in rows]) for k in ("n", "tokens", "loss", "flops")
    )
    fit = fit_isoflop(n, loss, c, budget=[r["flops"] for r in rows], d=d)
    assert len(fit.profiles) == 12 and all(p.valid for p in fit.profiles)
    assert 0.005 < abs(fit.n_opt_law.p - 0.4970) < 0.08
    assert "parabola" in fit.to_dict()["method"]
