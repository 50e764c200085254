"""User YAML is read by one bounded loader, and every config number is a number within bounds the code can take."""

import random
import re
import time
from pathlib import Path

import pytest

from components.config_base import (
    MAX_ALIAS_NODES,
    MAX_CONFIG_CHARS,
    MAX_STRING_CHARS,
    SEED_LIMIT,
    URL_USERINFO,
    load_yaml,
    url_credentials_at,
)
from components.errors import ConfigError
from components.flow_rl.config import MAX_EPOCHS
from components.reward_server.settings import load_settings
from components.tracking.params import redact
from components.trainer.config import TrainingJobConfig
from pipeline.config import config_from_parameter, load_config

LAUGHS = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]',
          *(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 9))]  # 9**9 strings


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def _refused_fast(path: Path, needle: str) -> str:
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert time.monotonic() - start < 5  # before: hung for good (validation walked the 387 M expanded strings)
    message = str(info.value)
    assert "\n" not in message and needle in message, message
    return message


def test_a_billion_laughs_at_the_top_level_is_refused_naming_file_and_line(tmp_path):
    path = _write(tmp_path, "\n".join(LAUGHS) + "\n")
    message = _refused_fast(path, f"past {MAX_ALIAS_NODES:,} nodes")
    assert message.startswith(f"{path}:5:")  # l4's first alias stands for 9**4 nodes: past the budget


def test_a_billion_laughs_inside_a_rewards_args_is_refused(tmp_path):
    # Before: validate said valid; train grew memory without bound (the reward cache's JSON key expands it).
    args = "\n".join(f"      {line}" for line in LAUGHS)
    path = _write(tmp_path, f"rewards:\n  - name: brightness\n    args:\n{args}\n")
    assert _refused_fast(path, f"past {MAX_ALIAS_NODES:,} nodes").startswith(f"{path}:")


def test_a_recursive_alias_and_deep_nesting_are_refused(tmp_path):
    _refused_fast(_write(tmp_path, "data: &a {prompts: [*a]}\n"), "refers to a node that contains it")
    _refused_fast(_write(tmp_path, "x: " + "[" * 5000 + "]" * 5000 + "\n"), "nested deeper than 64")


def test_anchors_reused_within_the_budget_still_work(tmp_path):
    path = _write(tmp_path, "rewards: &r [{name: brightness, weight: 2}]\neval_rewards: *r\n"
                            "sampling: {<<: {group_size: 4, prompts_per_epoch: 4}, group_size: 8}\n")
    config = load_config(path)
    assert config.eval_rewards == config.rewards and config.rewards[0].weight == 2
    assert (config.sampling.group_size, config.sampling.prompts_per_epoch) == (8, 4)  # a merge key may be overridden


def test_a_duplicate_key_is_refused_naming_the_key_and_both_lines(tmp_path):
    # Before: `seed: 2` silently won.
    path = _write(tmp_path, "seed: 1\ntrain:\n  epochs: 3\nseed: 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}:4:1: duplicate key 'seed' (lines 1 and 4); YAML would keep only the last"
    with pytest.raises(ConfigError, match="duplicate key 'epochs' \\(lines 2 and 3\\)"):
        load_config(_write(tmp_path, "train:\n  epochs: 3\n  epochs: 4\n"))


def test_every_user_yaml_goes_through_the_same_loader(tmp_path):
    bomb = "{" + ", ".join(LAUGHS) + "}"
    with pytest.raises(ConfigError, match=r"override rewards\.0\.args:1:.*past 10,000 nodes"):
        load_config(None, [f"rewards.0.args={bomb}"])
    with pytest.raises(ConfigError, match=r"config parameter:1:.*duplicate key 'seed'"):
        config_from_parameter("{seed: 1, seed: 2}")
    server = _write(tmp_path, "rewards: [{name: brightness}]\nrewards: [{name: ocr}]\n")
    with pytest.raises(ConfigError, match=f"{server}:2:1: duplicate key 'rewards'"):
        load_settings(server, None)


def test_exponents_without_a_dot_are_numbers_in_files_and_overrides(tmp_path):
    # YAML 1.1 reads 3e-4 as a string, which the strict number types would refuse.
    assert load_yaml("a: 3e-4\nb: 1E+5\nc: 1.0e-08\nd: '3e-4'\ne: 10\nf: 2.60.0", "x") == {
        "a": 3e-4, "b": 1e5, "c": 1e-8, "d": "3e-4", "e": 10, "f": "2.60.0"}
    config = load_config(_write(tmp_path, "train: {learning_rate: 3e-4}\n"), ["train.adam_eps=1e-6"])
    assert (config.train.learning_rate, config.train.adam_eps) == (3e-4, 1e-6)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("train.learning_rate=true", "train.learning_rate: Input should be a valid number (got True)"),
        ("train.learning_rate='0.001'", "train.learning_rate: Input should be a valid number (got '0.001')"),
        ("train.epochs=2.0", "train.epochs: Input should be a valid integer (got 2.0)"),
        ("tracking.system_metrics=1", "tracking.system_metrics: Input should be a valid boolean (got 1)"),
        ("train.adam_betas=[true, 0.9]", "train.adam_betas.0: Input should be a valid number (got True)"),
        ("rewards.0.weight=yes", "rewards.0.weight: Input should be a valid number (got True)"),
    ],
)
def test_a_value_of_another_type_is_refused_not_converted(override, needle):
    # Before: `learning_rate: true` trained at 1.0, '0.001' and 2.0 were converted, 1 was read as true.
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert needle in str(info.value)


