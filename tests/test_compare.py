"""`python -m sweeper.compare`: a sweep's trials from MLflow, best first."""

from __future__ import annotations

import json
import signal
import socket
import time

import pytest

from sweeper.compare import compare, main

from .conftest import run_cli, run_cli_into_closed_pipe


def make_store(folder) -> tuple[str, dict]:
    """Two sweeps as the tracker logs them: 'smoke' (3 trials and a baseline), then 'lr'."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{folder}/mlflow.db"
    client = MlflowClient(uri)
    experiment = client.create_experiment("sweeper")
    ids = {}
    for name, trials in (
        (
            "smoke",
            [
                ("a_0", 0.02, 1.30, "completed"),
                ("a_1", 0.01, 1.20, "completed"),
                # a value from a broken run: a failed trial's last, a diverged one's penalty
                ("a_2", 0.5, 0.90, "failed"),
                ("a_3", 0.9, 1e9, "diverged"),
            ],
        ),
        ("lr", [("b_0", 0.03, 1.50, "pruned"), ("b_1", 0.005, 1.10, "completed")]),
    ):
        run_dir = folder / f"run_{name}"
        parent = client.create_run(
            experiment,
            run_name=f"{name}-run",
            tags={"role": "sweep", "sweep": name, "run_dir": str(run_dir), "status": "completed"},
        )
        pid = ids[name] = parent.info.run_id
        client.log_param(pid, "metric", "val_bpb")
        client.log_param(pid, "mode", "min")
        run_dir.mkdir()
        (run_dir / "mlflow_run.json").write_text(json.dumps({"tracking_uri": uri, "run_id": pid}))
        for trial_id, lr, value, status in trials:
            child = client.create_run(
                experiment,
                run_name=trial_id,
                tags={
                    "mlflow.parentRunId": pid,
                    "role": "trial",
                    "stage": "lr",
                    "trial_id": trial_id,
                    "status": status,
                },
            ).info.run_id
            client.log_param(child, "optimizer.matrix_lr", str(lr))
            client.log_param(child, "model.depth", "2")  # the same in every trial: not shown
            client.log_metric(child, "val_bpb", value + 1.0, step=1)
            client.log_metric(child, "val_bpb", value, step=2)
            client.log_metric(child, "tokens", 8192, step=2)
            if name == "lr":  # sweeper's training logs its peak memory; a user's may not
                client.log_metric(child, "peak_memory_gib", 0.25 + lr, step=2)
            ended = {"pruned": "KILLED", "failed": "FAILED", "diverged": "FAILED"}
            client.set_terminated(child, ended.get(status, "FINISHED"))
        baseline = client.create_run(
            experiment, tags={"mlflow.parentRunId": pid, "role": "baseline", "stage": "baseline"}
        ).info.run_id
        client.log_metric(baseline, "val_bpb", 1.75)
        client.set_terminated(pid)
        time.sleep(0.01)  # distinct start times: 'lr' is the latest sweep
    return uri, ids


def table_rows(text: str) -> list[list[str]]:
    return [line.split() for line in text.splitlines()[2:] if not line.startswith("baseline")]


def test_a_sweep_by_name_run_id_or_run_dir_sorted_by_its_metric(tmp_path):
    uri, ids = make_store(tmp_path)
    text = compare("smoke", uri, None)
    assert text.splitlines()[0].startswith(f"sweep 'smoke' run {ids['smoke']} (completed)")
    header = text.splitlines()[1].split()
    assert header == ["stage", "trial", "status", "val_bpb", "tokens", "optimizer.matrix_lr"]
    assert table_rows(text) == [
        ["lr", "a_1", "completed", "1.2000", "8,192", "0.01"],
        ["lr", "a_0", "completed", "1.3000", "8,192", "0.02"],
        # shown and ranked as the stage tables do: no value, after every measured one
        ["lr", "a_2", "failed", "-", "8,192", "0.5"],
        ["lr", "a_3", "diverged", "-", "8,192", "0.9"],
    ]
    assert "baseline (unmodified config): val_bpb 1.7500" in text
    assert compare(ids["smoke"], uri, None) == text
    assert compare(str(tmp_path / "run_smoke"), None, None) == text  # its recorded store
    latest = compare(None, uri, None)
    assert latest.startswith("sweep 'lr'") and [r[1] for r in table_rows(latest)] == ["b_1", "b_0"]
    # where the trials logged their peak memory, a column of it after tokens
    assert latest.splitlines()[1].split()[4:6] == ["tokens", "GiB"]
    assert [r[5] for r in table_rows(latest)] == ["0.26", "0.28"]


def test_the_default_store_is_mlflow_db_in_the_working_directory(tmp_path, monkeypatch, capsys):
    make_store(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    main(["smoke"])
    assert "a_1" in capsys.readouterr().out


@pytest.mark.parametrize(
    "case",
    [
        "unknown sweep",
        "no sweep yet",
        "no store",
        "dead server",
        "no such scheme",
        "no such dir",
        "store gone",
        "not a database",
        "a plain path",
        "an unknown flag",
        "last without runs",
        "last zero",
        "unknown run id",
        "plot cannot be written",
    ],
)
def test_errors_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, case):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    if case == "unknown sweep":
        make_store(tmp_path)
        capsys.readouterr()  # MLflow's own lines about creating the store
        argv, expected = ["nosuch"], "no sweep 'nosuch'"
    elif case == "no sweep yet":  # a store that only single runs have used
        from mlflow import MlflowClient

        MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").create_experiment("sweeper")
        capsys.readouterr()
        argv, expected = [], "no sweep in the MLflow store yet: run one"
    elif case == "no store":
        argv, expected = [], "no MLflow store at"
    elif case == "no such dir":
        argv = [str(tmp_path / "outputs" / "nosuch")]
        expected = f"{tmp_path / 'outputs' / 'nosuch'}: no such directory"
    elif case == "store gone":  # the run dir names a store that has moved since
        make_store(tmp_path / "elsewhere")
        capsys.readouterr()
        (tmp_path / "elsewhere" / "mlflow.db").unlink()
        run_dir = tmp_path / "elsewhere" / "run_smoke"
        argv = [str(run_dir)]
        expected = (
            f"no MLflow store at {tmp_path / 'elsewhere' / 'mlflow.db'}, where "
            f"{run_dir}/mlflow_run.json says the sweep logged: pass --tracking-uri if it has moved"
        )
    elif case == "unknown run id":  # named as an unknown name is, not by MLflow's words
        make_store(tmp_path)
        capsys.readouterr()
        argv, expected = ["0123456789abcdef" * 2], "no sweep '0123456789abcdef0123456789abcdef'"
    elif case == "not a database":
        (tmp_path / "notes.db").write_text("not a database\n")
        argv, expected = ["--tracking-uri", "sqlite:///notes.db"], "file is not a database"
        # and not SQLAlchemy's statement and link after it
        expected = "MLflow store: DatabaseError: (sqlite3.DatabaseError) file is not a database"
    elif case == "plot cannot be written":  # as root, os.access allows /proc
        argv = ["--runs", "--plot", "/proc/curves.png"]
        expected = "--plot /proc/curves.png: cannot be written"
    elif case == "a plain path":  # MLflow 3 refuses its file store
        argv, expected = ["--tracking-uri", str(tmp_path)], "MLflow's file store is retired"
    elif case == "last without runs":  # a sweep's table is whole: --last would do nothing
        argv, expected = ["--last", "3"], "--last 3 counts the single runs: add --runs"
    elif case == "last zero":
        argv, expected = ["--runs", "--last", "0"], "--last must be >= 1, got 0"
    elif case == "an unknown flag":
        argv, expected = ["--bogus"], "unrecognized arguments: --bogus"
    elif case == "no such scheme":
        argv, expected = ["--tracking-uri", "sqllite:///mlflow.db"], "MLflow has no store"
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # with credentials in the URI, which the message must not print
        argv = ["--tracking-uri", f"http://me:secret@127.0.0.1:{port}"]
        expected = f"http://me:***@127.0.0.1:{port} is unreachable"
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and time.monotonic() - started < 10
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert "[SQL:" not in err[0]
    # none created
    assert not (tmp_path / "mlflow.db").exists() or case in (
        "unknown sweep",
        "no sweep yet",
        "unknown run id",
    )


def test_large_whole_numbers_print_as_hydra_writes_them():
    from sweeper.compare import _param

    values = ("8192", "10000000000000.0", "1e13", "0.0200001", "2.5e-05", "abc")
    assert [_param(v) for v in values] == ["8192", "1e13", "1e13", "0.02", "2.5e-5", "abc"]


@pytest.mark.slow
def test_a_smoke_sweep_then_compare_in_the_same_directory(tmp_path):
    tiny = [
        "sweep.budget.tokens_per_trial=8192",
        "sweep.reports_per_trial=2",
        "sweep.stages.0.num_samples=1",
        "trainer.eval_tokens=1024",
        "trainer.total_batch_size=512",
        "sweep.baseline=false",
        "sweep.stages.1.params.trainer.total_batch_size.grid=[512,1024]",
        "ray.num_cpus=2",
    ]
    # a matplotlib without its font cache, as on a new machine: it logs building one
    env = {"MPLCONFIGDIR": str(tmp_path / "matplotlib")}
    proc = run_cli(["+sweep=smoke", *tiny], cwd=tmp_path, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "matplotlib").is_dir()  # the plots ran with the fresh cache
    # the sweep's own lines only: neither Tune's box per stage, Ray's token-auth warning,
    # MLflow's INFO lines on creating this new SQLite store, nor matplotlib's on its cache
    assert "(sign in with the token in " in proc.stdout
    noises = ("Configuration for experiment", "View detailed results", "Token authentication")
    for noise in (*noises, "Creating initial MLflow database tables", "INFO mlflow", "[INFO]"):
        assert noise not in proc.stdout + proc.stderr, noise
    assert (tmp_path / "mlflow.db").is_file()
    # the fit's frontier with conf/config.yaml's bootstrap refits and their 95% band
    (fit,) = tmp_path.glob("outputs/*/*/fit.json")  # Hydra's default run dir
    frontier = json.loads(fit.read_text())["frontier"]
    assert frontier["bootstrap"]["n_boot"] == 200 and frontier["bootstrap"]["band"]["lo"]
    proc = run_cli([], cwd=tmp_path, timeout=60, module="sweeper.compare")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("sweep 'smoke' run ") and "(completed), 3 trials" in lines[0]
    header = lines[1].split()
    assert header[:6] == ["stage", "trial", "status", "val_bpb", "tokens", "GiB"]
    assert "trainer.total_batch_size" in header  # varied across trials; model.depth did not
    assert "model.depth" not in header
    rows = [line.split() for line in lines[2:]]
    assert sorted(r[0] for r in rows) == ["batch_size", "batch_size", "lr"]
    values = [float(r[3]) for r in rows if r[3] != "-"]
    assert values == sorted(values) and len(values) == 3
    assert all(0.1 < float(r[5]) < 8 for r in rows), rows  # each trial's peak memory


def test_compare_into_a_closed_pipe_ends_quietly(tmp_path):
    """`python -m sweeper.compare | head -1`: no BrokenPipeError traceback."""
    uri, _ = make_store(tmp_path)
    proc = run_cli_into_closed_pipe(["--tracking-uri", uri], tmp_path, module="sweeper.compare")
    assert proc.returncode == -signal.SIGPIPE, proc.stderr
    assert proc.stderr == ""
