import collections
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # .ci/run's pytest-xdist workers share the cores: one thread each (and in their subprocesses), else OpenMP's
    # barriers spin against the other workers' threads on every small op
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# How .ci/run's pytest-xdist workers share the tests. A unit of work ("scope") goes to one worker whole: each test
# file is one, so its module fixtures (trained runs, started services) are built once; the files that start a local
# Ray cluster share one, since three Ray clusters on two cores starve each other past their timeouts (seen: a 2-min
# test killed at 7 min); each benchmark smoke run and each model-family test is one of its own. The longest scopes
# go first, so none of them starts last and holds up the end of the run: the Ray scope (a chain, by the above), then
# the scopes with the most tests marked `slow`. The mark is what orders them, and the end of every run names the
# unmarked tests that took SLOW_S or more, so a slow test added without it is seen in the next CI log.
RAY_SCOPE = "ray"
SHARED_SCOPES = {
    "tests/integration/test_ray_train.py": RAY_SCOPE, "tests/integration/test_ray_startup.py": RAY_SCOPE,
    "tests/integration/test_rayjob_readonly_root.py": RAY_SCOPE, "tests/integration/test_multihost.py": RAY_SCOPE,
    "tests/benchmarks/test_benchmark_smoke_runs.py::test_the_benchmark_smoke_run_prints_its_figures[bench_ray.py]":
        RAY_SCOPE,
    "tests/benchmarks/test_benchmark_smoke_runs.py::test_the_benchmark_smoke_run_prints_its_figures"
    "[bench_multihost.py]": RAY_SCOPE,
}
PER_TEST_FILES = ("tests/benchmarks/test_benchmark_smoke_runs.py", "tests/integration/test_model_families.py",
                  "tests/integration/test_video_family.py")
SLOW_S = 20.0  # pyproject.toml's `slow` marker: a test whose setup and call take this long or more in CI


def xdist_scope(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED_SCOPES.get(nodeid) or SHARED_SCOPES.get(path) or (nodeid if path in PER_TEST_FILES else path)


@pytest.hookimpl(optionalhook=True)  # a pytest without xdist has no such hook
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ScopeScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_scope(nodeid)

    config.option.loadscopereorder = False  # the order of the collection, which the hook below sets
    return ScopeScheduling(config, log)


def longest_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The items reordered scope by scope: the Ray scope, then by the number of slow tests, then as collected."""
    slow = collections.Counter(xdist_scope(item.nodeid) for item in items if item.get_closest_marker("slow"))
    first_seen = {xdist_scope(item.nodeid): i for i, item in reversed(list(enumerate(items)))}

    def order(item: pytest.Item) -> tuple[bool, int, int]:
        scope = xdist_scope(item.nodeid)
        return scope != RAY_SCOPE, -slow[scope], first_seen[scope]

    return sorted(items, key=order)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # xdist keeps one test per node id: tests sharing one would silently not run (schemathesis' parametrize did)
    counts = collections.Counter(item.nodeid for item in items)
    if shared := sorted(nodeid for nodeid, n in counts.items() if n > 1):
        raise pytest.UsageError(f"tests share a node id, so pytest-xdist would run one of each: {shared}")
    items[:] = longest_first(items)


_seconds: collections.Counter = collections.Counter()
_marked_slow: set[str] = set()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when in ("setup", "call"):
        _seconds[report.nodeid] += report.duration
        if "slow" in report.keywords:
            _marked_slow.add(report.nodeid)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    unmarked = [(s, nodeid) for nodeid, s in _seconds.items() if s >= SLOW_S and nodeid not in _marked_slow]
    if unmarked:
        terminalreporter.section(f"tests of {SLOW_S:.0f} s or more not marked slow (CI starts their files late)")
        for s, nodeid in sorted(unmarked, reverse=True):
            terminalreporter.write_line(f"{s:7.1f}s {nodeid}")


SMALL = [
    "train.epochs=2", "sampling.prompts_per_epoch=2", "sampling.group_size=4", "sampling.batch_size_per_worker=8",
    "train.batch_size_per_worker=4", "sampling.num_steps=4", "train.checkpoint_every=1",
]


@pytest.fixture
def small_config():
    """A few-second training config on the tiny model; extra overrides may be passed."""
    from pipeline.config import TINY_CONFIG, load_config

    def make(*overrides: str):
        return load_config(TINY_CONFIG, [*SMALL, *overrides])

    return make