def test_an_int_is_still_a_float_and_a_list_still_a_tuple():
    config = load_config(None, ["train.learning_rate=1", "train.adam_betas=[0, 0.5]", "rewards.0.weight=2"])
    assert config.train.learning_rate == 1.0 and config.train.adam_betas == (0.0, 0.5)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        # Before: validated, then torch.manual_seed raised "Overflow when unpacking long long".
        ("seed=1000000000000000000000000000000", "seed: Input should be less than 4294967296"),
        ("seed=-1", "seed: Input should be greater than or equal to 0"),
        (f"eval.seed={SEED_LIMIT}", "eval.seed: Input should be less than 4294967296"),
        (f"train.epochs={MAX_EPOCHS + 1}", "train.epochs: Input should be less than or equal to 1000000"),
        ("sampling.group_size=1000000000000", "sampling.group_size: Input should be less than or equal to 65536"),
        ("sampling.prompts_per_epoch=16384", "x sampling.group_size = 131,072 images per epoch; at most 65,536"),
        ("train.gradient_accumulation_steps=100000", "train.gradient_accumulation_steps: Input should be less"),
        # Before: threading refuses a wait past ~9.2e9 s (OverflowError in the trainer's scoring).
        ("rewards.0.timeout_s=1e10", "rewards.0.timeout_s: Input should be less than or equal to 86400"),
        ("model.lora.rank=100000", "model.lora.rank: Input should be less than or equal to 1024"),
        ("eval.bootstrap_samples=1000000000", "eval.bootstrap_samples: Input should be less than or equal to 100000"),
    ],
)
def test_numbers_that_reach_torch_numpy_or_threading_are_bounded(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["sampling.group_size=8", override])
    assert needle in str(info.value)


def test_the_largest_seed_and_epoch_fit_every_seed_the_trainer_derives():
    from components.trainer.loop import _epoch_generator, _noise_generators

    config = load_config(None, [f"seed={SEED_LIMIT - 1}", f"train.epochs={MAX_EPOCHS}"])
    _epoch_generator(config.seed, config.train.epochs)
    _noise_generators(config.seed, config.train.epochs, 10**6, "cpu")(0)


# The credential pattern as it was (quadratic: a search starts at every letter of a long word), kept as the
# reference the linear one must agree with.
PLAIN_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")
CRAFTED = [
    "http://u:p@h", "https://bob:hunter2@rs", "s3://k:hunter2@b/p", "http://u:PLANTED-9f3@127.0.0.1:1",
    "https://u:PLANTED-9f3@judge/v1", "http://***@judge:8000/v1", "http://judge:8000/v1", "http://@h", "http:/u@h",
    "1a2b://u@h", "9://u@h", "+.-x://u@h", "a-b.c+d://u:p@h", "x http://u@h y https://v:w@k", "mailto:bob@example.org",
    "http://u /p@h", "http://u\t@h", "http://a/b@c", "a://b://c@d", "a:b://c@d", "é://u@h", "aé://u@h", "://u@h",
    "http://u@h@k", "git+ssh://git@github.com/o/r", "s3://bucket/key@v1", "HTTP://U:P@H", "", "@", "a://@",
]


