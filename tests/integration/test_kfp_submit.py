"""`flowgrpo submit` against a local HTTP server implementing the KFP v2beta1 endpoints the kfp client calls
(healthz, pipelines + upload, pipeline versions + upload, experiments, runs); the request bodies are checked."""

from __future__ import annotations

import email.parser
import email.policy
import json
import threading
import uuid
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from urllib.parse import parse_qs, urlparse

import pytest
import yaml

from pipeline.cli import main


class FakeKfp:
    """Just enough of the KFP API server: in-memory pipelines, versions, experiments and runs."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict]] = []
        self.pipelines: dict[str, dict] = {}
        self.versions: dict[str, list[dict]] = {}
        self.uploads: list[bytes] = []
        self.experiments: dict[str, dict] = {}
        self.runs: list[dict] = []
        self.fail_runs_with: int | None = None


def _handler(state: FakeKfp):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # keep pytest output clean
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _record(self) -> tuple[str, dict]:
            url = urlparse(self.path)
            state.requests.append((self.command, url.path, {k.lower(): v for k, v in self.headers.items()}))
            return url.path, parse_qs(url.query)

        def _upload(self) -> bytes:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
                f"Content-Type: {self.headers['Content-Type']}\r\n\r\n".encode() + body)
            (part,) = [p for p in message.iter_parts() if p.get_param("name", header="content-disposition")
                       == "uploadfile"]
            data = part.get_payload(decode=True)
            state.uploads.append(data)
            return data

        def do_GET(self) -> None:
            path, query = self._record()
            if path == "/apis/v2beta1/healthz":
                return self._send(200, {"multi_user": False})
            if path == "/apis/v2beta1/pipelines":
                name = _filter_value(query)
                found = [p for p in state.pipelines.values() if name in (None, p["display_name"])]
                return self._send(200, {"pipelines": found, "total_size": len(found)})
            if path.startswith("/apis/v2beta1/pipelines/") and path.endswith("/versions"):
                pid = path.split("/")[4]
                return self._send(200, {"pipeline_versions": state.versions.get(pid, []),
                                        "total_size": len(state.versions.get(pid, []))})
            if path == "/apis/v2beta1/experiments":
                name = _filter_value(query)
                found = [e for e in state.experiments.values() if name in (None, e["display_name"])]
                return self._send(200, {"experiments": found, "total_size": len(found)})
            return self._send(404, {"error": f"no route {path}"})

        def do_POST(self) -> None:
            path, query = self._record()
            if path == "/apis/v2beta1/pipelines/upload":
                self._upload()
                pid = str(uuid.uuid4())
                name = query["name"][0]
                state.pipelines[pid] = {"pipeline_id": pid, "display_name": name}
                state.versions[pid] = [{"pipeline_id": pid, "pipeline_version_id": str(uuid.uuid4()),
                                        "display_name": name}]
                return self._send(200, state.pipelines[pid])
            if path == "/apis/v2beta1/pipelines/upload_version":
                self._upload()
                pid = query["pipelineid"][0]
                version = {"pipeline_id": pid, "pipeline_version_id": str(uuid.uuid4()),
                           "display_name": query["name"][0]}
                state.versions[pid].append(version)
                return self._send(200, version)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if path == "/apis/v2beta1/experiments":
                eid = str(uuid.uuid4())
                state.experiments[eid] = {**body, "experiment_id": eid}
                return self._send(200, state.experiments[eid])
            if path == "/apis/v2beta1/runs":
                if state.fail_runs_with:
                    return self._send(state.fail_runs_with, {"error": "quota exceeded", "code": 8})
                run = {**body, "run_id": str(uuid.uuid4()), "state": "PENDING"}
                state.runs.append(run)
                return self._send(200, run)
            return self._send(404, {"error": f"no route {path}"})

    return Handler


def _filter_value(query: dict) -> str | None:
    if "filter" not in query:
        return None
    predicates = json.loads(query["filter"][0])["predicates"]
    return next(p.get("string_value") or p.get("stringValue") for p in predicates)


@pytest.fixture
def kfp_server():
    state = FakeKfp()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_submit_uploads_once_creates_experiment_and_run(kfp_server, monkeypatch, capsys, tmp_path):
    state, host = kfp_server
    monkeypatch.setenv("KFP_TOKEN", "tok-123")
    config = tmp_path / "exp.yaml"
    config.write_text("train:\n  epochs: 3\n")
    argv = ["submit", "--host", host, "--experiment", "ci-flowgrpo", "--run-name", "nightly-1", "--config",
            str(config), 'overrides=["sampling.group_size=4"]', "storage_root=s3://bucket/fg", "--eval-gpus", "0"]
    assert main(argv) == 0
    assert "submitted run" in capsys.readouterr().out

    # First submit: the pipeline, then its version named by package version + content hash.
    assert len(state.uploads) == 2 and state.uploads[0] == state.uploads[1]
    spec, platform = yaml.safe_load_all(state.uploads[1])
    assert "secretAsEnv" in json.dumps(platform)
    assert spec["pipelineInfo"]["name"] == "flowgrpo"
    inputs = spec["root"]["inputDefinitions"]["parameters"]
    assert set(inputs) == {"config", "overrides", "storage_root", "ray_workers", "launcher"}
    assert inputs["launcher"]["defaultValue"] == "kubernetes"  # a cluster run starts its parts on the cluster
    (experiment,) = state.experiments.values()
    assert experiment["display_name"] == "ci-flowgrpo"
    (run,) = state.runs
    assert run["display_name"] == "nightly-1"
    assert run["service_account"] == "flowgrpo-pipeline-runner"  # the Role of manifests/base, not KFP's default
    assert run["experiment_id"] == experiment["experiment_id"]
    pid, (_, version) = next(iter(state.versions.items()))
    assert version["display_name"].startswith(metadata.version("flowgrpo-mlops") + "-")
    assert run["pipeline_version_reference"] == {"pipeline_id": pid,
                                                 "pipeline_version_id": version["pipeline_version_id"]}
    params = run["runtime_config"]["parameters"]
    assert params["config"] == "train:\n  epochs: 3\n"
    assert params["overrides"] == ["sampling.group_size=4"]
    assert params["storage_root"] == "s3://bucket/fg"
    assert "launcher" not in params
    assert all(h.get("authorization") == "Bearer tok-123" for _, _, h in state.requests)

    # The same code again: the version is reused (no upload), the experiment found, a second run created.
    assert main([*argv[:6], "nightly-2", *argv[7:]]) == 0
    assert len(state.uploads) == 2 and len(state.experiments) == 1 and len(state.runs) == 2
    assert state.runs[1]["display_name"] == "nightly-2"
    assert main([*argv, "--service-account", "team-a-runner"]) == 0  # the user's own
    assert state.runs[2]["service_account"] == "team-a-runner"
    assert state.runs[1]["pipeline_version_reference"] == run["pipeline_version_reference"]


def test_submit_refuses_bad_config_before_any_request(kfp_server, capsys):
    state, host = kfp_server
    assert main(["submit", "--host", host, 'overrides=["train.epochs=-1"]']) == 2
    assert "train.epochs" in capsys.readouterr().err
    assert state.requests == []


def test_submit_reports_server_error_in_one_line(kfp_server, capsys):
    state, host = kfp_server
    state.fail_runs_with = 429
    assert main(["submit", "--host", host, "config=tiny-cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "429" in err[0] and "quota exceeded" in err[0]


def test_submit_unreachable_endpoint(capsys):
    assert main(["submit", "--host", "http://127.0.0.1:9", "config=tiny-cpu"]) == 2
    assert "cannot reach Kubeflow Pipelines at http://127.0.0.1:9" in capsys.readouterr().err


def test_submit_sends_a_shipped_config_by_name_and_refuses_a_missing_file_before_any_request(kfp_server, capsys,
                                                                                           tmp_path):
    state, host = kfp_server
    assert main(["submit", "--host", host, "--config", "sd35-medium-ocr", "--eval-gpus", "0"]) == 0
    (run,) = state.runs
    assert run["runtime_config"]["parameters"]["config"] == "sd35-medium-ocr"  # the images ship the same file
    capsys.readouterr()
    requests = len(state.requests)
    assert main(["submit", "--host", host, "--config", str(tmp_path / "my.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"config file {tmp_path / 'my.yaml'} does not exist" in err[0], err
    assert "not a known config name" not in err[0]
    assert len(state.requests) == requests


def test_submit_mutes_only_kfps_version_notice(capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["submit", "--host", "http://127.0.0.1:9", "config=tiny-cpu"]) == 2
        warnings.warn("another FutureWarning", FutureWarning, stacklevel=1)  # the filter is not left behind
    assert [str(w.message) for w in caught] == ["another FutureWarning"]
    assert "cannot reach Kubeflow Pipelines" in capsys.readouterr().err
