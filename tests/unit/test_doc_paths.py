"""Every repository path the docs cite exists (README.md, docs/*.md, manifests/README.md), every link between them
resolves to a file and a heading, the index lists every page, and the README stays short.

Where the docs cite paths: code spans, code blocks, link targets (relative to the doc, as GitHub resolves them) and
headings (``## Math (components/...)``). A
word there is a cited path when it looks like one: its first folder is the name of a folder of the repository, or
it ends in a source or doc file's extension. It must then name a tracked file or folder, by these rules:

- it is a tracked path, or the end of one: the docs drop the folders their context says (``trainer/loop.py``
  in a section on ``components/``, ``base/mlflow.yaml`` in ``manifests/README.md``, a bare ``loop.py``), but every
  folder they do name must be right;
- ``{a,b}`` stands for both names; ``*``, a ``<placeholder>`` or ``...`` (a value of a run or of the reader) is a
  glob that must match;
- a ``:name`` after a file (``config.py:check_guidance``, ``config_base.py: ConfigLoader``) names a function in it;
  after anything else it is an image's tag (``vllm/vllm-openai:v0.32.0``), not a path.

Left out, each by its own rule: what a run writes or a user gives (RUN_OUTPUTS, OUTPUT_FILES), absolute paths and
URLs (a machine's, a container's, a server's), installs (``.venv/``), and files of upstream projects, cited with the
commit they were read at (UPSTREAM).
"""

from __future__ import annotations

import fnmatch
import itertools
import posixpath
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")), "manifests/README.md"]
EXTENSIONS = (".py", ".yaml", ".yml", ".md", ".json", ".sh", ".txt", ".png", ".toml", ".safetensors", ".html")
# The folders of a run's output, of a work directory and of a bucket (`runs/<run id>/lora`, `WORKDIR/logs/`): written
# by a run, so never in the repository.
RUN_OUTPUTS = {"runs", "checkpoints", "samples", "lora", "logs", "eval", "s3", "mlflow", "datasets", "reward-servers",
               "pipeline-root", "STORAGE_ROOT", "WORKDIR", "OUTPUT", "RUN", "my-overlay"}
# Files a run writes or a user gives, named by what they are (a run's `config.yaml`, a model's `model_index.json`).
OUTPUT_FILES = {"config.yaml", "config.json", "eval.json", "run.json", "manifest.json", "_MANIFEST.json",
                "model_index.json", "report.html", "rewards.yaml", "my.yaml", "shapes-sd3.json", "lora.png", "base.png",
                "pytorch_lora_weights.safetensors", "images/*.png", "open_gpu_figures.json"}
# Upstream flow_grpo (GRPO-Guard included), DiffusionNFT, Flow-Factory and verl-omni files, cited with the commit
# they were read at (docs/ALGORITHM.md).
UPSTREAM = {"scripts/train_sd3.py", "scripts/train_sd3_fast.py", "scripts/train_flux.py",
            "scripts/train_qwenimage_edit_plus.py", "train_sd3.py", "train_sd3_fast.py", "train_flux.py",
            "config/grpo.py", "flow_grpo/ema.py", "flow_grpo/stat_tracking.py", "src/flow_factory/trainers/grpo.py",
            "scripts/train_nft_sd3.py", "train_nft_sd3.py", "config/nft.py", "src/flow_factory/trainers/nft.py",
            "scripts/train_sd3_GRPO_Guard.py", "examples/grpo/lora/flux2_klein/default.yaml",
            "src/flow_factory/models/flux/flux2_klein.py", "examples/grpo/lora/z_image/default.yaml",
            "src/flow_factory/models/z_image/z_image.py", "examples/grpo/lora/wan21/t2v.yaml",
            "src/flow_factory/models/wan/wan2_t2v.py", "verl_omni/trainer/diffusion/diffusion_algos.py",
            "scripts/finetune/finetune_flux_grpo.sh", "src/flow_factory/scheduler/flow_match_euler_discrete.py"}
UPSTREAM |= {"scripts/train_flux_kontext.py", "flux_kontext_pipeline_with_logprob.py",  # FLUX.1-Kontext (and
             "src/flow_factory/models/flux/flux1_kontext.py", "examples/grpo/lora/flux1_kontext/default.yaml",
             "pipeline_flux_kontext.py"}  # diffusers' pipeline file)
UPSTREAM |= {"fastvideo/train_grpo_flux.py", "train_grpo_flux.py", "fastvideo/utils/grpo_states.py",  # MixGRPO
             "fastvideo/utils/sampling_utils.py", "scripts/finetune/finetune_flux_grpo_MixGRPO.sh",
             "scripts/finetune/finetune_flux_grpo_MixGRPO_Flash.sh"}
UPSTREAM |= {"advantage_weighted_matching/scripts/train_sd3_awm.py", "config/dgx_awm.py",  # AWM
             "config/base_awm.py", "src/flow_factory/trainers/awm.py"}
UPSTREAM |= {"scripts/train_sd3_dpo.py", "config/dpo.py", "src/flow_factory/trainers/rl/dpo.py",  # online DPO
             "src/flow_factory/hparams/training_args/dpo.py",
             "examples/dpo_trainer/qwen_image/run_qwen_image_online_dpo_lora.sh"}
UPSTREAM |= {"examples/grpo/lora/wan21/i2v.yaml", "src/flow_factory/models/wan/wan2_i2v.py"}  # Wan2.1 I2V
UPSTREAM |= {"examples/grpo/lora/flux2_klein_base/default.yaml"}  # FLUX.2 klein with references
UPSTREAM |= {"examples/grpo/lora/qwen_image_edit_plus/default.yaml",  # Qwen-Image-Edit-2509
             "scripts/train_qwenimage_edit.py"}