def _strings(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    parts = ["a", "Z", "1", "+", ".", "-", "://", ":", "/", "@", " ", "\n", "é", "s3", "http", "u:p", "x://", "u@"]
    return ["".join(rng.choice(parts) for _ in range(rng.randint(0, 12))) for _ in range(n)]


def test_the_credential_pattern_flags_and_redacts_what_the_plain_pattern_did():
    flagged = 0
    for text in CRAFTED + _strings(0, 20_000):
        assert bool(URL_USERINFO.search(text)) == bool(PLAIN_USERINFO.search(text)), text
        assert redact(text) == PLAIN_USERINFO.sub(r"\g<scheme>***@", text), text
        flagged += bool(PLAIN_USERINFO.search(text))
    assert flagged > 1000  # the random strings exercise both answers


@pytest.mark.parametrize("text", ["a" * 1_000_000, "a" * 500_000 + "://" + "u" * 500_000, "a1" * 500_000,
                                  "1a://" * 200_000, "a://b" * 200_000, "a://u:" * 170_000],
                         ids=["word", "word-scheme-userinfo", "letters-and-digits", "schemes", "urls", "userinfos"])
def test_the_credential_pattern_takes_linear_time(text):
    # Before: the plain pattern took 80 s on a 256 KB word; quadratic, it would take about 20 minutes here.
    start = time.perf_counter()
    assert URL_USERINFO.search(text) is None and url_credentials_at({"x": text}) is None
    assert redact(text) == text
    assert time.perf_counter() - start < 1


def test_a_string_past_the_bound_is_refused_naming_its_key_and_the_bound(tmp_path):
    long = "a" * (MAX_STRING_CHARS + 1)
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"rewards.0.args={{note: {long}}}"])
    assert f"rewards.0.args.note: a string longer than {MAX_STRING_CHARS:,} characters" in str(info.value)
    with pytest.raises(ConfigError, match=r"data\.prompts\.1: a string longer than 65,536 characters"):
        load_config(_write(tmp_path, f"data:\n  prompts: [a cat, {long}]\n"))
    with pytest.raises(ConfigError, match=r"rewards\.0\.args\.aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\.\.\.: a str"):
        TrainingJobConfig.from_sections({"rewards": [{"name": "brightness", "args": {long: 1}}]}, "x")  # keys too
    assert load_config(None, [f"data.prompts=[{'a' * MAX_STRING_CHARS}]"]).data.prompts == ["a" * MAX_STRING_CHARS]


def test_a_1_mb_string_is_refused_within_a_second_however_it_comes(tmp_path):
    mb = "http" + "a" * 1_000_000 + "://u"  # what the credential check took quadratic time on
    starts = {}
    for how, load in [("override", lambda: load_config(None, [f"data.path={mb}"])),
                      ("file", lambda: load_config(_write(tmp_path, f"data: {{path: {mb}}}\n"))),
                      ("sections", lambda: TrainingJobConfig.from_sections({"data": {"path": mb}}, "x"))]:
        starts[how] = time.perf_counter()
        with pytest.raises(ConfigError) as info:
            load()
        assert time.perf_counter() - starts[how] < 1, how
        assert "\n" not in str(info.value)
    assert str(info.value) == (f"invalid config x: data.path: a string longer than {MAX_STRING_CHARS:,} characters, "
                               "the most a config string may hold (many prompts belong in a data.path file)")


def test_the_reward_servers_settings_bound_their_strings_and_refuse_credentials_as_configs_do(tmp_path):
    long = "a" * (MAX_STRING_CHARS + 1)
    settings = _write(tmp_path, f"rewards:\n  - name: brightness\n    label: {long}\n")
    with pytest.raises(ConfigError, match=rf"rewards\.0\.label: a string longer than {MAX_STRING_CHARS:,} characters"):
        load_settings(settings, None)
    settings = _write(tmp_path, "rewards:\n  - name: vlm_judge\n    args: {base_url: 'http://u:p@judge:8000/v1', "
                                "model: m}\n")
    with pytest.raises(ConfigError, match=r"rewards\.0\.args\.base_url: a URL with credentials") as info:
        load_settings(settings, None)
    assert "u:p" not in str(info.value)
    assert load_settings(_write(tmp_path, f"rewards:\n  - name: brightness\n    label: {long[1:]}\n"),
                         None).rewards[0].label == long[1:]


def test_a_config_text_past_the_bound_is_refused_unparsed(tmp_path, monkeypatch):
    path = tmp_path / "big.yaml"
    with path.open("w") as f:  # a 50 MB scalar: PyYAML alone would take a minute
        f.write("data: {path: ")
        for _ in range(50):
            f.write("a" * 1_000_000)
        f.write("}\n")
    monkeypatch.setenv("BIG_CONFIG", "x: " + "a" * MAX_CONFIG_CHARS)
    for source, load in [(str(path), lambda: load_config(path)),
                         ("env:BIG_CONFIG", lambda: load_config("env:BIG_CONFIG")),
                         ("override data.path", lambda: load_config(None, ["data.path=b" + "a" * MAX_CONFIG_CHARS])),
                         ("config parameter", lambda: config_from_parameter("x: " + "a" * MAX_CONFIG_CHARS))]:
        start = time.perf_counter()
        with pytest.raises(ConfigError) as info:
            load()
        assert time.perf_counter() - start < 1, source
        assert str(info.value).startswith(f"{source}: longer than {MAX_CONFIG_CHARS:,} characters, the most a "
                                          "config may hold (many prompts belong in a data.path file)")


