"""How several rewards combine (`reward_aggregation`) and the remote reward server (`reward_server:`). A reward's
own entry of `rewards:` and the built-in rewards are the registry's (``registry.py``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from components.config_base import Section

Aggregation = Literal["sum", "gdpo"]


class RewardServerConfig(Section):
    url: str | None = Field(default=None, description="base URL of `flowgrpo reward-server`; null scores "
                                                      "in this process")
    timeout_s: float = Field(default=600.0, gt=0, le=86400, description="seconds per scoring request")
    retry_window_s: float = Field(
        default=180.0, gt=0, le=3600,
        description="how long a reward server that refuses connections, answers 408/429/5xx or stops answering "
                    "its /healthz is retried and waited for before the run stops (a pod restart fits in the default)",
    )
    max_in_flight: int = Field(default=4, ge=1, le=1024, description="concurrent scoring requests")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "retries" in data:
            raise ValueError("reward_server.retries was replaced by reward_server.retry_window_s: failures are "
                             "retried with backoff for that many seconds (default 180), not a number of times")
        return data

    @model_validator(mode="after")
    def _check_url(self) -> RewardServerConfig:
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward_server.url must start with http:// or https://, got {self.url!r}")
        return self
