"""The base every config section derives from, one-line validation messages naming the key path, and the one YAML
loader every user-written YAML goes through."""

import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from components import environ
from components.errors import ConfigError

# A seed reaches torch.manual_seed (which takes < 2**64) after derivations such as seed x 1,000,003 + epoch; below
# 2**32 every derivation stays far inside, and numpy's legacy seeding and MLflow's `long` parameters accept it too.
SEED_LIMIT = 2**32
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]

# `scheme://userinfo@`: a scheme (a letter, then letters, digits, + . -), `://`, then characters up to the first
# `@` with no `/` or whitespace between. Linear in the text: a match may start only where a run of scheme characters
# starts (the lookbehind), and the possessive quantifiers never give back what they took, so each character is
# looked at a bounded number of times (a search starting at every letter of a 1 MB word was quadratic: 80 s for
# 256 KB). The run's leading digits and signs, which cannot start a scheme, are matched into `lead`: a
# substitution writes `\g<lead>` back, so `scheme` and the text around the match are exactly those of the plain
# `[A-Za-z][A-Za-z0-9+.-]*://[^/@\s]+@`.
URL_USERINFO = re.compile(r"(?<![A-Za-z0-9+.-])(?P<lead>[0-9+.-]*+)(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*+://)[^/@\s]++@")
# The longest string (a value or a key) a config may hold: ample for a path, a URL or a prompt, and a bound on
# what every reader of a config (the credential check, MLflow params, a tokenizer) is handed.
MAX_STRING_CHARS = 65_536
# The longest config text (a file, `env:NAME`, the pipeline's config parameter, a `key=value`'s value): 50 times the
# largest shipped config (10 KB), thousands of inline prompts, and half a second of PyYAML (about 1 MB a second
# here). Many prompts belong in a `data.path` file.
MAX_CONFIG_CHARS = 1 << 19


def _first_string_at(data: Any, bad: Callable[[str], bool], prefix: str = "", keys: bool = False) -> str | None:
    """The key path of the first string in ``data`` that is ``bad``, else None. With ``keys`` a mapping's keys are
    looked at too; a bad key's path ends in its first 40 characters."""
    if isinstance(data, str):
        return prefix or "(value)" if bad(data) else None
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        path = f"{prefix}.{key}" if prefix else str(key)
        if keys and isinstance(key, str) and bad(key):
            return f"{prefix}.{key[:40]}..." if prefix else f"{key[:40]}..."
        found = _first_string_at(value, bad, path, keys)
        if found:
            return found
    return None


def url_credentials_at(data: Any, prefix: str = "") -> str | None:
    """The key path of the first string in ``data`` holding a URL with ``user[:password]@``, else None."""
    return _first_string_at(data, lambda text: URL_USERINFO.search(text) is not None, prefix)


def check_strings(data: Any) -> Any:
    """Every string of a config (value or key) is at most ``MAX_STRING_CHARS`` long, checked first so that no
    reader (the credential check's regex included) is handed more; and no URL in it carries credentials: a config
    is written to the run's output, S3 and logs. Every service it names takes them from the environment (S3:
    AWS_*, MLflow: MLFLOW_TRACKING_*, the VLM judge: its api_key_env) or a Kubernetes Secret. The messages name
    the key, never the value."""
    where = _first_string_at(data, lambda text: len(text) > MAX_STRING_CHARS, keys=True)
    if where:
        raise ValueError(f"{where}: a string longer than {MAX_STRING_CHARS:,} characters, the most a config "
                         "string may hold (many prompts belong in a data.path file)")
    where = url_credentials_at(data)
    if where:
        raise ValueError(f"{where}: a URL with credentials (user:password@) would be written to the run's "
                         "config.yaml, S3 and logs; remove them and give them in the environment or a Secret "
                         "(S3: AWS_*, MLflow: MLFLOW_TRACKING_*, a VLM judge: its api_key_env)")
    return data


