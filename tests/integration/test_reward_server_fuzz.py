"""Property-based fuzzing of the reward server from its own OpenAPI document, over real HTTP."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from servers import running_server

from components.reward_server.app import create_app
from components.reward_server.settings import Limits, ServerSettings
from components.rewards.registry import RewardSpec

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
# One test per operation, parametrized here rather than by `schema.parametrize()`: under pytest 9.2 that gives its
# tests one node id, and pytest-xdist (.ci/run) then runs only one of them.
OPERATIONS = [(op.method.upper(), op.path) for op in (result.ok() for result in schema.get_all_operations())]


def test_every_operation_is_fuzzed():
    assert {path for _, path in OPERATIONS} >= {"/healthz", "/readyz", "/v1/rewards", "/v1/score", "/compute"}


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_input_makes_the_server_fail(method, path, base_url):
    """No generated request gets a 5xx, and the server stays up."""

    @given(case=schema[path][method].as_strategy())
    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    def check(case):
        response = case.call(base_url=base_url, timeout=30)
        case.validate_response(response, checks=[not_a_server_error])
        assert httpx.get(f"{base_url}/healthz", timeout=10).status_code == 200

    check()
