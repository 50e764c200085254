"""The Kubeflow pipeline: prepare_dataset -> deploy_reward_server -> train -> evaluate -> register, inside an
ExitHandler whose exit task tears the reward server down and closes the MLflow parent run.

Every component is a thin wrapper over a function in ``pipeline/steps.py`` (imported inside the function:
KFP ships only the function's source to the pod, whose image has the package installed). The exit task cannot
consume other tasks' outputs, so the reward server is named from the run id (``PIPELINE_JOB_ID``), which
every task receives. Compiled: ``flowgrpo compile`` -> ``pipeline/flowgrpo_pipeline.yaml``.
"""

# No `from __future__ import annotations`: KFP reads the components' annotations as types.
from pathlib import Path
from typing import NamedTuple

from kfp import compiler, dsl, kubernetes
from kfp.dsl import HTML, Dataset, Input, Metrics, Model, Output

from components.deploy_defaults import MLFLOW_SECRET, S3_SECRET, STORAGE_ROOT, image

PIPELINE_NAME = "flowgrpo"
COMPILED = Path(__file__).with_name("flowgrpo_pipeline.yaml")
# Light steps run in the image without torch; evaluation samples images, so it runs in the trainer's.
COMPONENTS_IMAGE = image("components")
TRAINER_IMAGE = image("trainer")
# The Secrets of manifests/secrets (values never enter the pipeline or its parameters): S3_SECRET, MLFLOW_SECRET.
S3_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3", "AWS_REGION")
MLFLOW_OPTIONAL_KEYS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
GPU_RESOURCE = "nvidia.com/gpu"
GPU_NODE_LABEL = "nvidia.com/gpu.present"  # set on GPU nodes by NVIDIA's GPU operator / feature discovery
HOUR = 3600


def _component(image: str):
    # install_kfp_package=False: the images carry kfp; a pod must not pip-install at start (no egress).
    return dsl.component(base_image=image, install_kfp_package=False)


@_component(COMPONENTS_IMAGE)
def prepare_dataset(config: str, overrides: list, storage_root: str, dataset: Output[Dataset]):
    """Validate and split the prompts into object storage (content-addressed: same inputs, same dataset)."""
    from pipeline import steps

    ref = steps.prepare(steps.step_config(config, overrides), storage_root)
    dataset.uri = ref.uri
    dataset.metadata.update({"rows_train": ref.manifest["rows"]["train"], "rows_test": ref.manifest["rows"]["test"],
                             "rows_rejected": ref.manifest["rows"]["rejected"],
                             "content_sha256": ref.manifest["content_sha256"], "reused": ref.reused})


@_component(COMPONENTS_IMAGE)
def deploy_reward_server(config: str, overrides: list, run_id: str, launcher: str) -> str:
    """Start the run's reward server and wait until it is ready; returns its URL."""
    from components.launch.interface import launcher_for
    from pipeline import steps

    return steps.deploy_reward_server(steps.step_config(config, overrides), run_id, launcher_for(launcher))


@_component(COMPONENTS_IMAGE)
def train(config: str, overrides: list, storage_root: str, run_id: str, run_name: str, ray_workers: int,
          launcher: str, dataset: Input[Dataset], reward_url: str, model: Output[Model], metrics: Output[Metrics]):
    """FlowGRPO training as a KubeRay RayJob (locally: on a local Ray), followed to its end."""
    from components.launch.interface import launcher_for
    from components.tracking.pipeline_runs import parent_run
    from pipeline import steps

    experiment = steps.step_config(config, overrides)
    parent = parent_run(experiment.tracking.experiment, run_id, run_name)
    result = steps.train(steps.training_config(experiment, dataset.uri, reward_url),
                         steps.run_output(storage_root, run_id), run_id=run_id, parent_run_id=parent,
                         ray_workers=ray_workers, launcher=launcher_for(launcher))
    model.uri = result.lora_uri
    model.metadata.update({"output": result.output, "mlflow_run_id": result.mlflow_run_id or "",
                           "base_model": experiment.model.path or experiment.model.kind})
    for key, value in result.last_metrics.items():
        if isinstance(value, int | float) and value == value:  # NaN is not a KFP metric
            metrics.log_metric(key.replace("/", "."), float(value))