class Section(BaseModel):
    """Unknown keys are errors, not silently ignored; so are NaN and infinite numbers (a NaN reward weight or an
    infinite timeout passes every ``gt`` / ``ge`` bound). Types are strict: ``true`` or ``"0.1"`` where a number is
    meant, ``1`` where a boolean is meant, ``2.0`` where a whole number is meant are refused, not converted (an int
    is still a valid float). A tuple field (a YAML list) is declared ``Field(strict=False)`` with strict items."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, strict=True)

    @classmethod
    def default_of(cls, key: str) -> Any:
        """The schema's default of ``key``: what a command-line option or a function argument mirroring it
        defaults to, so a default is written once."""
        return cls.model_fields[key].get_default(call_default_factory=True)


def validation_problems(exc: ValidationError, prefix: str = "", quote: bool = True) -> str:
    """``key.path: problem; ...``, each path under ``prefix`` (``rewards.0.args``) when given. Without ``quote``
    neither a refused value nor an unknown key's name is shown (a config that may hold a secret, ``hides_text``)."""
    parts = []
    for err in exc.errors():
        where = (prefix, *err["loc"]) if quote or err["type"] != "extra_forbidden" else (prefix, *err["loc"][:-1])
        loc = ".".join(str(p) for p in where if p != "")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; the example configs spell every key)" if quote else (
                "an unknown key (its name is not shown)")
        elif quote and "input" in err and err["type"] not in ("missing",) \
                and not isinstance(err["input"], dict | list):
            msg = f"{msg} (got {err['input']!r})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line: ``invalid config SOURCE: key.path: problem; ...``. ``source`` names where the mapping came from
    (a file, ``env:NAME``, a phrase such as "from the pipeline's config parameter")."""
    # A source that starts with the word itself (config.yaml) must not read "invalid config config.yaml".
    lead = "invalid" if re.match(r"config\b", source) else "invalid config"
    return f"{lead} {source}: {validation_problems(exc, quote=not hides_text(source))}"


def chained(exc: BaseException, source: str) -> BaseException | None:
    """What an error about the config from ``source`` is raised from (``raise ... from chained(exc, source)``):
    ``exc``, or nothing where ``source`` hides its text: PyYAML's and pydantic's own messages quote the text, and a
    traceback would print them."""
    return None if hides_text(source) else exc


ENV_SOURCE = "env:"
HIDDEN_TEXT = "its text is not shown: an environment variable may hold a secret"


def hides_text(source: str) -> bool:
    """Whether errors about the config read from ``source`` leave out every part of its text (the offending line, a
    quoted token, a refused value): ``env:NAME`` reads a variable, which may be a secret
    (``--config env:AWS_SECRET_ACCESS_KEY``)."""
    return source.startswith(ENV_SOURCE)


# Anchors and aliases may stand for at most this many YAML nodes (scalars, lists, mappings) in all: reuse of a section
# or a reward list takes tens; a "billion laughs" document (9 aliases of 9 aliases of ...) stands for billions,
# which every reader of the data (validation, the credential check, a reward's JSON key) would walk.
MAX_ALIAS_NODES = 10_000
# Lists and mappings nested deeper than this are refused (PyYAML composes recursively: 50,000 `[` would end in a
# RecursionError); the deepest shipped config nests 5.
MAX_DEPTH = 64
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _Refused(yaml.MarkedYAMLError):
    """A document the loader refuses although it is well-formed YAML (a budget, a duplicate key, a value its type
    cannot hold). ``plain`` says the same without any of the document's text (``hides_text``)."""

    def __init__(self, problem: str, mark: yaml.Mark, plain: str | None = None) -> None:
        super().__init__(problem=problem, problem_mark=mark)
        self.plain = problem if plain is None else plain


def _key_path(root: yaml.Node, target: yaml.Node) -> list[str] | None:
    """The keys and list indices from ``root`` down to ``target``; None when it is not under ``root``."""
    if root is target:
        return []
    if isinstance(root, yaml.MappingNode):
        children = [(key.value if isinstance(key, yaml.ScalarNode) else "?", value) for key, value in root.value]
    elif isinstance(root, yaml.SequenceNode):
        children = [(str(i), item) for i, item in enumerate(root.value)]
    else:
        return None
    for label, child in children:
        if (below := _key_path(child, target)) is not None:
            return [label, *below]
    return None


class ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader for every YAML a user writes (experiment configs, `key=value` values, pipeline
    arguments, the reward server's settings), refusing what a plain ``safe_load`` accepts silently or unboundedly:
    aliases past ``MAX_ALIAS_NODES``, a recursive alias, nesting past ``MAX_DEPTH``, a key given twice in one
    mapping (``safe_load`` keeps the last). Numbers with an exponent and no dot (``3e-4``) are floats, as in YAML
    1.2 (YAML 1.1 reads them as strings, which the strict config types would refuse)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._sizes: dict[int, int] = {}  # id(node) -> the nodes it stands for, its aliases expanded
        self._aliased = 0  # nodes the aliases composed so far stand for
        self._depth = 0
        self._root: yaml.Node | None = None

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            node = super().compose_node(parent, index)
            size = self._sizes.get(id(node))
            if size is None:  # its anchor's node is still being composed: it would contain itself
                raise _Refused(f"alias *{event.anchor} refers to a node that contains it (a recursive structure)",
                               event.start_mark, "an alias refers to a node that contains it (a recursive structure)")
            self._aliased += size
            if self._aliased > MAX_ALIAS_NODES:
                raise _Refused(f"alias *{event.anchor} expands the document's aliases past {MAX_ALIAS_NODES:,} "
                               "nodes (a YAML bomb?); write the values out or reuse smaller parts", event.start_mark,
                               f"aliases expand past {MAX_ALIAS_NODES:,} nodes")
            return node
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(f"lists and mappings nested deeper than {MAX_DEPTH} levels", event.start_mark)
        node = super().compose_node(parent, index)
        self._depth -= 1
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else (
            node.value if isinstance(node, yaml.SequenceNode) else [])
        self._sizes[id(node)] = 1 + sum(self._sizes[id(child)] for child in children)
        return node

    def compose_mapping_node(self, anchor: str | None) -> yaml.MappingNode:
        node = super().compose_mapping_node(anchor)
        first: dict[tuple[str, str], yaml.Node] = {}
        for key, _ in node.value:
            if not isinstance(key, yaml.ScalarNode) or key.tag == _MERGE_TAG:
                continue
            if (seen := first.setdefault((key.tag, key.value), key)) is not key:
                raise _Refused(f"duplicate key {key.value!r} (lines {seen.start_mark.line + 1} and "
                               f"{key.start_mark.line + 1}); YAML would keep only the last", key.start_mark,
                               f"a key given twice (lines {seen.start_mark.line + 1} and {key.start_mark.line + 1})")
        return node

    def construct_document(self, node: yaml.Node) -> Any:
        self._root = node
        return super().construct_document(node)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except ValueError as exc:  # a scalar its type cannot hold: an int of 5,000 digits, the date 2024-13-45
            kind = node.tag.rpartition(":")[2]
            path = ".".join(_key_path(self._root, node) or []) if self._root is not None else ""
            reason = str(exc).split(";")[0]  # Python's int limit goes on to suggest a call to sys
            raise _Refused(f"{path + ': ' if path else ''}not a valid {kind} ({reason})", node.start_mark,
                           f"not a valid {kind}") from None


ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _described(exc: yaml.YAMLError, text: str, source: str) -> tuple[str, str, str]:
    """Where in ``text`` PyYAML's ``exc`` is, what it is, and what it is without quoting any of the text."""
    if isinstance(exc, yaml.reader.ReaderError):  # a character no YAML may hold, found before parsing
        line, column = text.count("\n", 0, exc.position) + 1, exc.position - text.rfind("\n", 0, exc.position)
        return (f"{source}:{line}:{column}", f"character #x{exc.character:04x} is not allowed in YAML (a control or "
                "other special character)", "a character YAML does not allow")
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
        if isinstance(exc, _Refused):
            return where, exc.problem, exc.plain
        return where, f"YAML syntax error: {exc.problem or exc.context}", "not valid YAML"
    return source, f"YAML error: {str(exc).splitlines()[0]}", "not valid YAML"


def load_yaml(text: str, source: str) -> Any:
    """``text`` parsed by ``ConfigLoader``; a ConfigError of one line naming ``source`` and the line otherwise (and
    none of the text when ``hides_text(source)``). A text longer than ``MAX_CONFIG_CHARS`` is refused unparsed."""
    if len(text) > MAX_CONFIG_CHARS:
        raise ConfigError(f"{source}: longer than {MAX_CONFIG_CHARS:,} characters, the most a config may hold "
                          "(many prompts belong in a data.path file)")
    try:
        loader = ConfigLoader(text)  # PyYAML's reader checks every character here, before parsing
        try:
            return loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        where, problem, plain = _described(exc, text, source)
        message = f"{where}: {plain} ({HIDDEN_TEXT})" if hides_text(source) else f"{where}: {problem}"
        raise ConfigError(message) from chained(exc, source)


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping, read by ``load_yaml``; ConfigError naming the file (and line)
    otherwise. ``env:NAME`` reads the YAML text from environment variable NAME instead (how a RayJob carries its
    config)."""
    source = str(path)
    try:
        if source.startswith(ENV_SOURCE):
            text = environ.named_by_user(source[len(ENV_SOURCE):])
            if text is None:
                raise ConfigError(f"config {source}: environment variable {source[len(ENV_SOURCE):]} is not set")
        elif not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        else:
            with path.open(encoding="utf-8") as f:
                text = f.read(MAX_CONFIG_CHARS + 1)  # a longer file is refused by load_yaml, never read whole
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc})") from exc
    data = load_yaml(text, source)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data