_CODE = re.compile(r"^```[^\n]*\n(.*?)^```|`([^`\n]+)`|\]\(([^)\s]+)\)|^(?: {4}|#+ )([^\n]*)", re.M | re.S)
_FENCED = re.compile(r"^```.*?^```", re.M | re.S)
README_MAX_LINES = 250  # a first visit reads it in five minutes; the rest is in docs/
_PLACEHOLDER = re.compile(r"<[\w .:-]*>|\.\.\.")


def _tracked() -> list[str]:
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    folders = {f"{folder}/" for f in files for folder in map(str, Path(f).parents) if folder != "."}
    return sorted(set(files) | folders)


TRACKED = _tracked()
FOLDER_NAMES = {Path(p).name for p in TRACKED if p.endswith("/")}


def _expanded(path: str) -> list[str]:
    """``a/{b,c}.py`` as ``a/b.py`` and ``a/c.py``."""
    parts = re.split(r"\{([^{}]*)\}", path)
    return ["".join(c) for c in itertools.product(*[[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)])]


def _exists(path: str) -> bool:
    """``path`` is a tracked file or folder, or the end of one (a glob where it has ``*``)."""
    return any(fnmatch.fnmatch(p, path) or fnmatch.fnmatch(p, f"*/{path}") for p in TRACKED) or (
        not path.endswith("/") and _exists(f"{path}/"))


def _links(doc: str) -> list[tuple[str, str]]:
    """``doc``'s links outside code as (repository path, anchor), resolved from the doc's folder; URLs left out."""
    found = []
    for match in _CODE.finditer((REPO / doc).read_text(encoding="utf-8")):
        target = match.group(3)
        if target is None or re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        found.append((posixpath.normpath(posixpath.join(posixpath.dirname(doc), path)) if path else doc, anchor))
    return found


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: str) -> set[str]:
    text = _FENCED.sub("", (REPO / doc).read_text(encoding="utf-8"))
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def _cited(doc: str) -> set[str]:
    """The words of ``doc``'s code, links and headings that look like repository paths."""
    text = (REPO / doc).read_text(encoding="utf-8")
    code = "\n".join(g for m in _CODE.finditer(text) for i, g in enumerate(m.groups()) if g and i != 2)
    found = {path for path, _ in _links(doc) if path != doc}
    for word in re.split(r"[\s`'\"()\[\]|=]+", _PLACEHOLDER.sub("*", code)):
        word, _, name = word.rstrip(",;.:").partition(":")
        if name and not word.endswith(EXTENSIONS):  # an image and its tag (`vllm/vllm-openai:v0.32.0`), not a file
            continue
        if not word or "@" in word or word.startswith(("/", "$", "~", "-", ".venv", "*")):
            continue
        first = word.split("/", 1)[0]
        if first in RUN_OUTPUTS or word in OUTPUT_FILES or word in UPSTREAM or re.fullmatch(r"\.\w+", word):
            continue
        if ("/" in word and first in FOLDER_NAMES) or word.endswith(EXTENSIONS):
            found.add(word)
    return found


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_doc_cites_exists(doc):
    missing = sorted(p for p in _cited(doc) if not all(_exists(e) for e in _expanded(p)))
    assert missing == [], f"{doc} cites paths the repository does not have: {missing}"


def test_the_rules_find_paths_and_missing_ones():
    """The extraction sees the paths the docs cite (so an empty list above means something), and a wrong folder
    or name is missing."""
    assert {"pipeline/steps.py", "components/trainer/loop.py", "flow_rl/config.py"} <= _cited("docs/DESIGN.md")
    assert {"pipeline/configs/shapes-cpu.yaml", "docs/screenshots/mlflow-chart-view.png"} <= _cited("README.md")
    assert {"docs/INSTALL.md", "manifests/README.md"} <= _cited("docs/README.md")  # `INSTALL.md`, `../manifests/..`
    assert _slug("The demo: shapes-sd3 (`model.kind: shapes-sd3`)") == "the-demo-shapes-sd3-modelkind-shapes-sd3"
    assert _slug("A run's reward server") == "a-runs-reward-server"
    assert _exists("trainer/loop.py") and _exists("base/mlflow.yaml") and _exists("pipeline/configs/tiny-*-cpu.yaml")
    assert not _exists("components/trainer/prompt_cache.py") and not _exists("trainer/prompt_cache.py")
    assert not _exists("pipeline/configs/tiny-default.yaml") and not _exists("rainer/loop.py")
    assert _expanded("launch/{api,rayjobs}.py") == ["launch/api.py", "launch/rayjobs.py"]


@pytest.mark.parametrize("doc", DOCS)
def test_every_link_anchor_names_a_heading(doc):
    """``[text](PAGE.md#anchor)`` lands on a heading of that page (a missing page fails the test above)."""
    broken = [f"{path}#{anchor}" for path, anchor in _links(doc)
              if anchor and path.endswith(".md") and (REPO / path).exists() and anchor not in _anchors(path)]
    assert broken == [], f"{doc} links to anchors no heading makes: {broken}"


def test_the_index_lists_every_docs_page_and_the_readme_links_the_index():
    pages = {f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")} - {"docs/README.md"}
    listed = {path for path, _ in _links("docs/README.md")}
    assert pages - listed == set(), f"docs/README.md does not list {sorted(pages - listed)}"
    assert "docs/README.md" in {path for path, _ in _links("README.md")}


def test_the_readme_is_short():
    lines = (REPO / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to docs/"
