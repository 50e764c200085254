"""tests/conftest.py's order of the xdist scopes: the Ray chain first, then by the number of slow tests."""
import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("ci_conftest", Path(__file__).parents[1] / "conftest.py")
ci_conftest = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ci_conftest)


class Item:
    def __init__(self, nodeid: str, slow: bool = False):
        self.nodeid, self.slow = nodeid, slow

    def get_closest_marker(self, name: str):
        return pytest.mark.slow if name == "slow" and self.slow else None


def test_the_ray_chain_then_the_files_with_most_slow_tests_then_the_collection_order():
    items = [
        Item("tests/unit/test_a.py::test_1"),
        Item("tests/integration/test_one_slow.py::test_1", slow=True),
        Item("tests/integration/test_one_slow.py::test_2"),
        Item("tests/integration/test_two_slow.py::test_1", slow=True),
        Item("tests/integration/test_ray_train.py::test_1"),
        Item("tests/unit/test_b.py::test_1"),
        Item("tests/integration/test_two_slow.py::test_2", slow=True),
        Item("tests/integration/test_multihost.py::test_1", slow=True),
        Item("tests/integration/test_also_one_slow.py::test_1", slow=True),
    ]
    order = [item.nodeid for item in ci_conftest.longest_first(items)]
    assert order == [
        "tests/integration/test_ray_train.py::test_1", "tests/integration/test_multihost.py::test_1",
        "tests/integration/test_two_slow.py::test_1", "tests/integration/test_two_slow.py::test_2",
        "tests/integration/test_one_slow.py::test_1", "tests/integration/test_one_slow.py::test_2",
        "tests/integration/test_also_one_slow.py::test_1",
        "tests/unit/test_a.py::test_1", "tests/unit/test_b.py::test_1",
    ]


def test_each_benchmark_smoke_run_is_a_scope_of_its_own_and_bench_ray_joins_the_ray_chain():
    smoke = "tests/benchmarks/test_benchmark_smoke_runs.py::test_the_benchmark_smoke_run_prints_its_figures"
    assert ci_conftest.xdist_scope(f"{smoke}[bench_memory.py]") == f"{smoke}[bench_memory.py]"
    assert ci_conftest.xdist_scope(f"{smoke}[bench_ray.py]") == ci_conftest.RAY_SCOPE
    assert ci_conftest.xdist_scope("tests/integration/test_cli.py::test_x[1]") == "tests/integration/test_cli.py"
