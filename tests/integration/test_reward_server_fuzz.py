"""Property-based fuzzing of the reward server from its own OpenAPI document, over real HTTP."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from servers import running_server

from components.reward_server.app import create_app
from components.reward_server.settings import Limits, ServerSettings
from components.rewards.config import RewardSpec

_SETTINGS = ServerSettings(
    rewards=[RewardSpec(name="brightness"), RewardSpec(name="jpeg_compressibility", weight=0.5),
             RewardSpec(name="rank", label="rank", args={"reward": {"name": "brightness"}})],
    limits=Limits(max_body_bytes=1_000_000, max_images=16, max_pixels=256 * 256),
)


@pytest.fixture(scope="module")
def base_url():
    with running_server(_SETTINGS) as url:
        yield url


# The document the server itself publishes at /openapi.json (the test below calls the live server).
schema = schemathesis.openapi.from_dict(create_app(_SETTINGS).openapi())


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_makes_the_server_fail(case, base_url):
    """No generated request gets a 5xx, and the server stays up."""
    response = case.call(base_url=base_url, timeout=30)
    case.validate_response(response, checks=[not_a_server_error])
    assert httpx.get(f"{base_url}/healthz", timeout=10).status_code == 200