@_component(TRAINER_IMAGE)
def evaluate(config: str, overrides: list, run_id: str, run_name: str, dataset: Input[Dataset],
             model: Input[Model], report: Output[HTML], metrics: Output[Metrics]
             ) -> NamedTuple("Verdict", [("promoted", bool), ("reason", str)]):
    """Base vs LoRA on the held-out prompts with the eval rewards; the report and the gate's verdict."""
    import shutil
    import tempfile
    from pathlib import Path

    from components import storage
    from components.tracking.pipeline_runs import parent_run
    from pipeline import steps

    experiment = steps.step_config(config, overrides)
    parent = parent_run(experiment.tracking.experiment, run_id, run_name)
    out = Path(tempfile.mkdtemp(prefix="flowgrpo-eval-"))
    result = steps.evaluate(steps.evaluation_config(experiment, dataset.uri), model.uri, out,
                            history=steps.training_history(model.uri), parent_run_id=parent)
    destination = storage.join(model.metadata["output"], "eval")
    for path in (result.eval_path, result.report_path):
        storage.put_file(path, storage.join(destination, path.name))
    shutil.copyfile(result.report_path, report.path)
    for key, row in result.summary["rewards"].items():
        for field in ("base_mean", "lora_mean", "delta", "ci_low", "ci_high"):
            if row[field] == row[field]:
                metrics.log_metric(f"{key}.{field}", float(row[field]))
    gate = result.summary["gate"]
    verdict = NamedTuple("Verdict", [("promoted", bool), ("reason", str)])  # noqa: UP014 -- KFP's idiom
    return verdict(bool(gate["promoted"]), gate["reason"])


@_component(COMPONENTS_IMAGE)
def register(config: str, overrides: list, model: Input[Model], promoted: bool, reason: str) -> str:
    """Register the LoRA in the MLflow Model Registry and apply the gate (alias when promoted)."""
    from pipeline import steps

    return steps.register(steps.step_config(config, overrides), model.uri,
                          model.metadata.get("mlflow_run_id") or None, promoted=promoted, reason=reason) or ""


@_component(COMPONENTS_IMAGE)
def teardown(config: str, overrides: list, run_id: str, launcher: str, status: dsl.PipelineTaskFinalStatus):
    """Exit task: delete the reward server whatever happened, close the MLflow parent run."""
    from components.launch.interface import launcher_for
    from components.tracking.pipeline_runs import finish_parent_run
    from pipeline import steps

    experiment = steps.step_config(config, overrides)
    try:
        steps.teardown_reward_server(experiment, run_id, launcher_for(launcher))
    finally:
        finish_parent_run(experiment.tracking.experiment, run_id, succeeded=status.state == "SUCCEEDED")


def _with_secrets(task: dsl.PipelineTask) -> dsl.PipelineTask:
    kubernetes.use_secret_as_env(task, S3_SECRET, {k: k for k in S3_KEYS})
    kubernetes.use_secret_as_env(task, MLFLOW_SECRET, {"MLFLOW_TRACKING_URI": "MLFLOW_TRACKING_URI"})
    kubernetes.use_secret_as_env(task, MLFLOW_SECRET, {k: k for k in MLFLOW_OPTIONAL_KEYS}, optional=True)
    return task


def _step(task: dsl.PipelineTask, name: str, *, timeout_s: int, retries: int = 0, cache: bool = False):
    task.set_display_name(name).set_caching_options(enable_caching=cache)
    if retries:
        task.set_retry(num_retries=retries, backoff_duration="30s", backoff_factor=2.0)
    kubernetes.set_timeout(task, timeout_s)
    kubernetes.add_pod_label(task, "app.kubernetes.io/part-of", "flowgrpo")
    return _with_secrets(task)


