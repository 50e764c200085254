"""Every environment variable the product reads or sets, in one place: its name, default and meaning, a typed
accessor for those it reads, and :func:`apply_settings`, which every entry point calls once at its start.

The rest of the code reads the environment only through these declarations (a unit test greps for any other
read), and docs/ENVIRONMENT.md is the table ``python -m components.environ --markdown`` prints. Secrets are
declared by name only: their values are never printed, not even in an error."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from components.errors import ConfigError

T = TypeVar("T")
# read: the product reads it; set: the product sets it, for a library it calls, a process it starts or a pod it
# describes (a library may also read it where the user sets it); secret: read, and never shown
Kind = Literal["read", "set", "secret"]


# The longest wait a timeout variable may ask for: a day is no timeout any more, and Python's waits refuse past ~9e9 s.
MAX_WAIT_S = 86_400


@dataclass(frozen=True)
class Seconds:
    """Parses a wait: a finite number of seconds, more than 0 and at most ``MAX_WAIT_S`` (0 or less would give up
    at once or never, NaN passes every comparison, inf overflows the waits)."""

    rule = f"a number of seconds more than 0 and at most {MAX_WAIT_S:,} (e.g. 30 or 2.5)"

    def __call__(self, text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not 0 < value <= MAX_WAIT_S:  # False for NaN too
            raise ValueError(f"not {self.rule}")
        return value


@dataclass(frozen=True)
class Count:
    """Parses a whole number from ``least`` to ``most``."""

    least: int
    most: int

    @property
    def rule(self) -> str:
        return f"a whole number from {self.least} to {self.most}"

    def __call__(self, text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or not self.least <= value <= self.most:
            raise ValueError(f"not {self.rule}")
        return value


@dataclass(frozen=True)
class Directory:
    """Parses a folder this process may use (``~`` expanded): a directory it can write, or a path it can create
    one at, whose first existing part is such a directory (not ``/dev/null``, not a file, not read-only)."""

    rule = "a directory this process can write, or a path it can create one at"

    def __call__(self, text: str) -> Path:
        path = Path(text).expanduser()
        for existing in (path, *path.parents):
            try:
                if existing.exists():
                    break
            except OSError as exc:  # a folder on the way this process may not look into
                raise ValueError(f"{existing}: {exc.strerror} ({self.rule})") from None
        if not existing.is_dir():
            raise ValueError(f"{existing} is not a directory ({self.rule})")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"{existing} is not writable by this process ({self.rule})")
        return path


@dataclass(frozen=True)
class Variable(Generic[T]):
    """One environment variable: ``default`` is the text the product uses (or sets) when it is unset or empty."""

    name: str
    kind: Kind
    meaning: str
    parse: Callable[[str], T]
    default: str | None = None
    entry: bool = False  # set (to ``default``, when unset) by every entry point: apply_settings()
    to_workers: bool = False  # handed to Ray Train's workers (shown on the Ray dashboard: never a secret)

    def raw(self) -> str | None:
        """The text set in this process's environment (an empty value counts as unset)."""
        return os.environ.get(self.name) or None

    def get(self) -> T | None:
        """The parsed value, the default's when unset; None when unset without a default."""
        text = self.raw() or self.default
        if text is None:
            return None
        try:
            return self.parse(text)
        except ValueError as exc:
            # a parser's message may quote the text: a secret's is left out whole
            why = ": not a valid value (not shown: a secret)" if self.kind == "secret" else f"={text!r}: {exc}"
            raise ConfigError(f"environment variable {self.name}{why} ({self.meaning})") from None

    def value(self) -> T:
        """The parsed value; ConfigError naming the variable when it is unset and has no default."""
        found = self.get()
        if found is None:
            raise ConfigError(f"environment variable {self.name} is not set ({self.meaning})")
        return found

    def set_default(self) -> None:
        """Set it to its default in this process's environment unless it is set already."""
        if self.default is None:
            raise ValueError(f"{self.name} has no default to set")
        os.environ.setdefault(self.name, self.default)


def _text(name: str, kind: Kind, meaning: str, default: str | None = None, **flags: bool) -> Variable[str]:
    return Variable(name, kind, meaning, str, default, **flags)


