"""``flowgrpo``: the command line. Errors the user can fix print one line and exit 2."""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from components import environ
from components.console import quiet_libraries, status_line
from components.dataset.config import BUILTIN_KINDS, PrepareConfig
from components.deploy_defaults import STORAGE_ROOT
from components.errors import ConfigError, exit_status
from components.launch.kubernetes.podspec import PIPELINE_SERVICE_ACCOUNT
from components.reward_server import entry as reward_server_entry
from components.trainer import entry as trainer_entry
from pipeline.config import DEFAULT_CONFIG, load_config
from pipeline.local_run import DEFAULT_UI_PORT
from pipeline.steps import run_output


@dataclass(frozen=True)
class Command:
    """A subcommand: its name, its line in ``flowgrpo --help``, its own ``--help`` text, its options and its run."""

    name: str
    help: str
    description: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


COMMANDS: list[Command] = []  # in the order ``flowgrpo --help`` lists them


def command(name: str, help: str, add_arguments: Callable[[argparse.ArgumentParser], None],
            description: str | None = None) -> Callable[[Callable[[argparse.Namespace], int]], Callable]:
    """Register the decorated function as subcommand ``name``; its docstring is the ``--help`` description
    unless ``description`` is given."""
    def register(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        COMMANDS.append(Command(name, help, description or inspect.getdoc(run) or "", add_arguments, run))
        return run
    return register


# -- options more than one command takes ----------------------------------------------------------------------
def _add_config_args(p: argparse.ArgumentParser) -> None:
    from pipeline.config import example_configs

    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, metavar="FILE_OR_NAME",
                   help=f"experiment YAML file, or the name of a shipped config ({', '.join(example_configs())}; "
                        f"default: {DEFAULT_CONFIG.stem})")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="override config values, e.g. train.epochs=5 sampling.group_size=4")


def _add_parent_run_id(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--mlflow-parent-run-id", default=None, metavar="RUN_ID",
                   help=f"log {what} as a child of this MLflow run")


