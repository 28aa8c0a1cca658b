"""`python -m sweeper.fit`: column detection, sweep directories, --json, bad input -> exit 2."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sweeper.fit import main
from sweeper.scaling.records import InputError, detect_columns

from .conftest import run_cli_into_closed_pipe

SRC = Path(__file__).resolve().parents[1] / "src"


def run_fit(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-m", "sweeper.fit", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    return path


def put(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def law_rows(n_sizes=6, n_tokens=6):
    rows = []
    for n in np.logspace(7, 9, n_sizes):
        for d in np.logspace(9, 11, n_tokens):
            rows.append([n, 6 * n * d, 1.7 + 400 / n**0.34 + 410 / d**0.28])
    return rows


def test_detect_columns_aliases():
    header = ["x", "Model Size", "Training FLOP", "val_bpb", "FLOPs budget", "Learning rate"]
    m = detect_columns(header)
    assert m == {
        "N": "Model Size",
        "C": "Training FLOP",
        "loss": "val_bpb",
        "budget": "FLOPs budget",
        "lr": "Learning rate",
    }
    assert detect_columns(["params", "tokens", "val_bpb", "train_loss"])["loss"] == "val_bpb"
    assert detect_columns(["size", "y"], explicit={"N": "size", "loss": "Y"}) == {
        "N": "size",
        "loss": "y",
    }
    with pytest.raises(InputError):
        detect_columns(["a"], explicit={"loss": "nope"})


def test_cli_into_a_closed_pipe_still_writes_the_fit(tmp_path):
    """`python -m sweeper.fit runs.csv | head -1`: the fit's files are written before its
    summary is printed, and the reader quitting ends the command without a traceback."""
    src = write_csv(tmp_path / "runs.csv", ["params", "FLOPs", "loss"], law_rows())
    args = [str(src), "--no-plots", "--out", str(tmp_path / "o")]
    proc = run_cli_into_closed_pipe(args, tmp_path, module="sweeper.fit")
    assert proc.returncode == -signal.SIGPIPE, proc.stderr
    assert proc.stderr == ""
    assert json.loads((tmp_path / "o" / "fit.json").read_text())["parametric"]["alpha"] > 0


def test_cli_json_on_csv_with_n_and_c(tmp_path):
    src = write_csv(tmp_path / "runs.csv", ["params", "FLOPs", "loss"], law_rows())
    proc = run_fit(src, "--json", "--no-plots", "--target-flops", "1e21", "--out", tmp_path / "o")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["conventions"] == {"params": "total", "flops": "given", "loss_unit": "nats"}
    assert res["parametric"]["alpha"] == pytest.approx(0.34, rel=0.01)
    assert res["predictions"]["parametric_N_opt"] > 0
    assert json.loads((tmp_path / "o" / "fit.json").read_text()) == res


def test_cli_summary_and_plots_default_out_in_cwd(tmp_path):
    src = write_csv(
        tmp_path / "runs.csv",
        ["N", "D", "val_loss"],
        [[n, c / (6 * n), y] for n, c, y in law_rows()],
    )
    work = tmp_path / "work"
    work.mkdir()
    proc = run_fit(src, "--params-convention", "non_embedding", cwd=work)
    assert proc.returncode == 0, proc.stderr
    assert "Parametric law" in proc.stdout and "alpha = 0.34" in proc.stdout
    out = work / "runs-fit"
    assert (out / "fit.json").is_file() and (out / "frontier.png").is_file()
    res = json.loads((out / "fit.json").read_text())
    assert res["conventions"]["params"] == "non_embedding" and res["conventions"]["flops"] == "6ND"


def test_cli_reads_sweep_directory(tmp_path):
    header = [
        "trial_id",
        "stage",
        "status",
        "step",
        "tokens",
        "flops",
        "params",
        "val_bpb",
        "train_loss",
        "lr",
        "total_batch_size",
        "budget",
        "final",
    ]
    rows = []
    for i, (n, c, y) in enumerate(law_rows()):
        d = c / (6 * n)
        rows.append(
            [f"t{i}", "s0", "TERMINATED", 10, d / 2, c / 2, n, y + 0.1, y, 1e-3, 256, "", "False"]
        )
        rows.append([f"t{i}", "s0", "TERMINATED", 20, d, c, n, y, y, 1e-3, 256, "", "True"])
    rows.append(["tx", "s0", "ERROR", 5, 1e9, 1e18, 1e8, "nan", "", 1e-3, 256, "", "False"])
    write_csv(tmp_path / "reports.csv", header, rows)
    proc = run_fit(tmp_path, "--json", "--no-plots")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    # labelled as the sweep's own fit.json labels them, which this refit replaces
    sweeps_own = {"params": "total", "flops": "per_token_with_attention", "loss_unit": "val_bpb"}
    assert res["conventions"] == sweeps_own
    assert (
        res["parametric"]["n_points"] == 36 and res["parametric"]["n_excluded_intermediate"] == 36
    )
    assert any("dropped 1 of 73" in w for w in res["warnings"])
    assert (tmp_path / "fit.json").is_file()

    # the flags label a CSV's columns and convert nothing: a sweep's N is total params
    before = (tmp_path / "fit.json").read_text()
    proc = run_fit(tmp_path, "--params-convention", "non_embedding")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --params-convention non_embedding: a sweep's run dir holds total (the "
        "flag names what a CSV's columns hold; it converts nothing)"
    ]
    assert (tmp_path / "fit.json").read_text() == before


def lr_grid_sweep_dir(
    path: Path, overrides: list[str] | None, seed: int | None = None, luck: float = 0.0
) -> Path:
    """A sweep run dir as `+sweep=lr_scaling` leaves it: reports.csv's final rows of an LR
    grid at 2 budgets, and the overrides Hydra kept (None: no .hydra directory). With a
    seed, reports.csv has a seed column (sweeps before it had none), and every loss is
    `luck` off the noise-free one."""
    header = ["trial_id", "params", "tokens", "flops", "val_bpb", "budget", "peak_lr"]
    header += ["total_batch_size", "final"] + ([] if seed is None else ["seed"])
    rows = [
        [
            f"t{i}",
            3e6,
            c / 1.8e7,
            c,
            3.0 - 0.1 * np.log10(c) + 0.05 * np.log(m) ** 2 + luck,
            c,
            0.04 * m * (c / 1e12) ** -0.3,
            2048,
            "True",
        ]
        + ([] if seed is None else [seed])
        for i, (c, m) in enumerate((c, m) for c in (1e12, 1e13) for m in (0.25, 0.5, 1, 2, 4))
    ]
    path.mkdir(exist_ok=True)
    write_csv(path / "reports.csv", header, rows)
    if overrides is not None:
        (path / ".hydra").mkdir()
        (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return path


def test_a_sweep_dirs_refit_predicts_at_its_target_and_names_the_run_there(tmp_path):
    kept = ["+sweep=lr_scaling", "trainer.device_batch_size=4", "hydra.run.dir=elsewhere"]
    proc = run_fit(lr_grid_sweep_dir(tmp_path, kept), "--no-plots")
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "fit.json").read_text())
    assert res["target_flops"] == 1e15  # lr_scaling's fit.target_flops
    lr_opt = res["predictions"]["lr_opt"]
    assert lr_opt == pytest.approx(0.04 * 1000**-0.3, rel=1e-6)
    run = res["predicted_run"]
    assert f"optimizer.matrix_lr={float(format(lr_opt, '.4g'))!r}" in run
    assert "trainer.device_batch_size=4" in run and "trainer.total_batch_size=2048" in run
    assert "Run it at C = 1e+15 FLOPs:\n  python -m sweeper " in proc.stdout
    # --target-flops still wins
    proc = run_fit(tmp_path, "--no-plots", "--target-flops", "1e14")
    assert json.loads((tmp_path / "fit.json").read_text())["target_flops"] == 1e14


@pytest.mark.parametrize("overrides", [None, ["+sweep=no_such_sweep"]])
def test_a_refit_without_the_sweeps_config_fits_without_a_run(tmp_path, overrides):
    proc = run_fit(lr_grid_sweep_dir(tmp_path, overrides), "--no-plots")
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "fit.json").read_text())
    assert res["hparams"]["lr"]["p"] == pytest.approx(-0.3)
    assert res["target_flops"] is None and "predicted_run" not in res
    assert "Run it" not in proc.stdout


def test_several_sweep_dirs_are_fitted_as_one_set_of_runs_on_their_seeds(tmp_path):
    # the same sweep on seed 0 from before reports.csv had a seed column (its seed is the
    # sweep's trainer.seed), and on seed 1, 0.04 worse at every point
    first = lr_grid_sweep_dir(tmp_path / "s0", ["+sweep=lr_scaling"], luck=-0.02)
    second = lr_grid_sweep_dir(tmp_path / "s1", ["+sweep=lr_scaling", "trainer.seed=1"], 1, 0.02)
    proc = run_fit(first, second, "--no-plots", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "combined-fit" / "fit.json").read_text())
    assert res["seeds"]["seeds"] == [0, 1] and res["seeds"]["final_runs"] == 20
    assert res["seeds"]["final_points"] == 10 and res["seeds"]["sd"] == pytest.approx(0.04 / 2**0.5)
    assert res["hparams"]["lr"]["p"] == pytest.approx(-0.3)
    assert "Seeds 0, 1:" in proc.stdout and "Run it at C = 1e+15 FLOPs:" in proc.stdout
    assert not (first / "fit.json").exists() and not (second / "fit.json").exists()
    assert res["inputs"] == sorted([str(first), str(second)])
    # the same inputs fit again into ./combined-fit; other inputs do not overwrite it
    assert run_fit(second, first, "--no-plots", cwd=tmp_path).returncode == 0
    kept = (tmp_path / "combined-fit" / "fit.json").read_text()
    third = lr_grid_sweep_dir(tmp_path / "s2", ["+sweep=lr_scaling", "trainer.seed=2"], 2, 0.0)
    proc = run_fit(first, third, "--no-plots", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        f"error: {tmp_path / 'combined-fit'} holds the fit of other inputs ({first}, {second}): "
        "name another directory with --out DIR, or remove it\n"
    )
    assert (tmp_path / "combined-fit" / "fit.json").read_text() == kept
    other = run_fit(first, second, "--no-plots", "--out", tmp_path / "other", cwd=tmp_path)
    assert other.returncode == 0 and (tmp_path / "other" / "fit.json").is_file()


def test_a_fit_out_into_another_sweeps_dir_keeps_that_sweeps_fit(tmp_path):
    first = lr_grid_sweep_dir(tmp_path / "s0", ["+sweep=lr_scaling"])
    second = lr_grid_sweep_dir(tmp_path / "s1", ["+sweep=lr_scaling", "trainer.seed=1"], 1)
    # the second sweep's own fit, as the sweep writes it: no inputs named
    (second / "fit.json").write_text('{"frontier": null}')
    (second / "summary.json").write_text("{}")
    proc = run_fit(first, "--no-plots", "--out", second, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        f"error: {second} holds the fit of other inputs (the sweep there): "
        "name another directory with --out DIR, or remove it\n"
    )
    assert (second / "fit.json").read_text() == '{"frontier": null}'
    # a sweep dir's fit is made again in place, named or not
    assert run_fit(second, "--no-plots", "--out", second, cwd=tmp_path).returncode == 0
    assert json.loads((second / "fit.json").read_text())["inputs"] == [str(second)]


def test_a_sweep_dirs_refit_bootstraps_as_the_sweeps_own_fit_did(tmp_path):
    # one trial's learning curve: 8 points on the compute frontier
    flops = np.logspace(12, 14, 8)
    rows = [["t0", 3e6, c / 1.8e7, c, 2.0 + 400 * c**-0.2, c == flops[-1]] for c in flops]
    write_csv(
        tmp_path / "reports.csv",
        ["trial_id", "params", "tokens", "flops", "val_bpb", "final"],
        rows,
    )
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "overrides.yaml").write_text("- +sweep=lr\n- fit.bootstrap=20\n")
    sweep = tmp_path
    assert run_fit(sweep, "--no-plots").returncode == 0
    res = json.loads((sweep / "fit.json").read_text())
    assert res["frontier"]["bootstrap"]["n_boot"] == 20
    assert run_fit(sweep, "--no-plots", "--bootstrap", "0").returncode == 0  # the flag wins
    assert "bootstrap" not in json.loads((sweep / "fit.json").read_text())["frontier"]


def test_the_same_input_twice_is_refused_and_repeated_points_are_named(tmp_path):
    first = lr_grid_sweep_dir(tmp_path / "s0", ["+sweep=lr_scaling"])
    proc = run_fit(first, "s0", "--no-plots", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"error: s0 is given twice (as {first} too): its runs would count twice\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s0"]
    # another sweep of the same grid on the same seed: its points are named, not averaged
    again = lr_grid_sweep_dir(tmp_path / "again", ["+sweep=lr_scaling"], seed=0, luck=0.01)
    proc = run_fit(first, again, "--no-plots", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "combined-fit" / "fit.json").read_text())
    assert res["seeds"] is None  # one seed: nothing averaged
    assert res["warnings"][0] == (
        "10 final run(s) appear in more than one input on the same seed (the same point "
        "trained twice?): each point takes its lowest loss, as if one run"
    )


def test_inputs_whose_columns_differ_are_refused(tmp_path):
    sweep = lr_grid_sweep_dir(tmp_path / "s0", None)
    other = write_csv(tmp_path / "runs.csv", ["params", "tokens", "loss"], law_rows())
    proc = run_fit(sweep, other, "--no-plots", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: {other} holds other columns than {sweep} (") and line.endswith(
        "fit them separately"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs.csv", "s0"]


@pytest.mark.parametrize("column, option", [("seed", []), ("run_id_seed", ["--seed-col"])])
def test_cli_averages_rows_that_differ_only_in_their_seed(tmp_path, column, option):
    # one LR grid at 2 budgets on seeds 0 and 1, each seed +-0.02 off the mean at every LR
    rows = [
        [
            3e6,
            c,
            3.0 - 0.1 * np.log10(c) + 0.05 * np.log(m) ** 2 + (0.02 if s else -0.02),
            c,
            0.01 * m,
            s,
        ]
        for c in (1e12, 1e13)
        for m in (0.25, 0.5, 1.0, 2.0, 4.0)
        for s in (0, 1)
    ]
    src = write_csv(
        tmp_path / "runs.csv", ["params", "flops", "loss", "budget", "lr", column], rows
    )
    flags = [*option, column] if option else []
    proc = run_fit(src, "--json", "--no-plots", *flags, "--out", tmp_path / "o")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    assert res["seeds"]["seeds"] == [0, 1] and res["seeds"]["final_points"] == 10
    assert res["seeds"]["sd"] == pytest.approx(0.02 * np.sqrt(2))
    assert res["hparams"]["lr"]["best"] == pytest.approx([0.01, 0.01])


def cut_short(rows) -> bytes:
    text = "params,tokens,loss\n" + "".join(f"{n},{d},{loss}\n" for n, d, loss in rows)
    return text[: text.rindex(",")].encode()  # the last row loses its loss


@pytest.mark.parametrize(
    "setup, needle",
    [
        (lambda d: d / "missing.csv", "no such file"),
        (lambda d: write_csv(d / "a.csv", ["params", "flops"], [[1, 2]] * 5), "no loss column"),
        (lambda d: write_csv(d / "b.csv", ["params", "loss"], [[1e8, 3.0]] * 2), "usable row"),
        (lambda d: put(d / "c.csv", b"\xff\xfe\x00garbage\x00"), "cannot read"),
        (lambda d: put(d / "e.csv", b""), "empty"),
        (lambda d: put(d / "h.csv", b'loss,params\n1,2,3\n"unterminated'), "line 3 is cut"),
        # a writer killed mid-row: the rows before are whole, the file is not
        (lambda d: put(d / "k.csv", cut_short(law_rows())), "line 37 is cut short (2 of 3"),
        (lambda d: d, "without reports.csv"),
        (lambda d: write_csv(d / "f.csv", ["params", "loss"], [["x", "y"]] * 9), "not a number"),
        # a binary file can read as a CSV of thousands of unnamed columns: not all named
        (lambda d: put(d / "w.csv", b"\x01," * 39 + b"\n1\n"), r"'\x01', ... (40 in all)"),
    ],
)
def test_bad_input_is_one_line_exit_2(tmp_path, capsys, setup, needle):
    target = setup(tmp_path)
    assert main([str(target), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], captured.err
    assert captured.out == "" and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "option, value",
    [
        ("--bootstrap", "-1"),
        ("--bootstrap", "abc"),
        ("--drop-highest", "-2"),
        ("--target-flops", "0"),
        ("--target-flops", "inf"),
        ("--target-flops", "abc"),  # named as the others, not by the parser's own function
        ("--seed", "-1"),
    ],
)
def test_options_out_of_range_are_refused(tmp_path, capsys, option, value):
    csv = write_csv(tmp_path / "a.csv", ["params", "tokens", "loss"], [[1e6, 2e7, 3.0]] * 9)
    with pytest.raises(SystemExit) as exit_:
        main([str(csv), option, value])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()  # one line, not argparse's usage block
    assert line.startswith(f"error: argument {option}: must be ")
    assert line.endswith(" (python -m sweeper.fit --help)")
    assert not (tmp_path / "fit.json").exists()


def test_an_out_dir_that_cannot_be_made_is_named(tmp_path, capsys):
    csv = write_csv(tmp_path / "a.csv", ["params", "tokens", "loss"], law_rows())
    (tmp_path / "file").write_text("")
    assert main([str(csv), "--out", str(tmp_path / "file" / "fit"), "--no-plots"]) == 2
    assert capsys.readouterr().err == f"error: --out {tmp_path / 'file' / 'fit'}: Not a directory\n"


def test_cli_subprocess_bad_input_exit_2_without_traceback(tmp_path):
    proc = run_fit(tmp_path / "nope.csv")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == f"error: {tmp_path / 'nope.csv'}: no such file or directory"


def test_main_in_process_no_fit_possible(tmp_path, capsys):
    src = write_csv(tmp_path / "g.csv", ["params", "loss"], [[1e8, 3.0], [1e8, 2.9], [1e8, 2.8]])
    assert main([str(src), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no fit could be made") and "\n" not in err


def test_a_cell_that_is_not_a_number_is_refused_naming_its_line_and_column(tmp_path):
    from sweeper.scaling.records import read_csv_records

    rows = [[n, c, loss] for n, c, loss in law_rows(2, 2)]
    rows[2][0] = "abc"  # read as NaN, the row left the fits without a word
    src = write_csv(tmp_path / "runs.csv", ["params", "FLOPs", "loss"], rows)
    with pytest.raises(InputError, match=r"runs.csv line 4: column 'params' holds 'abc', not a"):
        read_csv_records(str(src))
    rows[2][0] = ""  # an unknown value, and 'nan' a measured one: read, as before
    rows[1][2] = "nan"
    src = write_csv(tmp_path / "runs.csv", ["params", "FLOPs", "loss"], rows)
    assert len(read_csv_records(str(src))) == 4


def test_records_with_a_non_positive_size_are_named_in_the_warnings():
    from sweeper.scaling.analysis import fit_all

    records = [{"N": n, "C": c, "loss": loss} for n, c, loss in law_rows()]
    records[0]["N"], records[1]["N"] = 0.0, -1e6
    warnings = fit_all(records, bootstrap=0)["warnings"]
    assert any("2 record(s) with a zero or negative N, D or C" in w for w in warnings), warnings
