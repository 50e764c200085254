import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share the cores: one thread each (and in their subprocesses), else OpenMP's barriers spin
    # against the other worker's threads on every small op
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# Tests that must not overlap each other on two pytest-xdist workers (.ci/run: -n 2 --dist loadgroup) run on one:
# `run --local` binds the MLflow UI's default port 5000 and links to it; the reward-server outage, hostile-load and
# process-group tests measure seconds that a second busy test beside them would stretch; the vLLM tier shares one
# server (a session fixture, started once per worker).
XDIST_GROUPS = {
    "serial": ["integration/test_local_run.py", "integration/test_cli.py", "integration/test_stop_and_lock.py",
               "integration/test_ray_startup.py", "integration/test_reward_server_outage.py",
               "integration/test_reward_server_hostile.py", "integration/test_reward_server_local.py",
               "unit/test_http_retry.py"],
    "vllm": ["vllm/"],
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    for item in items:
        where = item.path.relative_to(root).as_posix()
        for group, prefixes in XDIST_GROUPS.items():
            if any(where.startswith(prefix) for prefix in prefixes):
                item.add_marker(pytest.mark.xdist_group(group))

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