def _add_workdir(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--workdir", type=Path, default=Path(".flowgrpo"), help=help)


def _add_eval_gpus(p: argparse.ArgumentParser) -> None:
    p.add_argument("--eval-gpus", type=int, default=1, help="GPUs of the evaluation pod (0: CPU; default 1)")


# -- the commands, each beside its options ----------------------------------------------------------------------
def _train_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    trainer_entry.add_run_arguments(p)


@command("train", "train a LoRA in this process", _train_args, description=trainer_entry.DESCRIPTION)
def cmd_train(args: argparse.Namespace) -> int:
    return trainer_entry.run(load_config(args.config, args.overrides), args)


command("reward-server", "serve rewards over HTTP", reward_server_entry.add_arguments,
        description=reward_server_entry.DESCRIPTION)(reward_server_entry.serve)


@command("validate", "check a config and exit", _add_config_args)
def cmd_validate(args: argparse.Namespace) -> int:
    """Load and validate a config with its overrides; nothing else runs. A model.path missing on this machine is
    reported on a line of its own and does not fail: the machine that validates (CI) is often not the one that
    trains; an s3:// model.path is checked when the run starts."""
    from components.dataset.prompts import data_path_note
    from components.models.config import model_path_note
    from components.trainer.config import algorithm_notes, describe_batches, epoch_split_problems
    from pipeline.config import check_rewards

    config = load_config(args.config, args.overrides)
    check_rewards(config)
    data_note = data_path_note(config.data, config.model.resolution)
    workers = config.cluster.workers.training_workers
    problems = epoch_split_problems(config, workers)
    if problems:
        raise ConfigError(f"{args.config}: on the cluster's {workers} training workers (cluster.workers.replicas x "
                          "gpus_per_worker): " + "; ".join(problems))
    # A note, not a failure: CI validates before `submit` on a machine that does not hold the model.
    note = model_path_note(config.model)
    n = config.sampling.prompts_per_epoch * config.sampling.group_size
    print(f"{args.config}: valid ({config.model.kind}, {config.train.epochs} epochs, {n} images per epoch)")
    print(f"on the cluster: {describe_batches(config, workers)}")
    for line in (note, data_note, *algorithm_notes(config)):
        if line:
            print(line)
    return 0


def _evaluate_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument("--lora", required=True, metavar="DIR_OR_S3_URI", help="the LoRA folder (diffusers format)")
    p.add_argument("--output", required=True, type=Path, metavar="DIR", help="where eval.json and report.html go")
    p.add_argument("--metrics", default=None, metavar="PATH_OR_S3_URI",
                   help="the training run's metrics.jsonl (default: beside --lora when it is a run's lora/)")
    p.add_argument("--registered-model", default=None, metavar="NAME/VERSION",
                   help="model version the gate's verdict is recorded on (alias eval.gate.alias when promoted)")
    _add_parent_run_id(p, "the evaluation")


@command("evaluate", "compare a trained LoRA with its base model", _evaluate_args)
def cmd_evaluate(args: argparse.Namespace) -> int:
    """Sample the eval prompts (the prepared dataset's test split, else the training prompts) with ODE steps and
    fixed seeds, with and without the LoRA, score them with eval_rewards, and write eval.json (per reward: base
    mean, LoRA mean, delta, bootstrap CI, n) and report.html to --output. Applies the promotion gate."""
    config = load_config(args.config, args.overrides)
    name, _, version = (args.registered_model or "").rpartition("/")
    if args.registered_model and not (name and version):
        raise ConfigError(f"--registered-model must be NAME/VERSION, got {args.registered_model!r}")
    quiet_libraries()
    from pipeline import steps

    result = steps.evaluate(config, args.lora, Path(args.output),
                            history=steps.training_history(args.lora, args.metrics),
                            parent_run_id=args.mlflow_parent_run_id,
                            registered_model=(name, version) if args.registered_model else None, say=print)
    print(f"eval: {result.eval_path}  report: {result.report_path}")
    return 0


def _rayjob_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument("--output", default=None, metavar="S3_URI",
                   help=f"s3:// prefix the run writes to (default: {run_output(STORAGE_ROOT, '<run id>')})")
    p.add_argument("--run-id", default=None, metavar="ID",
                   help="names the RayJob (default: <config name>-<config hash>, so the same config gives the "
                        "same RayJob)")
    _add_parent_run_id(p, "the run")


@command("rayjob", "print the KubeRay RayJob of a cluster training run", _rayjob_args)
def cmd_rayjob(args: argparse.Namespace) -> int:
    """Print the KubeRay RayJob (ray.io/v1) that trains the config on the cluster described by its `cluster:`
    section, as YAML for `kubectl apply -f -`. Contacts no cluster. The config travels inside the RayJob;
    credentials come from the Secrets it names."""
    from components.launch.kubernetes.rayjob_manifest import build_rayjob, default_run_id, to_yaml

    config = load_config(args.config, args.overrides)
    run_id = args.run_id or default_run_id(config, args.config.stem)
    output = args.output or run_output(STORAGE_ROOT, run_id)
    manifest = build_rayjob(config, run_id=run_id, output=output, parent_run_id=args.mlflow_parent_run_id)
    sys.stdout.write(to_yaml(manifest))
    return 0


def _prepare_dataset_args(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", metavar="PATH_OR_S3_URI", help="a .jsonl, .csv or .parquet file")
    source.add_argument("--builtin", choices=sorted(BUILTIN_KINDS), help="a prompt set shipped with flowgrpo")
    p.add_argument("--output", required=True, metavar="DIR_OR_S3_URI", help="folder or s3:// prefix to write")
    p.add_argument("--kind", choices=["ocr", "generic"], default=None,
                   help="ocr: also reject rows with no quoted text and no ground_truth (default: ocr for "
                        "--builtin ocr, else generic)")
    # Defaults from the schema: the pipeline's prepare_dataset step (the `dataset:` section) splits the same way.
    p.add_argument("--test-fraction", type=float, default=PrepareConfig.default_of("test_fraction"),
                   help="share of rows in the test split (default %(default)s, as dataset.test_fraction)")
    p.add_argument("--seed", type=int, default=PrepareConfig.default_of("seed"),
                   help="seed of the train/test split (default %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=PrepareConfig.default_of("max_prompt_tokens"),
                   help="reject prompts estimated longer than this many T5 tokens (default %(default)s)")
    p.add_argument("--resolution", type=int, default=None, metavar="PX",
                   help="the model's resolution: also reject rows whose input images it cannot take (more than "
                        "2:1, or a side under a quarter of it); the pipeline passes model.resolution")
    p.add_argument("--allow-external-images", action="store_true",
                   help="also read input images named by absolute paths and s3:// URIs (by default a row's images "
                        "are paths inside the input file's folder, or data: URLs); data.allow_external_images")


@command("prepare-dataset", "validate, split and write a prompt dataset", _prepare_dataset_args)
def cmd_prepare_dataset(args: argparse.Namespace) -> int:
    """Read prompts from JSONL, CSV or Parquet (a path or s3:// URI; a `prompt` column, other columns become
    metadata) or a built-in set, reject bad rows (reported with line numbers), split train/test by seed and write
    train.parquet, test.parquet and manifest.json to --output. Train on it with data.path=OUTPUT."""
    from components.dataset.prepare import BUILTIN_PREFIX, prepare_dataset

    source = f"{BUILTIN_PREFIX}{args.builtin}" if args.builtin else args.input
    result = prepare_dataset(source, args.output, kind=args.kind, test_fraction=args.test_fraction, seed=args.seed,
                             max_prompt_tokens=args.max_prompt_tokens, resolution=args.resolution,
                             allow_external=args.allow_external_images, progress=status_line)
    rows = result.manifest["rows"]
    print(f"{source}: kept {rows['kept']} of {rows['input']} rows ({rows['train']} train, {rows['test']} test)")
    print(f"rejected {rows['rejected']}: {result.rejections.summary()}")
    print(f"train: {result.train_uri}\ntest: {result.test_uri}\nmanifest: {result.manifest_uri} "
          f"(content sha256 {result.manifest['content_sha256']})")
    return 0


def _run_args(p: argparse.ArgumentParser) -> None:
    _add_config_args(p)
    p.add_argument("--local", action="store_true", help="run here (the only mode; `submit` targets a cluster)")
    _add_workdir(p, "where the S3 data, MLflow database, pipeline outputs and logs live (default ./.flowgrpo)")
    p.add_argument("--ray-workers", type=int, default=1, metavar="N",
                   help="Ray Train workers for the training step (default 1; 0 trains in the step's process)")
    p.add_argument("--ui-port", type=int, default=DEFAULT_UI_PORT,
                   help="the port `flowgrpo ui` serves on: the run's MLflow listens there too when it is free, so "
                        "the links printed during the run keep working (default %(default)s)")


def _local_run_config(args: argparse.Namespace):
    config = load_config(args.config, args.overrides)
    if args.ray_workers:
        from components.trainer.loop import check_world_size

        check_world_size(config, args.ray_workers)
    return config


@command("run", "run the whole pipeline on this machine (--local)", _run_args)
def cmd_run(args: argparse.Namespace) -> int:
    """Run the whole pipeline (prepare dataset -> deploy reward server -> train -> evaluate -> register, then tear
    the reward server down) on this machine with kfp.local: starts SeaweedFS (S3), an MLflow server on sqlite, the
    reward server and a local Ray, prints each step with its duration, and stops them all at the end or on Ctrl-C.
    State lives under --workdir; a second run reuses the prepared dataset and `flowgrpo ui` serves what the runs
    logged."""
    if not args.local:
        raise ConfigError("`flowgrpo run` runs on this machine and needs --local; `flowgrpo submit` starts a run on "
                          "a Kubeflow Pipelines endpoint")
    if args.ray_workers < 0:
        raise ConfigError(f"--ray-workers must be 0 or more, got {args.ray_workers}")
    from pipeline.local_run import RUN_COMMAND, owning_workdir, run_local

    # A work directory that exists may be another run's: taken first, so a second run is refused before it reads the
    # config or imports the trainer. One that does not exist is nobody's: the config is checked before it is made,
    # so a refused run leaves nothing behind.
    config = None if args.workdir.exists() else _local_run_config(args)
    with owning_workdir(args.workdir, RUN_COMMAND) as workdir:
        config = config or _local_run_config(args)
        quiet_libraries()
        status_line(f"local run of {args.config} in {args.workdir}")
        result = run_local(config, workdir=workdir, ray_workers=args.ray_workers, ui_port=args.ui_port)
    took = sum(result.step_seconds.values())
    port = f" --port {args.ui_port}" if args.ui_port != DEFAULT_UI_PORT else ""
    ui = f"flowgrpo ui --workdir {args.workdir}{port}"
    print(f"pipeline run {result.run_name} finished ({took:.0f} s in steps); its results are in {result.results}")
    print(f"LoRA: {result.lora_path}")
    print(f"  load it: pipe.load_lora_weights(\"{result.lora_path}\")  (the same files: {result.lora_uri})")
    print(f"report: {result.report_path}")
    print(f"samples: {result.results / 'samples'}")
    print(f"registered model: {result.registered or 'not registered'}")
    print(f"MLflow charts: {result.mlflow_charts_url or 'tracking off'}")
    print("  every pipeline run's reward curves first, then its sample grids and the evaluation")
    print(f"MLflow run: {result.mlflow_run_url or 'tracking off'}")
    print("  the gate's verdict, the evaluation's deltas and a link to the registered model version")
    print(f"  open them with `{ui}` running")
    print(f"log: {result.log_path}")
    return 0


def _ui_args(p: argparse.ArgumentParser) -> None:
    _add_workdir(p, "the local runs' work directory")
    p.add_argument("--port", type=int, default=DEFAULT_UI_PORT, help="MLflow UI port (default %(default)s)")


@command("ui", "serve MLflow over the state of local runs", _ui_args)
def cmd_ui(args: argparse.Namespace) -> int:
    """Start SeaweedFS and the MLflow UI over --workdir (what `run --local` left), with the sample images and
    reports, until Ctrl-C, SIGTERM or SIGHUP, which stop both. Prints the newest experiment's link, in MLflow's
    model-training view. One `ui` or `run --local` uses a work directory at a time."""
    from pipeline.local_run import serve_ui

    serve_ui(args.workdir, port=args.port)
    return 0


def _replay_mlflow_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("output", metavar="DIR_OR_S3_URI", help="the run output (`train --output`)")
    p.add_argument("--experiment", default=None,
                   help="MLflow experiment (default: the run's tracking.experiment)")
    p.add_argument("--run-name", default=None, help="MLflow run name (default: the output's last path part)")
    p.add_argument("--no-register", action="store_true",
                   help="log the LoRA as artifacts instead of registering it in the Model Registry")
    p.add_argument("--force", action="store_true",
                   help="log another run even when the experiment already holds one for this output")


@command("replay-mlflow", "log a finished run output into MLflow (after an outage)", _replay_mlflow_args)
def cmd_replay_mlflow(args: argparse.Namespace) -> int:
    """Log what a training run left under its output (params from config.yaml, lineage tags from run.json,
    metrics.jsonl with step = epoch, the samples/ grids, the final lora/) as a new run in $MLFLOW_TRACKING_URI, as
    live tracking would have: for runs made while MLflow was down or tracking was off. The LoRA is registered as a
    new version of tracking.registered_model when the config names one, else logged as artifacts. All or nothing:
    a replay that fails deletes the run it made. An output already in the experiment is refused unless --force."""
    from components.registry.versions import register_lora_version
    from components.tracking.replay import replay_run
    from components.trainer.run_output import read_finished_run, run_name

    quiet_libraries()
    run = read_finished_run(args.output)
    done = replay_run(run, run_name=args.run_name or run_name(run.uri), experiment=args.experiment,
                      register=None if args.no_register else register_lora_version, force=args.force,
                      log=status_line)
    registered = f"; registered as version {done.registered_version}" if done.registered_version else ""
    print(f"MLflow run ({done.status}{registered}): {done.url}")
    return 0


def _compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", type=Path, default=Path(__file__).with_name("flowgrpo_pipeline.yaml"),
                   help="where to write (default: pipeline/flowgrpo_pipeline.yaml, the committed copy)")
    _add_eval_gpus(p)


@command("compile", "compile the Kubeflow pipeline to YAML", _compile_args)
def cmd_compile(args: argparse.Namespace) -> int:
    """Compile the KFP v2 pipeline (with its kubernetes settings: Secrets as env, timeouts, the GPU evaluation
    pod) for `kfp run create -f FILE`."""
    from pipeline.kfp_pipeline import compile_pipeline

    path = compile_pipeline(args.output, eval_gpus=args.eval_gpus)
    print(f"compiled the pipeline to {path} (run it: kfp run create -e EXPERIMENT -r RUN -f {path} "
          "config=shapes-cpu)")
    return 0


def _submit_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", required=True, help="KFP API endpoint, e.g. http://ml-pipeline-ui.kubeflow:80")
    p.add_argument("--experiment", default="flowgrpo", help="KFP experiment (created when missing)")
    p.add_argument("--run-name", default=None, help="run name (default flowgrpo-<timestamp>)")
    p.add_argument("--namespace", default=None, help="Kubeflow profile namespace (multi-user installs)")
    p.add_argument("--config", type=Path, default=None, metavar="FILE_OR_NAME",
                   help="experiment YAML file (sent as its text) or the name of a shipped config (sent as the "
                        "name) for the pipeline's `config` parameter (else config=NAME_OR_TEXT, else "
                        f"{DEFAULT_CONFIG.stem})")
    _add_eval_gpus(p)
    p.add_argument("--service-account", default=PIPELINE_SERVICE_ACCOUNT,
                   help=f"Kubernetes service account the step pods run as (default {PIPELINE_SERVICE_ACCOUNT}, "
                        "from manifests/base: the Role the steps need and nothing more)")
    p.add_argument("arguments", nargs="*", metavar="key=value",
                   help="pipeline parameters: config, overrides (a YAML/JSON list), storage_root, ray_workers")


def _parse_arguments(items: list[str]) -> dict:
    from components.config_base import load_yaml

    arguments = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"pipeline argument {item!r} must look like key=value")
        arguments[key] = load_yaml(value, f"pipeline argument {key}") if key in ("overrides", "ray_workers") else value
    return arguments