def _seconds(name: str, meaning: str, default: float) -> Variable[float]:
    return Variable(name, "read", meaning, Seconds(), str(default))


# --- set by every entry point -------------------------------------------------------------------------------------
HF_HUB_OFFLINE = _text("HF_HUB_OFFLINE", "set", "Hugging Face libraries never reach a model hub: nothing is "
                       "downloaded at run time (models come from local paths or s3://)", "1", entry=True,
                       to_workers=True)

# --- the product's own ----------------------------------------------------------------------------------------------
FLOWGRPO_CACHE_DIR = Variable("FLOWGRPO_CACHE_DIR", "read", "this machine's (pod's) folder for copies from s3:// "
                              "(base models, datasets) and runs staged before upload", Directory(), "~/.cache/flowgrpo",
                              to_workers=True)
FLOWGRPO_EXPERIMENT_CONFIG = _text("FLOWGRPO_EXPERIMENT_CONFIG", "read", "a RayJob's experiment YAML, read by its "
                                   "entrypoint's `--config env:FLOWGRPO_EXPERIMENT_CONFIG`")
FLOWGRPO_MLFLOW_PARENT_RUN_ID = _text("FLOWGRPO_MLFLOW_PARENT_RUN_ID", "read", "the MLflow run a training run logs "
                                      "under as a child (`--mlflow-parent-run-id` wins); unset: a top-level run")
FLOWGRPO_MLFLOW_OPEN_TIMEOUT_S = _seconds("FLOWGRPO_MLFLOW_OPEN_TIMEOUT_S", "how long a run waits for the MLflow "
                                          "server at its start before it trains on and logs once it is back", 15.0)
FLOWGRPO_MLFLOW_FLUSH_TIMEOUT_S = _seconds("FLOWGRPO_MLFLOW_FLUSH_TIMEOUT_S", "how long a finished run waits to "
                                           "hand its queued metrics to MLflow before it gives up on them", 120.0)
FLOWGRPO_S3_CONNECT_TIMEOUT_S = _seconds("FLOWGRPO_S3_CONNECT_TIMEOUT_S", "seconds to connect to the S3 endpoint",
                                         10.0)
FLOWGRPO_S3_READ_TIMEOUT_S = _seconds("FLOWGRPO_S3_READ_TIMEOUT_S", "seconds to wait for an S3 answer", 60.0)
FLOWGRPO_GIT_COMMIT = _text("FLOWGRPO_GIT_COMMIT", "read", "the commit the code was built from, an MLflow lineage "
                            "tag (the images set it; unset: asked of git)")
FLOWGRPO_IMAGE = _text("FLOWGRPO_IMAGE", "read", "the image a run's pods run, an MLflow lineage tag (set on the "
                       "RayJob's pods)")
FLOWGRPO_LEASE_OWNER = _text("FLOWGRPO_LEASE_OWNER", "read", "set by `flowgrpo run --local` for its steps: the "
                              "run (pid and start time) the steps, all they start (the local Ray and its workers) "
                              "and the services a step starts are leased to; they stop when it is gone")
FLOWGRPO_JUDGE_MODEL_URI = _text("FLOWGRPO_JUDGE_MODEL_URI", "read", "the s3:// folder the VLM judge's model is "
                                 "copied from (the judge pod's init container)")
FLOWGRPO_JUDGE_MODEL_DIR = _text("FLOWGRPO_JUDGE_MODEL_DIR", "read", "where the judge pod's init container puts the "
                                 "model")

# --- object storage (boto3 reads these; the S3 Secret holds them in a cluster) --------------------------------------
AWS_ENDPOINT_URL_S3 = _text("AWS_ENDPOINT_URL_S3", "read", "the S3 endpoint (MinIO, SeaweedFS; unset: AWS)")
AWS_ENDPOINT_URL = _text("AWS_ENDPOINT_URL", "read", "the endpoint of every AWS service, S3 included, where "
                         "AWS_ENDPOINT_URL_S3 is unset")
AWS_ACCESS_KEY_ID = _text("AWS_ACCESS_KEY_ID", "secret", "the S3 access key")
AWS_SECRET_ACCESS_KEY = _text("AWS_SECRET_ACCESS_KEY", "secret", "the S3 secret key")
AWS_SESSION_TOKEN = _text("AWS_SESSION_TOKEN", "secret", "a temporary S3 credential's token (AWS SSO, an assumed "
                          "role); left out, with the rest of your AWS, of what `flowgrpo run --local` points at "
                          "its own S3")
