"""components/environ.py: the declared environment variables, their typed accessors, the settings every entry point
applies, the generated docs/ENVIRONMENT.md, and that the code reads no variable it does not declare."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest
from aws_users import SSO_ENV, SSO_TOKEN, sso_user  # tests/aws_users.py

from components import environ, storage
from components.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SOURCES = sorted([*REPO.glob("components/**/*.py"), *REPO.glob("pipeline/**/*.py")])
# A string that is an environment variable's name when it stands alone: these prefixes are the libraries and
# services the product configures through the environment.
ENV_NAME = re.compile(r"(FLOWGRPO|HF|MLFLOW|AWS|RAY|NCCL|GLOO|KFP|VLLM|TRANSFORMERS|DIFFUSERS|KUBERNETES|OMP|CUDA|"
                      r"TORCH|PYTORCH|TOKENIZERS)_[A-Z0-9_]+")
# os.environ read or written by a name inside a string that is code (a script a pod runs)
SCRIPT_READ = re.compile(r"""os\.environ(?:\.get|\.setdefault|\.pop)?[\[(]\s*["'](\w+)["']|os\.getenv\(\s*["'](\w+)""")
ENVIRON_METHODS = {"get", "setdefault", "pop", "update", "__getitem__", "__setitem__", "__delitem__", "copy", "keys",
                   "items", "values"}


def _is_os_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name) \
        and node.value.id == "os"


def direct_reads(source: str) -> list[str]:
    """Where ``source`` reads or sets os.environ by a name (not the whole environment handed on to a child)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Subscript) and _is_os_environ(node.value):
            found.append(f"line {node.lineno}: os.environ[...]")
        elif isinstance(node, ast.Attribute) and _is_os_environ(node.value) and node.attr in ENVIRON_METHODS:
            found.append(f"line {node.lineno}: os.environ.{node.attr}")
        elif isinstance(node, ast.Attribute) and node.attr in ("getenv", "putenv", "unsetenv") \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            found.append(f"line {node.lineno}: os.{node.attr}")
        elif isinstance(node, ast.Compare) and any(_is_os_environ(c) for c in node.comparators):
            found.append(f"line {node.lineno}: ... in os.environ")
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and {a.name for a in node.names} & {"environ", "getenv", "putenv"}:
            found.append(f"line {node.lineno}: from os import ...")
    return found


def named_variables(source: str) -> set[str]:
    """The environment variable names ``source`` spells: strings that are such a name and nothing else, and the
    names a script in a string reads."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if ENV_NAME.fullmatch(node.value):
                names.add(node.value)
            for match in SCRIPT_READ.finditer(node.value):
                names.add(match.group(1) or match.group(2))
        elif isinstance(node, ast.Dict) and any(k is None and _is_os_environ(v)
                                                for k, v in zip(node.keys, node.values, strict=True)):
            # {**os.environ, "NAME": value}: a child's environment
            names |= {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        elif isinstance(node, ast.Dict) and {"name", "value"} <= {getattr(k, "value", None) for k in node.keys}:
            # {"name": "NAME", "value": ...}: a container's environment
            entry = dict(zip([getattr(k, "value", None) for k in node.keys], node.values, strict=True))
            if isinstance(entry["name"], ast.Constant):
                names.add(entry["name"].value)
    return names


def test_the_scan_finds_a_new_read_and_a_new_name():
    """The two scans below would fail on a variable read without a declaration (their own test)."""
    source = ('import os\nA = os.environ.get("FLOWGRPO_NEW")\nB = os.getenv("X")\nC = "Y" in os.environ\n'
              'D = os.environ["Z"]\nE = {**os.environ, "OTHER": "1"}\n'
              'F = [{"name": "POD_VAR", "value": "1"}]\nG = "import os; os.environ[\'SCRIPTED\']"\n')
    assert len(direct_reads(source)) == 4
    assert named_variables(source) == {"FLOWGRPO_NEW", "OTHER", "POD_VAR", "SCRIPTED"}
    assert direct_reads("import os\nenv = dict(os.environ)\nchild = os.environ | {}\n") == []


def test_the_environment_is_read_only_through_components_environ():
    readers = {str(p.relative_to(REPO)): found for p in SOURCES
               if p != REPO / "components" / "environ.py" and (found := direct_reads(p.read_text()))}
    assert not readers, ("read these through a declaration in components/environ.py (Variable.get / value / "
                         "set_default, named_by_user for a name a command line gives, judge_key for a judge's key): "
                         f"{readers}")


def test_every_variable_the_code_names_is_declared():
    undeclared = {str(p.relative_to(REPO)): sorted(n for n in named_variables(p.read_text())
                                                   if environ.declared(n) is None) for p in SOURCES}
    undeclared = {path: names for path, names in undeclared.items() if names}
    assert not undeclared, f"declare these in components/environ.py (name, kind, default, meaning): {undeclared}"


def test_declarations_are_unique_and_secrets_stay_secret():
    names = [v.name for v in environ.VARIABLES]
    assert len(names) == len(set(names))
    assert len(names) > 40
    for variable in environ.VARIABLES:
        assert variable.meaning and variable.kind in ("read", "set", "secret"), variable.name
        if variable.kind == "secret":  # neither a default value nor a trip through Ray's dashboard
            assert variable.default is None and not variable.to_workers and not variable.entry, variable.name


def test_docs_environment_md_is_the_generated_table():
    assert (REPO / "docs" / "ENVIRONMENT.md").read_text() == environ.markdown(), (
        "docs/ENVIRONMENT.md is stale: run `python -m components.environ --markdown > docs/ENVIRONMENT.md`")


def test_the_table_has_one_row_per_variable_without_secret_values(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2-secret")
    text = environ.markdown()
    assert "hunter2-secret" not in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [v.name for v in environ.VARIABLES]
    assert "| `AWS_SECRET_ACCESS_KEY` | secret |  |" in text
    assert "| `FLOWGRPO_MLFLOW_FLUSH_TIMEOUT_S` | read | `120.0` |" in text


def test_main_prints_the_table(capsys):
    assert environ.main(["--markdown"]) == 0
    assert capsys.readouterr().out == environ.markdown()


# --- typed accessors ------------------------------------------------------------------------------------------------

def test_a_number_defaults_when_unset_or_empty_and_parses_when_set(monkeypatch):
    variable = environ.FLOWGRPO_MLFLOW_OPEN_TIMEOUT_S
    monkeypatch.delenv(variable.name, raising=False)
    assert variable.value() == 15.0
    monkeypatch.setenv(variable.name, "")
    assert variable.value() == 15.0
    monkeypatch.setenv(variable.name, "2.5")
    assert variable.value() == 2.5


def test_a_bad_number_names_the_variable_and_its_value(monkeypatch):
    monkeypatch.setenv("FLOWGRPO_S3_READ_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match=r"environment variable FLOWGRPO_S3_READ_TIMEOUT_S='soon': not a number"):
        environ.FLOWGRPO_S3_READ_TIMEOUT_S.value()


def test_a_whole_number_refuses_a_fraction(monkeypatch):
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3.5")
    with pytest.raises(ConfigError, match=r"AWS_MAX_ATTEMPTS='3.5': not a whole number"):
        environ.AWS_MAX_ATTEMPTS.value()
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "7")
    assert environ.AWS_MAX_ATTEMPTS.value() == 7


def test_the_s3_client_reports_a_bad_setting_by_name(monkeypatch):
    monkeypatch.setenv("FLOWGRPO_S3_CONNECT_TIMEOUT_S", "ten")
    with pytest.raises(ConfigError, match="FLOWGRPO_S3_CONNECT_TIMEOUT_S='ten'"):
        storage._client()


def test_a_secret_that_does_not_parse_is_named_but_not_shown(monkeypatch):
    secret = environ.Variable("FLOWGRPO_TEST_PIN", "secret", "a test PIN", int)
    monkeypatch.setenv(secret.name, "hunter2")
    with pytest.raises(ConfigError, match="FLOWGRPO_TEST_PIN") as caught:
        secret.get()
    assert "hunter2" not in str(caught.value)


def test_unset_without_default(monkeypatch):
    monkeypatch.delenv("FLOWGRPO_MLFLOW_PARENT_RUN_ID", raising=False)
    assert environ.FLOWGRPO_MLFLOW_PARENT_RUN_ID.get() is None
    with pytest.raises(ConfigError, match="environment variable FLOWGRPO_MLFLOW_PARENT_RUN_ID is not set"):
        environ.FLOWGRPO_MLFLOW_PARENT_RUN_ID.value()
    with pytest.raises(ValueError, match="no default"):
        environ.FLOWGRPO_MLFLOW_PARENT_RUN_ID.set_default()


def test_the_cache_folder_is_under_home_unless_set(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("FLOWGRPO_CACHE_DIR", raising=False)
    assert storage.cache_root() == tmp_path / ".cache" / "flowgrpo"
    monkeypatch.setenv("FLOWGRPO_CACHE_DIR", "~/elsewhere")
    assert storage.cache_root() == tmp_path / "elsewhere"


def test_set_default_keeps_what_the_user_set(monkeypatch):
    monkeypatch.delenv("TRANSFORMERS_VERBOSITY", raising=False)
    environ.TRANSFORMERS_VERBOSITY.set_default()
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "error"
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
    environ.TRANSFORMERS_VERBOSITY.set_default()
    assert os.environ["TRANSFORMERS_VERBOSITY"] == "info"


# --- what entry points and the processes they start get -------------------------------------------------------------

def test_apply_settings_sets_hub_offline_unless_set(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    environ.apply_settings()
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    environ.apply_settings()
    assert os.environ["HF_HUB_OFFLINE"] == "0"


def test_ray_workers_get_the_entry_settings_and_no_secret(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", raising=False)
    monkeypatch.setenv("FLOWGRPO_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "pw")
    settings = environ.worker_settings()
    assert settings["HF_HUB_OFFLINE"] == "1" and settings["FLOWGRPO_CACHE_DIR"] == str(tmp_path)
    assert "s3cr3t" not in settings.values() and "pw" not in settings.values()
    assert "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL" not in settings  # unset here: not invented for the workers


def _trainer_main(argv):
    from components.trainer.entry import main
    return main(argv)


def _reward_server_main(argv):
    from components.reward_server.entry import main
    return main(argv)


def _cli_main(argv):
    from pipeline.cli import main
    return main(argv)


def _drain_main(argv):
    from components.trainer.drain import main
    return main(argv)


def _pretrain_main(argv):
    from components.models.shapes_pretrain import main
    return main(argv)


@pytest.mark.parametrize("main", [_trainer_main, _reward_server_main, _cli_main, _drain_main, _pretrain_main])
def test_every_entry_point_applies_the_settings(main, monkeypatch, capsys):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ["HF_HUB_OFFLINE"] == "1"


def _signing(client) -> tuple[str, str | None]:
    credentials = client._request_signer._credentials.get_frozen_credentials()
    return credentials.access_key, credentials.token


def test_an_s3_of_our_own_gets_none_of_the_users_aws_and_a_real_s3_keeps_the_session_token(monkeypatch, tmp_path):
    """The S3 client's credentials as boto3 resolves them (no request is sent): against AWS, the user's session
    credentials with their token; pointed at the local S3 (``own_s3``, what `run --local` gives its steps and
    services), the local keys alone (before: the user's token went along and SeaweedFS answered 403)."""
    sso_user(monkeypatch, tmp_path)
    assert _signing(storage._client()) == ("ASIAUSERSESSIONKEY", SSO_TOKEN)

    local = {"AWS_ENDPOINT_URL_S3": "http://127.0.0.1:8333", "AWS_ACCESS_KEY_ID": "AKLOCAL",
             "AWS_SECRET_ACCESS_KEY": "SKLOCAL", "AWS_REGION": "us-east-1"}
    with environ.patched_environ(environ.own_s3(local)):
        client = storage._client()
        assert _signing(client) == ("AKLOCAL", None)
        assert client.meta.endpoint_url == "http://127.0.0.1:8333"
        assert not {name for name in os.environ if name.startswith("AWS_")} - {*local, "AWS_CONFIG_FILE",
                                                                            "AWS_SHARED_CREDENTIALS_FILE"}
    assert {name: os.environ[name] for name in SSO_ENV} == SSO_ENV  # the user's AWS is back afterwards
    assert _signing(storage._client()) == ("ASIAUSERSESSIONKEY", SSO_TOKEN)


def test_an_s3_of_our_own_keeps_the_products_retry_setting(monkeypatch, tmp_path):
    sso_user(monkeypatch, tmp_path)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "7")
    changes = environ.own_s3({"AWS_ACCESS_KEY_ID": "AKLOCAL"})
    assert "AWS_MAX_ATTEMPTS" not in changes and changes["AWS_SESSION_TOKEN"] is None
    assert changes["AWS_CONFIG_FILE"] == os.devnull and changes["AWS_ACCESS_KEY_ID"] == "AKLOCAL"
# --- ranges, checked at every entry point's start -------------------------------------------------------------------

BAD_VALUES = [
    # Before: -5 and 0 a 62-line botocore traceback at the first S3 call, inf and nan an unnamed HTTPClientError.
    *(("FLOWGRPO_S3_CONNECT_TIMEOUT_S", v) for v in ("-5", "0", "inf", "nan", "1e10")),
    *(("FLOWGRPO_S3_READ_TIMEOUT_S", v) for v in ("-5", "0", "inf", "nan")),
    # Before: inf a traceback once config.yaml was written; -5 accepted, a 20 s run took 125 s.
    *(("FLOWGRPO_MLFLOW_OPEN_TIMEOUT_S", v) for v in ("inf", "-5")),
    # Before: reported only after training, once the LoRA was written.
    ("FLOWGRPO_MLFLOW_FLUSH_TIMEOUT_S", "abc"),
    # Before: -5 a 37-line botocore traceback; 0 and 21 accepted.
    *(("AWS_MAX_ATTEMPTS", v) for v in ("-5", "0", "21", "3.5")),
    # Before: a 30-line traceback where the first copy from s3:// was made.
    *(("FLOWGRPO_CACHE_DIR", v) for v in ("/dev/null", "/dev/null/flowgrpo")),
]


@pytest.mark.parametrize(("name", "value"), BAD_VALUES, ids=[f"{n}={v}" for n, v in BAD_VALUES])
def test_a_value_out_of_range_is_refused_in_one_line_naming_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        environ.check_settings()
    message = str(info.value)
    assert message.startswith(f"environment variable {name}={value!r}: ") and "\n" not in message, message
    assert "Accepts" not in message and environ.declared(name).parse.rule in message  # the range it takes


def test_values_in_range_pass_and_every_bad_one_is_named(monkeypatch, tmp_path):
    for name, value in [("FLOWGRPO_S3_READ_TIMEOUT_S", "0.5"), ("FLOWGRPO_MLFLOW_FLUSH_TIMEOUT_S", "86400"),
                        ("AWS_MAX_ATTEMPTS", "1"), ("FLOWGRPO_CACHE_DIR", str(tmp_path / "not" / "yet"))]:
        monkeypatch.setenv(name, value)
    environ.check_settings()
    assert environ.FLOWGRPO_CACHE_DIR.value() == tmp_path / "not" / "yet" and environ.AWS_MAX_ATTEMPTS.value() == 1
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("FLOWGRPO_CACHE_DIR", str(tmp_path / "file" / "cache"))
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "20.5")
    with pytest.raises(ConfigError) as info:
        environ.check_settings()
    assert str(info.value).count("environment variable ") == 2
    assert f"FLOWGRPO_CACHE_DIR='{tmp_path}/file/cache': {tmp_path}/file is not a directory" in str(info.value)


