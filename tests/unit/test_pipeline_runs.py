"""The pipeline run's MLflow calls whose results are kept elsewhere too (closing the run in the exit task, showing
the evaluation and the model version on it) must not fail their step when MLflow is unreachable; the saved chart
view MLflow's UI reads."""

import json

import pytest

from components.tracking.pipeline_runs import finish_parent_run, show_evaluation, show_model_version
from components.tracking.server import charts_view

ROWS = {"geneval": {"base_mean": 0.2, "lora_mean": 0.3, "delta": 0.1, "ci_low": 0.05, "ci_high": 0.15}}
CALLS = {
    "close the pipeline's run": lambda log: finish_parent_run("flowgrpo", "run-1", succeeded=False, log=log),
    "show the evaluation on the pipeline run": lambda log: show_evaluation("0" * 32, ROWS, {}, log=log),
    "link the model version from the pipeline run": lambda log: show_model_version("0" * 32, "m", "1", log=log),
}


@pytest.mark.parametrize("what", CALLS)
def test_unreachable_mlflow_is_reported_not_raised(what, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    lines: list[str] = []
    CALLS[what](lines.append)
    (line,) = lines
    assert f"could not {what}" in line and "127.0.0.1:9" in line and "s3cret" not in line


def test_a_tracking_uri_with_credentials_is_reported_not_raised(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://user:s3cret@127.0.0.1:9")
    lines: list[str] = []
    finish_parent_run("flowgrpo", "run-1", succeeded=False, log=lines.append)
    (line,) = lines
    assert "could not close the pipeline's run" in line and "MLFLOW_TRACKING_PASSWORD" in line and "s3cret" not in line


@pytest.mark.parametrize("what", CALLS)
def test_tracking_off_is_a_no_op(what, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    lines: list[str] = []
    CALLS[what](lines.append)
    assert lines == []


def test_the_saved_chart_view_lists_the_rewards_then_the_sample_grids_then_the_rest_by_name():
    keys = ["eval/geneval/delta", "update/advantage_mean", "reward/geneval/mean", "kl", "reward/mean",
            "eval/aesthetic/delta", "rewarded/x", "heldout/geneval/mean"]
    view = json.loads(charts_view(keys, now_ms=1_700_000_000_000))
    # The envelope MLflow's UI accepts for a saved view: a string name, a number createdAt, the state as a string.
    assert isinstance(view["name"], str) and view["createdAt"] == view["updatedAt"] == 1_700_000_000_000
    state = json.loads(view["state"])
    assert state["isAccordionReordered"] and state["compareRunCharts"] == []
    sections = state["compareRunSections"]
    assert [s["name"] for s in sections] == ["reward", "reward/geneval", "Model metrics", "eval/aesthetic",
                                             "eval/geneval", "heldout/geneval", "rewarded", "update"]
    assert len({s["uuid"] for s in sections}) == len(sections) and all(s["display"] for s in sections)
