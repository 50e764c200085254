"""The exit task's MLflow call must not fail the teardown when MLflow is unreachable."""

from components.tracking.pipeline_runs import finish_parent_run


def test_unreachable_mlflow_is_reported_not_raised(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    lines: list[str] = []
    finish_parent_run("flowgrpo", "run-1", succeeded=False, log=lines.append)
    (line,) = lines
    assert "could not close the pipeline's run" in line and "127.0.0.1:9" in line and "s3cret" not in line


def test_a_tracking_uri_with_credentials_is_reported_not_raised(monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://user:s3cret@127.0.0.1:9")
    lines: list[str] = []
    finish_parent_run("flowgrpo", "run-1", succeeded=False, log=lines.append)
    (line,) = lines
    assert "could not close the pipeline's run" in line and "MLFLOW_TRACKING_PASSWORD" in line and "s3cret" not in line


def test_tracking_off_is_a_no_op(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    lines: list[str] = []
    finish_parent_run("flowgrpo", "run-1", succeeded=True, log=lines.append)
    assert lines == []
