"""Where the product is deployed from, in one place: the registry and version every image is tagged with, the
Secrets the pods read, and the object-storage root of pipeline runs. They are the defaults of the config keys and
pipeline parameters that name them (``cluster.image``, ``reward_deploy.image``, ``reward_deploy.judge.image`` and
``.fetch_image``, ``cluster.s3_secret`` / ``.mlflow_secret``, ``reward_deploy.s3_secret``, the pipeline's
``storage_root``); the shipped configs and manifests spell the same values (tests compare them)."""

import tomllib
from importlib import metadata
from pathlib import Path

REGISTRY = "ghcr.io/flowgrpo"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def package_version() -> str:
    """The installed package's version; from a source checkout that is not installed (a GPU node importing the
    repo by PYTHONPATH), pyproject.toml's, which is what an install would record."""
    try:
        return metadata.version("flowgrpo-mlops")
    except metadata.PackageNotFoundError:
        return tomllib.loads(PYPROJECT.read_text())["project"]["version"]


# The images are tagged with the package's version (images/build.sh reads it from pyproject.toml).
VERSION = package_version()
IMAGES = ("trainer", "reward-server", "components", "vllm-judge", "mlflow")
S3_SECRET = "flowgrpo-s3"
MLFLOW_SECRET = "flowgrpo-mlflow"
STORAGE_ROOT = "s3://flowgrpo"


def image(name: str) -> str:
    """The reference of our image ``name`` (one of IMAGES) at this version."""
    if name not in IMAGES:
        raise ValueError(f"no image {name!r}; one of {', '.join(IMAGES)}")
    return f"{REGISTRY}/flowgrpo-{name}:{VERSION}"

