"""Reward names -> classes (imported lazily, so heavy dependencies load only when used), import paths for user
rewards, and building rewards from their config. ``check_spec`` is the one resolution: the trainer, the evaluation
and the reward server call it through ``build_reward``, and `flowgrpo validate` calls it directly."""

from __future__ import annotations

import importlib
import inspect
import json
from typing import Any

from pydantic import ValidationError

from components.config_base import format_validation_error
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
    """Resolve the class and check the arguments against its constructor, without building anything. A wrapper
    (a constructor taking ``cache``, such as ``rank``) has the reward configs among its arguments (mappings with a
    ``name``) checked the same way."""
    cls = reward_class(spec.name, where)
    params = inspect.signature(cls).parameters
    args = dict(spec.args)
    if "cache" in params:
        args["cache"] = None
        for key, value in spec.args.items():
            if isinstance(value, dict) and "name" in value:
                check_spec(_inner_spec(value, f"{where}.args.{key}"), f"{where}.args.{key}")
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as exc:
        raise RewardError(f"{where}.args: {exc} (reward {spec.name!r})") from exc
    return cls


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
    args = dict(spec.args)
    if "cache" in inspect.signature(cls).parameters:
        args["cache"] = cache or RewardCache()
    try:
        return cls(**args)
    except (ValueError, TypeError, OSError) as exc:
        raise RewardError(f"{where}: reward {spec.name!r} cannot be built: {exc}") from exc
