"""The AWS environment of a user behind AWS SSO (or an assumed role): what `aws configure export-credentials
--format env` leaves set, with the profile it came from. For the tests of what `run --local` keeps of it."""

from __future__ import annotations

from pathlib import Path

import pytest

SSO_TOKEN = "IQoJb3JpZ2luX2VjEXAMPLE-session-token"
SSO_ENV = {"AWS_ACCESS_KEY_ID": "ASIAUSERSESSIONKEY", "AWS_SECRET_ACCESS_KEY": "users-session-secret",
           "AWS_SESSION_TOKEN": SSO_TOKEN, "AWS_CREDENTIAL_EXPIRATION": "2099-01-01T00:00:00Z",
           "AWS_PROFILE": "sso-dev", "AWS_DEFAULT_REGION": "eu-west-1"}
SSO_CONFIG = ("[profile sso-dev]\nsso_session = corp\nsso_account_id = 123456789012\nsso_role_name = Dev\n"
              "region = eu-west-1\n[sso-session corp]\nsso_start_url = https://corp.awsapps.com/start\n"
              "sso_region = eu-west-1\n")


def sso_user(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """This process's environment as an SSO user's: session credentials, their profile and its config file."""
    (tmp_path / "aws-config").write_text(SSO_CONFIG)
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {**SSO_ENV, "AWS_CONFIG_FILE": str(tmp_path / "aws-config")}.items():
        monkeypatch.setenv(name, value)
