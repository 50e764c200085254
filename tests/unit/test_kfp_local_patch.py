"""The kfp.local adapter: one line when the installed kfp is not the one it was written for, a clear error when a
call it wraps is gone, kfp.local as it was afterwards."""

import kfp
import pytest
from kfp.local import subprocess_task_handler
from kfp.local.orchestrator import task_executor

from pipeline import kfp_local_patch
from pipeline.kfp_local_patch import KfpLocalChanged, following_tasks


class _Events:
    def task_started(self, task):
        pass

    def task_cached(self, task):
        pass

    def task_finished(self, task, succeeded):
        pass


def _wrapped():
    return task_executor.execute_single_task, subprocess_task_handler.SubprocessTaskHandler.run


def test_the_pinned_kfp_is_the_one_the_patch_was_written_for():
    with open("locks/flowgrpo.txt") as lock:
        pinned = next(line.split("==")[1].split()[0] for line in lock if line.startswith("kfp=="))
    assert kfp_local_patch.WRITTEN_FOR == pinned


@pytest.mark.parametrize(("installed", "lines"), [(kfp_local_patch.WRITTEN_FOR, 0), ("2.18.0", 1)])
def test_another_kfp_version_is_said_in_one_line(monkeypatch, installed, lines):
    monkeypatch.setattr(kfp, "__version__", installed)
    said, before = [], _wrapped()
    with following_tasks(_Events(), say=said.append):
        assert _wrapped() != before
    assert _wrapped() == before
    assert len(said) == lines
    if lines:
        assert said[0].startswith("kfp 2.18.0 is installed") and kfp_local_patch.WRITTEN_FOR in said[0]
        assert "\n" not in said[0]


def test_a_missing_kfp_call_fails_naming_it(monkeypatch):
    monkeypatch.delattr(task_executor, "execute_single_task")
    run = subprocess_task_handler.SubprocessTaskHandler.run
    with pytest.raises(KfpLocalChanged, match=r"no task_executor\.execute_single_task .*written for kfp 2\.17"), \
            following_tasks(_Events(), say=lambda line: None):
        pass
    assert subprocess_task_handler.SubprocessTaskHandler.run is run