def _train_cli(output):
    from pipeline.cli import main
    return main(["train", "--config", "tiny-cpu", "--output", str(output)])


def _trainer_entry(output):
    from components.trainer.entry import main
    return main(["--config", str(REPO / "pipeline" / "configs" / "tiny-cpu.yaml"), "--output", str(output)])


def _reward_server_entry(output):
    from components.reward_server.entry import main
    return main(["--rewards", "brightness", "--port", "1"])  # would fail to bind, were it reached


@pytest.mark.parametrize("main", [_train_cli, _trainer_entry, _reward_server_entry])
def test_every_entry_point_refuses_a_bad_value_before_any_work(main, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("FLOWGRPO_MLFLOW_OPEN_TIMEOUT_S", "inf")
    assert main(tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: environment variable FLOWGRPO_MLFLOW_OPEN_TIMEOUT_S='inf'" in err, err
    assert not (tmp_path / "run").exists()


def test_every_pipeline_step_checks_the_settings_first(monkeypatch):
    from pipeline import kfp_pipeline, steps

    monkeypatch.setenv("FLOWGRPO_S3_READ_TIMEOUT_S", "nan")
    with pytest.raises(ConfigError, match="FLOWGRPO_S3_READ_TIMEOUT_S='nan'"):
        steps.step_config("tiny-cpu", [])
    components = [kfp_pipeline.prepare_dataset, kfp_pipeline.deploy_reward_server, kfp_pipeline.train,
                  kfp_pipeline.evaluate, kfp_pipeline.register, kfp_pipeline.teardown]
    for component in components:  # what KFP ships to the pod: the function's own source
        assert "steps.step_config(config, overrides)" in component.component_spec.implementation.container.command[-1]


def test_the_s3_client_makes_as_many_tries_as_aws_max_attempts_says(monkeypatch):
    """AWS_MAX_ATTEMPTS counts the first try, as for every AWS tool (before: one try more: it went to botocore's
    ``max_attempts``, which counts retries)."""
    import http.server
    import threading

    tries = []

    class Unavailable(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            tries.append(self.path)
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{server.server_port}")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
        monkeypatch.setenv("AWS_REGION", "us-east-1")
        for attempts in (1, 2):
            monkeypatch.setenv("AWS_MAX_ATTEMPTS", str(attempts))
            tries.clear()
            with pytest.raises(storage.StorageError):
                storage.get_bytes("s3://bucket/key")
            assert len(tries) == attempts
    finally:
        server.shutdown()
