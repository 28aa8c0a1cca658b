"""trainer.dtype=auto on a CPU: bf16 where a timed matmul says it is faster; the same answer
for every process on the machine."""

import json
import os

import pytest
import torch

from sweeper.train import device as runtime


def timing(bf16_ms=None, fp32_ms=10.0) -> dict:
    return {"bf16_ms": bf16_ms, "fp32_ms": fp32_ms}


@pytest.mark.parametrize(
    "bf16_ms, fp32_ms, faster",
    [
        (0.57, 6.1, True),  # an AMX Xeon
        (10.0, 12.5, True),  # exactly the margin
        (10.0, 12.0, False),  # faster, not by enough to pay for autocast's casts
        (19.7, 11.9, False),  # AVX512-BF16 without AMX
        (2.3, 10.7, True),  # an AMD EPYC with AVX512-BF16
        (None, 10.0, False),  # no bf16 units: not timed
    ],
)
def test_bf16_is_taken_only_where_its_matmul_beats_fp32_by_the_margin(bf16_ms, fp32_ms, faster):
    assert runtime.bf16_beats_fp32(timing(bf16_ms, fp32_ms)) is faster


def test_the_matmul_timing_is_measured_once_and_read_back_by_later_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEPER_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def measure(timing):
        calls.append(timing)
        return timing

    first = runtime.recorded_cpu_timing(lambda: measure(timing(5.0, 9.0)))
    later = runtime.recorded_cpu_timing(lambda: measure(timing(9.0, 5.0)))
    assert first == later == timing(5.0, 9.0)
    assert len(calls) == 1
    (record,) = (tmp_path / "cache").iterdir()  # no temporary file left beside it
    assert json.loads(record.read_text())["torch"] == torch.__version__


def test_a_process_that_measured_second_takes_the_first_ones_answer(tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEPER_CACHE_DIR", str(tmp_path))

    def measured_while_another_process_wrote_first():
        runtime.recorded_cpu_timing(lambda: timing(1.0, 8.0))
        return timing(8.0, 1.0)

    assert runtime.recorded_cpu_timing(measured_while_another_process_wrote_first) == timing(
        1.0, 8.0
    )
    assert len(os.listdir(tmp_path)) == 1


def test_an_unreadable_record_or_cache_dir_falls_back_to_the_processs_own_timing(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("SWEEPER_CACHE_DIR", str(tmp_path))
    runtime.recorded_cpu_timing(lambda: timing(1.0, 8.0))
    (record,) = tmp_path.iterdir()
    record.write_text("{not json")
    assert runtime.recorded_cpu_timing(lambda: timing(3.0, 4.0)) == timing(3.0, 4.0)
    # a record that lacks a timing is not read
    record.write_text('{"bf16_ms": 1.0}')
    assert runtime.recorded_cpu_timing(lambda: timing(3.0, 4.0)) == timing(3.0, 4.0)
    blocked = tmp_path / "a file, not a dir"
    blocked.write_text("")
    monkeypatch.setenv("SWEEPER_CACHE_DIR", str(blocked))
    assert runtime.recorded_cpu_timing(lambda: timing(2.0, 7.0)) == timing(2.0, 7.0)


def test_the_real_matmuls_are_timed_on_this_cpu():
    measured = runtime.measure_cpu_matmuls(bf16=True)
    assert measured["bf16_ms"] > 0 and measured["fp32_ms"] > 0
    assert runtime.measure_cpu_matmuls(bf16=False)["bf16_ms"] is None


def test_auto_follows_the_recorded_timing_where_the_cpu_has_bf16_units(tmp_path, monkeypatch):
    monkeypatch.setenv("SWEEPER_CACHE_DIR", str(tmp_path))
    runtime.cpu_bf16_is_fast.cache_clear()
    try:
        auto = runtime.resolve_dtype("auto", torch.device("cpu"))
        if runtime.cpu_has_bf16_units():
            expected = runtime.bf16_beats_fp32(runtime.recorded_cpu_timing())
        else:  # emulated bf16: not timed
            expected = False
            assert runtime.recorded_cpu_timing()["bf16_ms"] is None
        assert len(os.listdir(tmp_path)) == 1  # one record, whichever process wrote it
        assert auto == (torch.bfloat16 if expected else torch.float32)
    finally:
        runtime.cpu_bf16_is_fast.cache_clear()