AWS_REGION = _text("AWS_REGION", "read", "the S3 region")
AWS_DEFAULT_REGION = _text("AWS_DEFAULT_REGION", "read", "the S3 region where AWS_REGION is unset")
AWS_PROFILE = _text("AWS_PROFILE", "read", "the profile of the AWS config files to take credentials from")
# At most 20: boto3's standard mode waits up to 20 s between tries, so 20 tries may hold one request 7 minutes.
AWS_MAX_ATTEMPTS = Variable("AWS_MAX_ATTEMPTS", "read", "tries of one S3 request, the first included (boto3's "
                            "standard retry mode)", Count(1, 20), "4")
AWS_CONFIG_FILE = _text("AWS_CONFIG_FILE", "set", "the AWS config file (profiles): none (the null device) for what "
                        "`flowgrpo run --local` and `ui` point at their own S3, which no profile of yours may change")
AWS_SHARED_CREDENTIALS_FILE = _text("AWS_SHARED_CREDENTIALS_FILE", "set", "the AWS credentials file: none for what "
                                    "`flowgrpo run --local` and `ui` point at their own S3, likewise")

# --- MLflow ---------------------------------------------------------------------------------------------------------
MLFLOW_TRACKING_URI = _text("MLFLOW_TRACKING_URI", "read", "the MLflow server (or sqlite:/// store) runs log to; "
                            "unset: tracking off. Without credentials in it")
MLFLOW_TRACKING_USERNAME = _text("MLFLOW_TRACKING_USERNAME", "secret", "the MLflow server's user")
MLFLOW_TRACKING_PASSWORD = _text("MLFLOW_TRACKING_PASSWORD", "secret", "the MLflow user's password")
MLFLOW_TRACKING_TOKEN = _text("MLFLOW_TRACKING_TOKEN", "secret", "an MLflow bearer token, instead of user and "
                              "password")
MLFLOW_HTTP_REQUEST_MAX_RETRIES = _text("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "set", "MLflow's own retries of a "
                                        "request (the tracker retries on its own terms)", "1", to_workers=True)
MLFLOW_HTTP_REQUEST_TIMEOUT = _text("MLFLOW_HTTP_REQUEST_TIMEOUT", "set", "seconds MLflow waits for one answer",
                                    "30", to_workers=True)
MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL = _text("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "read", "seconds between "
                                                "MLflow's system metrics samples (MLflow's default)", to_workers=True)
MLFLOW_SERVER_ENABLE_JOB_EXECUTION = _text("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "set", "the local MLflow server "
                                           "starts no job runner (about 15 processes otherwise)", "false")
MLFLOW_DISABLE_TELEMETRY = _text("MLFLOW_DISABLE_TELEMETRY", "set", "the local MLflow server sends no telemetry",
                                 "true")
MLFLOW_S3_ENDPOINT_URL = _text("MLFLOW_S3_ENDPOINT_URL", "set", "the S3 endpoint the local MLflow server keeps "
                               "artifacts at")

# --- Ray --------------------------------------------------------------------------------------------------------
RAY_ADDRESS = _text("RAY_ADDRESS", "read", "the Ray cluster training joins (a RayJob's); unset: a Ray of its own, "
                    "whose address the trainer sets here for the processes Ray starts")
RAY_GCS_SERVER_PORT = _text("RAY_GCS_SERVER_PORT", "set", "the port of the Ray the trainer starts itself")
RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S = _text("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "set", "how long Ray Train "
                                               "waits to place its workers: `distributed.start_timeout_s`")
RAY_TRAIN_ENABLE_PRINT_PATCH = _text("RAY_TRAIN_ENABLE_PRINT_PATCH", "set", "Ray Train would send each of the "
                                     "workers' status lines to the driver twice", "0")
RAY_AUTH_MODE = _text("RAY_AUTH_MODE", "set", "`flowgrpo run --local`'s Ray runs without token auth (a cluster's "
                      "keeps it on)", "disabled")
