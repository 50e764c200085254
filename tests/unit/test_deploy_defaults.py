"""The package version the images are tagged with, installed or not."""

import tomllib
from importlib import metadata

from components import deploy_defaults


def test_a_source_checkout_that_is_not_installed_reads_the_version_from_pyproject(monkeypatch):
    """A GPU node imports the repo by PYTHONPATH without installing it: importing the config must not fail."""
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)
    expected = tomllib.loads(deploy_defaults.PYPROJECT.read_text())["project"]["version"]
    assert deploy_defaults.package_version() == expected == metadata.distribution("flowgrpo-mlops").version
