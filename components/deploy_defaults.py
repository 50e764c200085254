"""Where the product is deployed from, in one place: the registry and version every image is tagged with, the
Secrets the pods read, and the object-storage root of pipeline runs. They are the defaults of the config keys and
pipeline parameters that name them (``cluster.image``, ``reward_deploy.image``, ``reward_deploy.judge.image`` and
``.fetch_image``, ``cluster.s3_secret`` / ``.mlflow_secret``, ``reward_deploy.s3_secret``, the pipeline's
``storage_root``); the shipped configs and manifests spell the same values (tests compare them)."""

from importlib import metadata

REGISTRY = "ghcr.io/flowgrpo"
# The images are tagged with the package's version (images/build.sh reads it from pyproject.toml).
VERSION = metadata.version("flowgrpo-mlops")
IMAGES = ("trainer", "reward-server", "components", "vllm-judge", "mlflow")
S3_SECRET = "flowgrpo-s3"
MLFLOW_SECRET = "flowgrpo-mlflow"
STORAGE_ROOT = "s3://flowgrpo"


def image(name: str) -> str:
    """The reference of our image ``name`` (one of IMAGES) at this version."""
    if name not in IMAGES:
        raise ValueError(f"no image {name!r}; one of {', '.join(IMAGES)}")
    return f"{REGISTRY}/flowgrpo-{name}:{VERSION}"

