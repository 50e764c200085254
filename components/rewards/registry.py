"""Reward names -> classes (imported lazily, so heavy dependencies load only when used), dotted
import paths for user rewards, and building rewards from their config."""

from __future__ import annotations

import importlib
import inspect
import json

from components.errors import RewardError
from components.rewards.base import Reward
from components.rewards.config import BUILTIN, RewardSpec


def _import(target: str, where: str) -> type[Reward]:
    module_name, sep, attr = target.partition(":")
    if not sep:
        module_name, _, attr = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise RewardError(f"{where}.name: cannot import reward {target!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Reward)):
        raise RewardError(f"{where}.name: {target!r} is not a subclass of components.rewards.base.Reward")
    return cls


def reward_class(name: str, where: str = "rewards") -> type[Reward]:
    """A built-in name, or a dotted path ``package.module:Class`` / ``package.module.Class``."""
    if name in BUILTIN:
        return _import(BUILTIN[name], where)
    if "." in name or ":" in name:
        return _import(name, where)
    raise RewardError(f"{where}.name: unknown reward {name!r}; known: {', '.join(sorted(BUILTIN))} "
                      "(or a dotted import path package.module:Class)")


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
    """Resolve the class and check the arguments against its constructor, without building anything."""
    cls = reward_class(spec.name, where)
    params = inspect.signature(cls).parameters
    args = dict(spec.args)
    if "cache" in params:
        args["cache"] = None
    try:
        inspect.signature(cls).bind(**args)
    except TypeError as exc:
        raise RewardError(f"{where}.args: {exc} (reward {spec.name!r})") from exc
    return cls


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