@command("submit", "start a pipeline run on a Kubeflow Pipelines endpoint", _submit_args)
def cmd_submit(args: argparse.Namespace) -> int:
    """Compile the pipeline, upload it (once per content), create the experiment if needed and start a run. The
    config is validated first. A bearer token, when needed, comes from $KFP_TOKEN."""
    from pipeline.config import config_from_parameter, config_parameter
    from pipeline.kfp_submit import submit

    arguments = _parse_arguments(args.arguments)
    overrides = arguments.get("overrides") or []
    if args.config is not None:
        load_config(args.config, overrides)  # its messages name the file (or say it does not exist)
        arguments["config"] = config_parameter(args.config)
    config_from_parameter(arguments.get("config", ""), overrides)  # what the pipeline reads; refuse before submitting
    run_name = args.run_name or f"flowgrpo-{time.strftime('%Y%m%d-%H%M%S')}"
    done = submit(args.host, experiment=args.experiment, run_name=run_name, arguments=arguments,
                  namespace=args.namespace, eval_gpus=args.eval_gpus, service_account=args.service_account)
    print(f"submitted run {done.run_id} ({run_name}) in experiment {args.experiment}: {done.run_url}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowgrpo",
        description="FlowGRPO: online RL fine-tuning of flow-matching text-to-image models with image rewards.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for c in COMMANDS:
        p = sub.add_parser(c.name, help=c.help, description=c.description)
        c.add_arguments(p)
        p.set_defaults(func=c.run)
    return parser


# A command's positional key=value list. argparse fills it from the first run of positionals only, so one placed
# after an option (`train --config X a=1 --ray-workers 2 b=2`) comes back unrecognised: appended here, in order.
KEY_VALUE_LISTS = ("overrides", "arguments")


def parse_arguments(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """``argv`` parsed, with ``key=value`` items allowed anywhere among a command's options."""
    args, extra = parser.parse_known_args(argv)
    dest = next((name for name in KEY_VALUE_LISTS if hasattr(args, name)), None)
    stray = [item for item in extra if dest is None or item.startswith("-") or "=" not in item]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if extra:
        setattr(args, dest, [*getattr(args, dest), *extra])
    return args


def main(argv: list[str] | None = None) -> int:
    environ.apply_settings()
    args = parse_arguments(build_parser(), argv)

    def command() -> int:
        environ.check_settings()  # before the command reads or writes anything
        return args.func(args)

    return exit_status(f"flowgrpo {args.command}", command)


if __name__ == "__main__":
    sys.exit(main())
