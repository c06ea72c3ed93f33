import json
import math

import pytest

from hetsplit.bench import bench, keep_freed_memory, time_steps


def test_bench_reports_consistent_figures():
    r = bench("mlp", "cpu,cpu@0.5", batch_size=32, steps=2, warmup=1, profile_budget=2)
    assert set(r.single) == {"cpu", "cpu@0.5"}
    assert r.ideal == pytest.approx(sum(r.single.values()))
    assert r.efficiency == pytest.approx(r.balanced / r.ideal)
    assert r.speedup_vs_even == pytest.approx(r.balanced / r.even)
    assert r.speedup_vs_single == pytest.approx(r.balanced / r.single[r.fastest])
    assert sum(r.plan.sizes) == 32
    assert r.meta["emulated"] == ["cpu@0.5"] and r.meta["data"] == "synthetic"
    assert r.overhead is not None and math.isfinite(r.overhead)
    json.dumps(r.to_dict())  # JSON-ready
    assert "ideal (sum of single devices)" in r.table()


@pytest.mark.parametrize("kwargs, fragment", [({"devices": "cpu"}, "two or more devices"),
                                              ({"mode": "scatter"}, "'scatter'")])
def test_bench_bad_arguments(kwargs, fragment):
    args = {"model": "mlp", "devices": "cpu,cpu@0.5"} | kwargs
    with pytest.raises(ValueError) as err:
        bench(**args, steps=1)
    assert fragment in str(err.value)


def test_time_steps_runs_every_configuration_round_robin():
    order = []
    t = time_steps({"a": lambda: order.append("a"), "b": lambda: order.append("b")}, [], steps=3, warmup=1)
    assert order == ["a", "b"] + ["a", "b"] * 3
    assert set(t) == {"a", "b"} and all(v >= 0 for v in t.values())


def test_keep_freed_memory_is_a_flag():
    assert keep_freed_memory() in (True, False)
