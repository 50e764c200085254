"""`flowgrpo validate` equals `flowgrpo train`: each hostile config is refused by both with the same one line and
exit 2, in bounded time (before: validate said valid, train crashed with a traceback, hung or grew without end)."""

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LAUGHS = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]',
          *(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9))]

PROBES = {
    "path-like reward name": ("rewards: [{name: ../../etc/passwd}]\n", "rewards.0.name: reward '../../etc/passwd' "
                              "is neither a built-in"),
    "reward module missing": ("rewards: [{name: 'foo.bar:Baz'}]\n",
                              "rewards.0.name: cannot import reward 'foo.bar:Baz': No module named 'foo'"),
    "reward not a Reward": ("rewards: [{name: 'os:system'}]\n",
                            "rewards.0.name: 'os:system' is not a subclass of components.rewards.base.Reward"),
    "seed past torch": ("seed: 1000000000000000000000000000000\n", "seed: Input should be less than 4294967296"),
    "laughs at the top": ("\n".join(LAUGHS) + "\n", "c.yaml:5:10: alias *l3 expands the document's aliases past"),
    "laughs in reward args": ("rewards:\n  - name: brightness\n    args:\n"
                              + "".join(f"      {line}\n" for line in LAUGHS), "c.yaml:8:16: alias *l3 expands"),
    "boolean learning rate": ("train: {learning_rate: true}\n", "train.learning_rate: Input should be a valid number"),
    "duplicate key": ("seed: 1\nseed: 2\n", "c.yaml:2:1: duplicate key 'seed' (lines 1 and 2)"),
    # Before: 80 s in the credential check's regex; a 50 MB scalar, over 300 s.
    "a 256 KB string": (f"data: {{prompts: null, path: {'a' * 256_000}.txt}}\n",
                        "data.path: a string longer than 65,536 characters"),
    "a 50 MB scalar": (f"x: {'a' * 50_000_000}\n", "c.yaml: longer than 524,288 characters"),
    # Before: Python's ValueError (int digits) and PyYAML's ReaderError as tracebacks.
    "a 5000-digit seed": (f"seed: {'1' * 5000}\n", "c.yaml:1:7: seed: not a valid int (Exceeds the limit"),
    "a control character": ("tracking: {experiment: a\x07b}\n", "c.yaml:1:25: character #x0007 is not allowed"),
}


def _error(*args: str) -> str:
    """The one error line of a `flowgrpo` command that must fail, without its command's name."""
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0].split(": error: ", 1)[1]


@pytest.mark.parametrize("probe", list(PROBES))
def test_validate_and_train_refuse_a_hostile_config_with_the_same_line(probe, tmp_path):
    text, needle = PROBES[probe]
    config = tmp_path / "c.yaml"
    config.write_text(text)
    validated = _error("validate", "--config", str(config))
    assert needle in validated
    assert _error("train", "--config", str(config), "--output", str(tmp_path / "run")) == validated
    assert not (tmp_path / "run").exists()  # refused before anything is written (before: config.yaml, run.json)
