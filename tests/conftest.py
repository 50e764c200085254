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
# test killed at 7 min); each benchmark smoke run and each model-family test is one of its own. The slowest go
# first (CI's --durations), so none of them starts last and holds up the end of the run.
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
SLOWEST_FIRST = [
    RAY_SCOPE, "tests/integration/test_local_run.py", "tests/integration/test_cli.py",
    "tests/integration/test_sharding.py", "tests/integration/test_model_families.py",
    "tests/integration/test_video_family.py", "tests/integration/test_qwenimage_edit.py",
    "tests/integration/test_wan_i2v.py",
    "tests/vllm/test_vlm_judge_real.py", "tests/integration/test_compile.py", "tests/integration/test_training.py",
    "tests/integration/test_evaluate.py", "tests/integration/test_training_rewards.py",
    "tests/integration/test_reward_server_outage.py", "tests/integration/test_tracking.py",
    "tests/integration/test_dpo_training.py", "tests/integration/test_awm_training.py",
    "tests/integration/test_mix_grpo_training.py", "tests/integration/test_dance_sde_training.py",
    "tests/integration/test_flux_kontext.py",
    "tests/integration/test_flux2_references.py",
    *PER_TEST_FILES,  # then the benchmark smoke runs (1-3 min each), then the rest in collection order
]


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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # xdist keeps one test per node id: tests sharing one would silently not run (schemathesis' parametrize did)
    counts = collections.Counter(item.nodeid for item in items)
    if shared := sorted(nodeid for nodeid, n in counts.items() if n > 1):
        raise pytest.UsageError(f"tests share a node id, so pytest-xdist would run one of each: {shared}")
    rank = {scope: i for i, scope in enumerate(SLOWEST_FIRST)}

    def order(item: pytest.Item) -> int:
        scope = xdist_scope(item.nodeid)
        return rank.get(scope, rank.get(item.nodeid.split("::", 1)[0], len(rank)))

    items.sort(key=order)


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