def build_pipeline(eval_gpus: int = 1, retries: bool = True):
    """The pipeline function; ``eval_gpus`` GPUs (0: CPU) for the evaluation pod, on the GPU node pool.
    ``retries`` False (local runs) shows a failure at once instead of retrying a step after a back-off."""

    @dsl.pipeline(name=PIPELINE_NAME, description="FlowGRPO: online RL fine-tuning of a flow-matching "
                  "text-to-image model with LoRA, evaluated against the base model and registered in MLflow")
    def flowgrpo(
        config: str = "shapes-cpu",
        overrides: list = [],  # noqa: B006 -- KFP reads the default from the signature
        storage_root: str = STORAGE_ROOT,
        ray_workers: int = 1,
        launcher: str = "kubernetes",
    ):
        """One FlowGRPO experiment.

        Args:
            config: a config shipped in the images (shapes-cpu, tiny-cpu, sd35-medium-ocr, ...) or a whole
                experiment config as YAML/JSON text.
            overrides: key.sub=value overrides applied on top, e.g. ["train.epochs=100", "model.lora.rank=16"].
            storage_root: s3:// prefix for datasets (datasets/<content hash>) and runs (runs/<run id>).
            ray_workers: local runs only: Ray Train workers (0 = in the step's process); in a cluster the RayJob
                has cluster.workers.replicas workers.
            launcher: where the reward server and the training start: "kubernetes" (a Deployment and a RayJob in
                cluster.namespace); `flowgrpo run --local` passes "local:STATE_DIR" (processes on its machine).
        """
        def step(task: dsl.PipelineTask, name: str, *, timeout_s: int, tries: int = 0, cache: bool = False):
            return _step(task, name, timeout_s=timeout_s, retries=tries if retries else 0, cache=cache)

        run_id = dsl.PIPELINE_JOB_ID_PLACEHOLDER
        run_name = dsl.PIPELINE_JOB_NAME_PLACEHOLDER
        exit_task = step(teardown(config=config, overrides=overrides, run_id=run_id, launcher=launcher),
                         "teardown reward server", timeout_s=HOUR, tries=2)
        with dsl.ExitHandler(exit_task, name="flowgrpo run"):
            data = step(prepare_dataset(config=config, overrides=overrides, storage_root=storage_root),
                        "prepare dataset", timeout_s=HOUR, tries=2, cache=True)
            server = step(deploy_reward_server(config=config, overrides=overrides, run_id=run_id, launcher=launcher),
                          "deploy reward server", timeout_s=HOUR, tries=1)
            server.after(data)  # no server (GPU replicas, a judge) is started for a dataset that fails validation
            trained = step(train(config=config, overrides=overrides, storage_root=storage_root, run_id=run_id,
                                 run_name=run_name, ray_workers=ray_workers, launcher=launcher,
                                 dataset=data.outputs["dataset"], reward_url=server.output),
                           "train (RayJob)", timeout_s=7 * 24 * HOUR, tries=1)  # a retry resumes
            evaluated = step(evaluate(config=config, overrides=overrides, run_id=run_id, run_name=run_name,
                                      dataset=data.outputs["dataset"], model=trained.outputs["model"]),
                             "evaluate", timeout_s=12 * HOUR, tries=1)
            kubernetes.add_pod_label(evaluated, "app.kubernetes.io/component", "evaluate")
            if eval_gpus:
                evaluated.set_accelerator_type(GPU_RESOURCE).set_accelerator_limit(eval_gpus)
                kubernetes.add_toleration(evaluated, key=GPU_RESOURCE, operator="Exists", effect="NoSchedule")
                kubernetes.add_node_selector(evaluated, GPU_NODE_LABEL, "true")
            step(register(config=config, overrides=overrides, model=trained.outputs["model"],
                          promoted=evaluated.outputs["promoted"], reason=evaluated.outputs["reason"]),
                 "register", timeout_s=HOUR, tries=2)

    return flowgrpo


def compile_pipeline(path: Path = COMPILED, eval_gpus: int = 1) -> Path:
    compiler.Compiler().compile(build_pipeline(eval_gpus), str(path))
    return path