RAY_TMPDIR = _text("RAY_TMPDIR", "set", "`flowgrpo run --local`'s Ray files, in a short folder (unix socket paths "
                   "stay under 108 bytes)")

# --- the RayJob's and reward server's pods ------------------------------------------------------------------------
GLOO_SOCKET_IFNAME = _text("GLOO_SOCKET_IFNAME", "set", "the pods' interface gloo binds: `cluster.network_interface`")
NCCL_SOCKET_IFNAME = _text("NCCL_SOCKET_IFNAME", "set", "the pods' interface NCCL binds: `cluster.network_interface`")
HOME = _text("HOME", "set", "the pods' home, on their writable emptyDir (the root filesystem is read-only)", "/tmp")
OMP_NUM_THREADS = _text("OMP_NUM_THREADS", "set", "the reward server pod's threads: its CPU limit")
TRANSFORMERS_OFFLINE = _text("TRANSFORMERS_OFFLINE", "set", "the VLM judge pod loads nothing from a model hub", "1")
VLLM_CACHE_ROOT = _text("VLLM_CACHE_ROOT", "set", "the VLM judge pod's vLLM cache, on its emptyDir")
VLLM_NO_USAGE_STATS = _text("VLLM_NO_USAGE_STATS", "set", "the VLM judge pod sends no usage statistics", "1")

# --- everything else ------------------------------------------------------------------------------------------------
TMPDIR = _text("TMPDIR", "set", "`flowgrpo run --local`'s temporary files, under its work directory")
TRANSFORMERS_VERBOSITY = _text("TRANSFORMERS_VERBOSITY", "set", "transformers' chatter out of the progress output",
                               "error")
DIFFUSERS_VERBOSITY = _text("DIFFUSERS_VERBOSITY", "set", "diffusers' chatter out of the progress output", "error")
KFP_TOKEN = _text("KFP_TOKEN", "secret", "the bearer token `flowgrpo submit` sends to the Kubeflow Pipelines API")
KUBERNETES_SERVICE_HOST = _text("KUBERNETES_SERVICE_HOST", "read", "set inside a pod: the launchers use the pod's "
                                "service account, else the kubeconfig")
KUBECONFIG = _text("KUBECONFIG", "read", "the kubeconfig of the launchers outside a cluster (the Kubernetes "
                   "client's default: ~/.kube/config)")
VLM_JUDGE_API_KEY = _text("VLM_JUDGE_API_KEY", "secret", "the VLM judge's API key, the default of a judge "
                          "reward's `api_key_env`; that key may name this variable or one named "
                          "`VLM_JUDGE_API_KEY_<NAME>` (e.g. `VLM_JUDGE_API_KEY_OPENAI`), no other")

VARIABLES: tuple[Variable[Any], ...] = tuple(v for v in dict(globals()).values() if isinstance(v, Variable))


def declared(name: str) -> Variable[Any] | None:
    """The declaration of ``name``; None when the product does not declare it."""
    return next((v for v in VARIABLES if v.name == name), None)


def entry_settings() -> dict[str, str]:
    """What every entry point sets (unless set already): the environment a process started for one needs."""
    return {v.name: v.default for v in VARIABLES if v.entry and v.default is not None}


def apply_settings() -> None:
    """Called once at the start of every entry point: sets each of :func:`entry_settings` that is unset."""
    for name, value in entry_settings().items():
        os.environ.setdefault(name, value)


def check_settings() -> None:
    """Called by every entry point before it reads or writes anything: each declared variable that is set parsed
    now, so a value out of range stops it in one line naming the variable (a ConfigError; each bad one, joined),
    not minutes later where it is first read (an S3 timeout at the first download, MLflow's flush after training)."""
    problems = []
    for variable in VARIABLES:
        try:
            if variable.raw() is not None:
                variable.get()
        except ConfigError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("; ".join(problems))


def worker_settings() -> dict[str, str]:
    """What Ray Train's workers get of this process's environment (none of it secret), entry settings included."""
    return entry_settings() | {v.name: text for v in VARIABLES if v.to_workers and (text := v.raw())}


def named_by_user(name: str) -> str | None:
    """The variable a command line names (``--config env:NAME``); None when unset."""
    return os.environ.get(name)


