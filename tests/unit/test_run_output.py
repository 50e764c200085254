"""Which outputs a run may write into: new, empty, or a run's own (run.json), never a folder of someone else's."""

import pytest

from components.errors import RunOutputError
from components.trainer.run_output import RUN_RECORD_FILE, RunOutput


def test_a_run_writes_only_into_a_new_empty_or_run_output(tmp_path):
    RunOutput(tmp_path / "new").check_ours()
    RunOutput(tmp_path).check_ours()  # empty
    for name in ("notes.txt", "b", "c", "d"):
        (tmp_path / name).write_text("mine")
    with pytest.raises(RunOutputError, match=r"already holds files that no flowgrpo run wrote \(b, c, d, \.\.\.; no "
                                             r"run\.json\): training would overwrite them"):
        RunOutput(tmp_path).check_ours()
    (tmp_path / RUN_RECORD_FILE).write_text("{}")  # a run's output, whatever else it holds: --resume continues it
    RunOutput(tmp_path).check_ours()
    with pytest.raises(RunOutputError, match="is a file; a run writes a folder"):
        RunOutput(tmp_path / "notes.txt").check_ours()
