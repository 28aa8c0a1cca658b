"""Scaling-law fits for sweep results (numpy/scipy/matplotlib only).

    from sweeper.scaling import fit_all, plot_all
    result = fit_all(records, target_flops=1e21, bootstrap=1000)   # JSON-serialisable dict
    plot_all(result, records, "out/")                              # PNGs

Lower-level pieces: fit_frontier / lower_envelope (L(C) = E + A C^-alpha), fit_chinchilla
(L(N, D) = E + A/N^alpha + B/D^beta), fit_isoflop / fit_power_law (IsoFLOP optima and
optimal hyperparameters vs compute), bootstrap_* (percentile CIs).
"""

from .analysis import DEFAULT_CONVENTIONS, fit_all
from .bootstrap import bootstrap_chinchilla, bootstrap_frontier, percentile_ci
from .frontier import FrontierFit, fit_frontier, lower_envelope
from .isoflop import (
    IsoFlopFit,
    IsoFlopProfile,
    PowerLawFit,
    fit_hparam_vs_compute,
    fit_isoflop,
    fit_power_law,
    fit_profile,
    group_by_budget,
    optima_exponent,
)
from .laws import (
    ChinchillaFit,
    compute_optimal,
    fit_chinchilla,
    huber_objective,
    start_grid,
)
from .plots import plot_all
from .records import InputError, read_csv_records, to_points

__all__ = [
    "DEFAULT_CONVENTIONS",
    "ChinchillaFit",
    "FrontierFit",
    "InputError",
    "IsoFlopFit",
    "IsoFlopProfile",
    "PowerLawFit",
    "bootstrap_chinchilla",
    "bootstrap_frontier",
    "compute_optimal",
    "fit_all",
    "fit_chinchilla",
    "fit_frontier",
    "fit_hparam_vs_compute",
    "fit_isoflop",
    "fit_power_law",
    "fit_profile",
    "group_by_budget",
    "huber_objective",
    "lower_envelope",
    "optima_exponent",
    "percentile_ci",
    "plot_all",
    "read_csv_records",
    "start_grid",
    "to_points",
]
