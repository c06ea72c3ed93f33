"""The prediction benchmark's pure parts (benchmarks/bench_predict.py): errors, summary, memory verdicts, table."""

import importlib.util
import math
import sys
from pathlib import Path

import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_predict.py"
_spec = importlib.util.spec_from_file_location("bench_predict", _PATH)
bp = sys.modules.setdefault("bench_predict", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(bp)


def _row(engine, predicted, measured, **extra):
    row = {"engine": engine, "model": "mlp", "devices": "cpu,cpu@0.25", "batch": 8, "sizes": [6, 2],
           "micro_batches": [[6], [2]], "predicted_s": predicted, "measured_s": measured}  # fmt: skip
    row["error"] = bp.error(predicted, measured)
    row.update(extra)
    return row


def test_error_is_relative_to_the_measured_step_and_nan_where_undefined():
    assert bp.error(0.11, 0.10) == pytest.approx(0.10)
    assert bp.error(0.09, 0.10) == pytest.approx(-0.10)  # the step took longer than predicted
    assert math.isnan(bp.error(0.1, 0.0))
    assert math.isnan(bp.error(math.inf, 0.1))
    assert math.isnan(bp.error(math.nan, 0.1))


@pytest.mark.parametrize("n", [1, 2, 5, 18, 57])
def test_percentile_matches_numpy(n):
    values = list(np.random.default_rng(n).normal(size=n))
    for q in (0, 50, 95, 100):
        assert bp.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert math.isnan(bp.percentile([], 95))


def test_summary_per_engine_and_overall_leaves_failures_out_of_the_errors():
    rows = [
        _row("threads", 0.105, 0.100),  # +5 %
        _row("threads", 0.080, 0.100),  # -20 %
        _row("threads", 0.099, 0.100),  # -1 %
        _row("ddp", 0.090, 0.100),  # -10 %
        {"engine": "ddp", "model": "bert", "devices": "cpu,cpu@0.25", "failed": "ValueError: refused"},
        _row("fsdp2", 0.1, 0.0),  # no error to be had: counted as failed, not as 0
    ]
    s = bp.summarise(rows)
    assert list(s) == ["threads", "ddp", "fsdp2", "all"]
    assert s["threads"]["n"] == 3 and s["threads"]["failed"] == 0
    assert s["threads"]["median_abs"] == pytest.approx(0.05)
    assert s["threads"]["p95_abs"] == pytest.approx(float(np.percentile([0.05, 0.20, 0.01], 95)))
    assert s["threads"]["bias"] == pytest.approx(-0.01)
    assert s["ddp"]["n"] == 1 and s["ddp"]["failed"] == 1 and s["ddp"]["median_abs"] == pytest.approx(0.10)
    assert s["fsdp2"]["n"] == 0 and s["fsdp2"]["failed"] == 1 and math.isnan(s["fsdp2"]["median_abs"])
    assert s["all"]["n"] == 4 and s["all"]["failed"] == 2
    assert s["all"]["median_abs"] == pytest.approx(0.075)  # |errors| 0.01, 0.05, 0.10, 0.20
    assert s["all"]["p95_abs"] == pytest.approx(float(np.percentile([0.01, 0.05, 0.10, 0.20], 95)))


def test_memory_verdict_wants_the_prediction_at_or_above_the_peak_and_within_ten_percent():
    assert bp.memory_verdict(1000, 1000) == "ok"
    assert bp.memory_verdict(1100, 1000) == "ok"
    assert bp.memory_verdict(1101, 1000) == "over 10 %"
    assert bp.memory_verdict(999, 1000) == "below"
    assert bp.memory_verdict(None, 1000) == "n/a"


def test_table_shows_each_configuration_its_failure_and_the_summary():
    rows = [
        _row("threads", 0.105, 0.100, work_s=0.09, memory=[{"device": "cuda:0", "predicted_bytes": 2 << 20,
                                                             "measured_bytes": 1 << 20, "verdict": "over 10 %"}]),
        {"engine": "ddp", "model": "bert", "devices": "cpu,cpu@0.25", "failed": "ValueError: refused"},
    ]  # fmt: skip
    text = bp.table(rows, bp.summarise(rows), markdown=True)
    lines = text.splitlines()
    assert lines[0].startswith("| engine | model | devices | batch | plan | predicted ms | measured ms | error |")
    assert "| threads | mlp | cpu,cpu@0.25 | 8 | [6, 2] | 105.0 | 100.0 | +5.0 % |  | 90.0 |" in text  # no again
    assert "cuda:0 2.0 / 1.0 (over 10 %)" in text
    assert "failed: ValueError: refused" in text
    assert "| all | 1 (1 failed) | 5.0 % | 5.0 % | +5.0 % |" in text
    plain = bp.table(rows, bp.summarise(rows), markdown=False)
    assert "|" not in plain and "threads" in plain and "+5.0 %" in plain


def test_the_noise_floor_is_each_configuration_measured_again_against_its_first_measurement():
    rows = [
        {**_row("threads", 0.105, 0.100), "measured_again_s": 0.125},  # again: 0.100 vs 0.125, -20 %
        {**_row("ddp", 0.090, 0.100), "measured_again_s": 0.095},  # +5.3 %
        _row("fsdp2", 0.1, 0.1),  # not measured again: no floor from it
    ]
    rows = [bp._finish(dict(r), r["devices"]) for r in rows]
    assert rows[0]["again"] == pytest.approx(-0.2) and rows[1]["again"] == pytest.approx(0.1 / 0.095 - 1)
    s = bp.summarise(rows)
    assert s["all"]["again_median_abs"] == pytest.approx((0.2 + 0.1 / 0.095 - 1) / 2)
    assert s["threads"]["again_p95_abs"] == pytest.approx(0.2) and math.isnan(s["fsdp2"]["again_median_abs"])
    assert "noise floor" in bp.table(rows, s) and "-20.0 %" in bp.table(rows, s)


def test_the_neusight_figure_is_the_mean_of_the_fastest_5_of_the_first_25_steps():
    steps = [0.2] * 20 + [0.1, 0.11, 0.12, 0.13, 0.14] + [0.01] * 5  # the last 5 are past the 25th: left out
    assert bp.fastest(steps) == pytest.approx(0.12)
    assert bp.fastest([0.3, 0.1]) == pytest.approx(0.2) and math.isnan(bp.fastest([]))
    rows = [
        {**_row("ddp", 0.090, 0.100), "fastest_s": 0.09, "fastest_again_s": 0.0936},  # 0 %, again -3.8 %
        {**_row("ddp", 0.090, 0.100), "fastest_s": 0.1, "fastest_again_s": 0.1},  # -10 %, again 0
        _row("threads", 0.1, 0.1),  # no fastest figure: left out of it
    ]
    rows = [bp._finish(dict(r), r["devices"]) for r in rows]
    s = bp.summarise(rows)
    assert s["ddp"]["fastest_median_abs"] == pytest.approx(0.05)
    assert s["ddp"]["fastest_again_median_abs"] == pytest.approx((0.09 / 0.0936 - 1) / -2)
    assert math.isnan(s["threads"]["fastest_median_abs"])
    assert "fastest 5 of 25" in bp.table(rows, s)
