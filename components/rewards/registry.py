"""Reward names -> classes (imported lazily, so heavy dependencies load only when used), import paths for user
rewards, and building rewards from their config. ``check_spec`` is the one resolution: the trainer, the evaluation
and the reward server call it through ``build_reward``, and `flowgrpo validate` calls it directly."""

from __future__ import annotations

import importlib
import inspect
import json
from typing import Any

from pydantic import ValidationError

from components.config_base import Section, format_validation_error, validation_problems
from components.errors import RewardError
from components.rewards.base import Reward
from components.rewards.config import RewardSpec, import_target


def reward_class(name: str, where: str = "rewards") -> type[Reward]:
    """The class of a built-in name, or of an import path ``package.module:Class`` / ``package.module.Class``,
    whose module is imported (a user's module runs then, as it would when training)."""
    try:
        module_name, _, attr = import_target(name).partition(":")
    except ValueError as exc:
        raise RewardError(f"{where}.name: {exc}") from exc
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(f"{where}.name: cannot import reward {name!r}: {exc}") from exc
    except Exception as exc:  # a user's module runs on import: whatever it raises, the reward cannot be used
        raise RewardError(f"{where}.name: cannot import reward {name!r}: importing {module_name} raised "
                          f"{type(exc).__name__}: {exc}") from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise RewardError(f"{where}.name: cannot import reward {name!r}: module {module_name} has no {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Reward)):
        raise RewardError(f"{where}.name: {name!r} is not a subclass of components.rewards.base.Reward "
                          f"(it is {type(cls).__name__} {cls!r:.60})")
    if inspect.isabstract(cls):
        raise RewardError(f"{where}.name: {name!r} is abstract (it does not implement "
                          f"{', '.join(sorted(cls.__abstractmethods__))})")
    return cls


class RewardCache:
    """Builds rewards, sharing one instance (and its loaded model) between identical configs."""

    def __init__(self) -> None:
        self._built: dict[str, Reward] = {}

    def get(self, spec: RewardSpec, where: str = "rewards") -> Reward:
        key = json.dumps([spec.name, spec.args], sort_keys=True, default=str)
        if key not in self._built:
            self._built[key] = build_reward(spec, where, cache=self)
        return self._built[key]


def check_spec(spec: RewardSpec, where: str = "rewards") -> type[Reward]:
    """Resolve the class and check the arguments (``reward_args``), without building anything. The reward configs
    a wrapper (such as ``rank``) holds among its arguments are checked the same way."""
    cls = reward_class(spec.name, where)
    for key, inner in _wrapped_specs(cls, reward_args(cls, spec, where), where):
        check_spec(inner, f"{where}.args.{key}")
    return cls


def reward_args(cls: type[Reward], spec: RewardSpec, where: str = "rewards") -> Section | dict[str, Any]:
    """What ``cls`` is built with: ``spec.args`` validated by its ``Args`` model, or (a reward without one) the
    mapping itself, bound to its constructor's signature. RewardError naming each bad key's path otherwise."""
    if cls.Args is not None:
        try:
            return cls.Args.model_validate(spec.args)
        except ValidationError as exc:
            raise RewardError(f"{validation_problems(exc, f'{where}.args')} (reward {spec.name!r})") from exc
    extra = {"cache": None} if _takes_cache(cls) else {}
    try:
        inspect.signature(cls).bind(**spec.args, **extra)
    except TypeError as exc:
        raise RewardError(f"{where}.args: {exc} (reward {spec.name!r})") from exc
    return dict(spec.args)


def _takes_cache(cls: type[Reward]) -> bool:
    return "cache" in inspect.signature(cls).parameters


def _wrapped_specs(cls: type[Reward], args: Section | dict[str, Any], where: str) -> list[tuple[str, RewardSpec]]:
    """The reward configs among a wrapper's arguments: the ``RewardSpec`` fields of its ``Args``, or (a wrapper
    without ``Args``) the mappings with a ``name``."""
    if not _takes_cache(cls):
        return []
    if isinstance(args, Section):
        return [(key, value) for key, value in args if isinstance(value, RewardSpec)]
    return [(key, _inner_spec(value, f"{where}.args.{key}")) for key, value in args.items()
            if isinstance(value, dict) and "name" in value]


def check_specs(specs: list[RewardSpec], where: str) -> None:
    """``check_spec`` on each of ``specs``, named ``where.0``, ``where.1``, ... as the scorers name them."""
    for i, spec in enumerate(specs):
        check_spec(spec, f"{where}.{i}")


def _inner_spec(value: dict[str, Any], where: str) -> RewardSpec:
    try:
        return RewardSpec.model_validate(value)
    except ValidationError as exc:
        raise RewardError(format_validation_error(exc, where)) from exc


def build_reward(spec: RewardSpec, where: str = "rewards", cache: RewardCache | None = None) -> Reward:
    """Instantiate ``spec``; unknown names and bad arguments raise ``RewardError`` naming ``where``.

    A reward class whose constructor takes a ``cache`` keyword (wrappers such as ``rank``) gets the
    cache, to build the rewards it wraps.
    """
    cls = check_spec(spec, where)
    args = reward_args(cls, spec, where)
    extra = {"cache": cache or RewardCache()} if _takes_cache(cls) else {}
    try:
        return cls(**args, **extra) if isinstance(args, dict) else cls(args, **extra)
    except (ValueError, TypeError, OSError) as exc:
        raise RewardError(f"{where}: reward {spec.name!r} cannot be built: {exc}") from exc
