import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # .ci/run's pytest-xdist workers share the cores: one thread each (and in their subprocesses), else OpenMP's
    # barriers spin against the other workers' threads on every small op
    os.environ.setdefault("OMP_NUM_THREADS", "1")

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