DIGITS = "1" * 5000  # past Python's 4,300-digit limit of int("...")


@pytest.mark.parametrize(
    ("text", "override", "problem"),
    [
        # Before: the ValueError of int() / datetime.date() escaped the loader (a traceback).
        (f"seed: {DIGITS}", f"seed={DIGITS}", "not a valid int (Exceeds the limit (4300 digits) for integer string "
                                              "conversion: value has 5000 digits)"),
        ("seed: 2024-13-45", "seed=2024-13-45", "not a valid timestamp (month must be in 1..12)"),
        # Before: PyYAML's ReaderError was raised outside the handled path (a traceback).
        ("tracking: {experiment: a\x07b}", "tracking.experiment=a\x07b",
         "character #x0007 is not allowed in YAML (a control or other special character)"),
    ],
    ids=["5000 digits", "a date past December", "a control character"],
)
def test_a_value_the_parser_cannot_take_is_one_line_naming_the_key(tmp_path, monkeypatch, text, override, problem):
    path = _write(tmp_path, f"train: {{epochs: 1}}\n{text}\n")
    file_key = "seed: " if text.startswith("seed") else ""  # a control character is refused before parsing
    column = text.index(":") + 3 if file_key else text.index("\x07") + 1
    monkeypatch.setenv("FLOWGRPO_TEST_CONFIG", f"train: {{epochs: 1}}\n{text}\n")
    key = override.partition("=")[0]
    for load, expected in [
        (lambda: load_config(path), f"{path}:2:{column}: {file_key}{problem}"),
        (lambda: load_config(None, [override]), f"override {key}:1:{1 if file_key else 2}: {problem}"),
        (lambda: load_config("env:FLOWGRPO_TEST_CONFIG"), f"env:FLOWGRPO_TEST_CONFIG:2:{column}: "
         f"{problem.split(' (')[0] if file_key else 'a character YAML does not allow'} (its text is not shown: an "
         "environment variable may hold a secret)"),
    ]:
        with pytest.raises(ConfigError) as info:
            load()
        assert str(info.value) == expected


SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCY"


@pytest.mark.parametrize("value", [
    f"{SECRET[:9]}:{SECRET[9:]}{{", f"{SECRET[:9]}: {SECRET[9:18]}: {SECRET[18:]}", f"%{SECRET}", f"*{SECRET}",
    f'"{SECRET[:4]}\\q{SECRET[4:]}"', f"!{SECRET} x", f"[{SECRET}", f"{SECRET[:9]}: &a 1\n{SECRET[:9]}: 2",
    f"{SECRET[:9]}\x07{SECRET[9:]}", f"{SECRET[:9]}: {SECRET[9:]}", f"seed: {SECRET}", f"train: {{{SECRET}: 1}}",
    f"seed: {DIGITS}{SECRET}",
], ids=["colon-brace", "mapping values", "directive", "undefined alias", "unknown escape", "tag", "unclosed list",
        "duplicate key", "control character", "unknown key", "wrong type", "unknown nested key", "digits"])
def test_a_config_from_the_environment_is_refused_without_any_of_its_text(monkeypatch, value):
    """Before: `--config env:AWS_SECRET_ACCESS_KEY` printed part of the secret (PyYAML's token, the line, the key,
    the refused value) in the error, and chained PyYAML's exception, whose traceback prints the line."""
    import traceback

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", value)
    with pytest.raises(ConfigError) as info:
        load_config("env:AWS_SECRET_ACCESS_KEY")
    message = str(info.value)
    assert "\n" not in message and "env:AWS_SECRET_ACCESS_KEY" in message, message
    everything = "".join(traceback.format_exception(info.value))
    assert all(part not in everything for part in (SECRET[:9], SECRET[9:18], SECRET[18:])), everything


def test_an_override_key_with_a_control_character_is_refused_escaped():
    # Before: refused as an unknown key, the escape sequence printed raw to the terminal (here: clear the screen).
    with pytest.raises(ConfigError) as info:
        load_config(None, ["se\x1b[2Jed=1"])
    assert str(info.value) == "override 'se\\x1b[2Jed': a key holds no control characters"