# The variables a config may name for a judge's key. A config comes from whoever starts a run (on a cluster, the
# KFP UI) and the key goes to the URL that config gives: any other name would send the pod's S3 or MLflow
# credentials there.
_JUDGE_KEY = re.compile(rf"{VLM_JUDGE_API_KEY.name}(_[A-Z0-9]+)*")
JUDGE_KEY_NAMES = f"{VLM_JUDGE_API_KEY.name} or {VLM_JUDGE_API_KEY.name}_<NAME> (NAME: A-Z, 0-9, _)"


def judge_key_name(name: str) -> str:
    """``name`` when a judge's key may be read from it; ValueError naming the allowed names otherwise."""
    if not _JUDGE_KEY.fullmatch(name):
        raise ValueError(f"must be {JUDGE_KEY_NAMES}: the key is sent to base_url, so a config may name no "
                         "other variable")
    return name


def judge_key(name: str) -> str | None:
    """The judge's key held in variable ``name`` (checked by :func:`judge_key_name`); None when unset."""
    return os.environ.get(judge_key_name(name)) or None


# The AWS_* variables that set the product's own S3 client rather than name an AWS account: what a process pointed
# at an S3 of the product's own keeps of the caller's.
_OWN_S3_KEEPS = frozenset({AWS_MAX_ATTEMPTS.name})


def own_s3(values: Mapping[str, str], env: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The changes that point ``env`` (default: this process's environment) at an S3 of the product's own
    (`run --local`'s SeaweedFS) and nothing else: ``values`` (its endpoint, keys, region) set, every other
    ``AWS_*`` variable unset (None), AWS's config and credentials files none. The rest is the user's AWS (the
    session token of SSO or an assumed role, a profile, a FIPS endpoint), which boto3 would combine with the
    local keys and the local S3 refuses."""
    env = os.environ if env is None else env
    unset = {name: None for name in env if name.startswith("AWS_") and name not in _OWN_S3_KEEPS}
    return {**unset, AWS_CONFIG_FILE.name: os.devnull, AWS_SHARED_CREDENTIALS_FILE.name: os.devnull, **values}


def changed(env: Mapping[str, str], changes: Mapping[str, str | None]) -> dict[str, str]:
    """``env`` with ``changes`` made (None: removed), e.g. the environment of a process to start."""
    return {k: v for k, v in {**env, **changes}.items() if v is not None}


def _apply(values: Mapping[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextlib.contextmanager
def patched_environ(values: Mapping[str, str | None]) -> Iterator[None]:
    """``os.environ`` with ``values`` set (None: unset), restored on exit."""
    saved = {k: os.environ.get(k) for k in values}
    _apply(values)
    try:
        yield
    finally:
        _apply(saved)


def markdown() -> str:
    """docs/ENVIRONMENT.md: every declared variable in one table."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = [f"| `{v.name}` | {v.kind} | {'' if v.default is None else f'`{v.default}`'} | "
            f"{cell(v.meaning)}{'; set by every entry point when unset' if v.entry else ''}"
            f"{f'. Accepts {rule}' if (rule := getattr(v.parse, 'rule', None)) else ''} |" for v in VARIABLES]
    return "\n".join([
        "# Environment variables",
        "",
        "Every environment variable the product reads or sets. Generated from `components/environ.py` by",
        "`python -m components.environ --markdown > docs/ENVIRONMENT.md`; a unit test keeps the two equal.",
        "",
        "Kind: *read*, the product reads it; *set*, the product sets it for a library it calls, a process it starts",
        "or a pod it describes; *secret*, read and never shown (named here, never given a value). Default: the",
        "value used (or set) when the variable is unset or empty. A variable whose meaning ends in \"Accepts ...\" is",
        "checked at the start of every entry point (the `flowgrpo` commands, the reward server, a RayJob's trainer,",
        "each pipeline step) before it reads or writes anything: a value outside that range stops it in one line",
        "naming the variable.",
        "",
        "| Variable | Kind | Default | Meaning |",
        "|---|---|---|---|",
        *rows,
        "",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m components.environ", description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", required=True,
                        help="print docs/ENVIRONMENT.md: every variable with its kind, default and meaning")
    parser.parse_args(argv)
    print(markdown(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
