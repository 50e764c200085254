"""The model family registry (components/models/families.py): each registration agrees with its adapter and its
recipe, the docs count and list what it registers, and a family is one folder plus its recipe, found without being
listed."""

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

from components.models.families import families, load, pipelines, tiny_twins, twins
from pipeline.config import CONFIG_DIR, load_config

REPO = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")), "manifests/README.md"]
NUMBERS = {word: n for n, word in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen".split())}
# "six families", "the six model families (SD3.x, FLUX.1, ...)": a count of families and the list after it
COUNTED = re.compile(r"\b(" + "|".join(NUMBERS) + r")\s+(?:model\s+|flow-matching\s+)?families\b"
                     r"(?:\s*\(([^()\[\]`]+,[^()\[\]`]+)\))?", re.IGNORECASE)
# a row of docs/MODELS.md's family table: | model | `Pipeline` ... | `folder/module.py: Adapter` | `tiny-kind` | ...
TABLE_ROW = re.compile(r"^\| [^|]+ \| `(\w+Pipeline)`[^|]* \| `([\w/]+)\.py: (\w+)` \| (?:`([\w-]+)`|-)[^|]* \|", re.M)


def test_each_pipeline_registers_what_its_adapter_does():
    for registered in pipelines().values():
        adapter = load(registered.adapter)
        assert (adapter.video, adapter.input_images) == (registered.video, registered.input_images), registered


def test_each_twin_is_built_by_its_builder_and_trained_by_its_recipe():
    for kind, twin in twins().items():
        assert callable(load(twin.builder)), kind
        assert load_config(CONFIG_DIR / f"{twin.recipe}.yaml").model.kind == kind


def test_the_docs_count_and_list_the_registered_families():
    names = {family.name for family in families()}
    counted = 0
    for doc in DOCS:
        for match in COUNTED.finditer((REPO / doc).read_text(encoding="utf-8")):
            where = f"{doc}: {' '.join(match[0].split())!r}"
            assert NUMBERS[match[1].lower()] == len(names), f"{where}; the registry has {len(names)} families"
            if match[2]:
                assert set(re.split(r",\s*|\s+and\s+", " ".join(match[2].split()))) == names, where
            counted += 1
    assert counted >= 5  # README.md, MODELS.md, DESIGN.md (twice), docs/README.md, CLUSTER.md, ...


def test_the_models_table_has_a_row_per_pipeline_and_config_md_lists_each_twins_recipe():
    rows = TABLE_ROW.findall((REPO / "docs/MODELS.md").read_text(encoding="utf-8"))
    registered = pipelines()
    assert {row[0] for row in rows} == set(registered)
    for pipeline, module, adapter, kind in rows:
        assert registered[pipeline].adapter == f"components.models.{module.replace('/', '.')}:{adapter}"
        assert not kind or tiny_twins()[kind].pipeline == pipeline
    assert {row[3] for row in rows} - {""} == set(tiny_twins())
    config_md = (REPO / "docs/CONFIG.md").read_text(encoding="utf-8")
    assert [t.recipe for t in twins().values() if f"{t.recipe}.yaml" not in config_md] == []


# A family written exactly as docs/MODELS.md, "Adding a family", says: one folder (its registration, adapter and
# tiny twin) and its recipe; nothing else names it. SD3's adapter and twin under a pipeline class of its own.
PROBE = {
    "__init__.py": '''
        """The probe family: SD3 under a pipeline class of its own."""

        from components.models.families import Family, Pipeline, Twin

        FAMILY = Family("Probe", (
            Pipeline("Probe", "ProbePipeline", f"{__name__}.adapter:ProbeModel",
                     (Twin("tiny-probe", f"{__name__}.tiny:build_tiny_probe", "none", "tiny-probe-cpu"),)),
        ))
        ''',
    "adapter.py": '''
        from components.models.sd3.adapter import SD3Model


        class ProbeModel(SD3Model):
            """SD3's forward, for the probe's pipeline."""
        ''',
    "tiny.py": '''
        from diffusers import StableDiffusion3Pipeline

        from components.models.sd3.tiny import build_tiny_sd3


        class ProbePipeline(StableDiffusion3Pipeline):
            """SD3's pipeline under a class name of its own."""


        def build_tiny_probe(resolution: int, seed: int) -> ProbePipeline:
            return ProbePipeline(**build_tiny_sd3(resolution, seed).components)
        ''',
}

PROBE_RUN = """
import json, sys
from components.errors import ConfigError
from components.models.config import ModelConfig
from pipeline.config import CONFIG_DIR, load_config

recipe = CONFIG_DIR / "tiny-probe-cpu.yaml"
out = {"described": "`tiny-probe` (Probe)" in ModelConfig.model_fields["kind"].description}
try:
    load_config(recipe, ["sampling.guidance_scale=4.5"])
except ConfigError as exc:
    out["guidance"] = str(exc)
try:
    ModelConfig(kind="tiny-probe", num_frames=5)
except ValueError as exc:
    out["frames"] = str(exc)
config = load_config(recipe, ["train.epochs=1", "tracking.sample_every=0"])
out["torch"] = "torch" in sys.modules  # validating a config imports no torch

from components.models.loading import load_model
from components.trainer.training_run import train

model = load_model(config.model, 0)
out["loaded"] = [type(model).__name__, type(model.pipeline).__name__]
result = train(config, sys.argv[1], log=lambda _m: None)
out["trained"] = (result.lora_dir / "pytorch_lora_weights.safetensors").is_file()
print(json.dumps(out))
"""


def test_a_probe_family_added_as_one_folder_and_its_recipe_is_validated_loaded_and_trained(tmp_path):
    root = tmp_path / "repo"
    for package in ("components", "pipeline"):
        shutil.copytree(REPO / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    folder = root / "components" / "models" / "probe"
    folder.mkdir()
    for name, source in PROBE.items():
        (folder / name).write_text(textwrap.dedent(source).lstrip())
    configs = root / "pipeline" / "configs"
    (configs / "tiny-probe-cpu.yaml").write_text((configs / "tiny-cpu.yaml").read_text().replace("kind: tiny-sd3",
                                                                                                "kind: tiny-probe"))

    done = subprocess.run([sys.executable, "-c", PROBE_RUN, str(tmp_path / "run")], cwd=root, capture_output=True,
                          text=True, env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                                          "PYTHONPATH": str(root)}, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["described"] and out["torch"] is False
    assert "sampling.guidance_scale must be 1 for tiny-probe" in out["guidance"]  # its registered guidance
    assert "model.num_frames is 5, but tiny-probe makes images" in out["frames"]
    assert out["loaded"] == ["ProbeModel", "ProbePipeline"]
    assert out["trained"]

    shutil.copytree(folder, folder.with_name("probe_again"))  # a second folder registering the same
    again = subprocess.run([sys.executable, "-c", "import components.models.config"], cwd=root, capture_output=True,
                           text=True, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}, timeout=120)
    assert ("components/models/probe/ and components/models/probe_again/ both register the pipeline ProbePipeline"
            in again.stderr)
