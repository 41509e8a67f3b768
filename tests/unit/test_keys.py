"""API and admin keys looked up in one place (deploy/serve/auth.py listed_keys): the CLI sends a key the app accepts."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from cluster.config import AuthConfig
from deploy.cli.admin_cmd import first_key
from deploy.serve.auth import KeySet


def test_the_cli_sends_the_first_key_of_the_apps_lookup_order(tmp_path, monkeypatch) -> None:
    keys = tmp_path / "api-key"
    keys.write_text("sk-file-a,sk-file-b\nsk-file-c\n")  # one a line, or commas: the app reads both
    cfg = AuthConfig(api_keys_file=str(keys), admin_keys=(SecretStr("sk-admin"),), api_keys_env="TEST_API_KEYS",
                     admin_keys_env="TEST_ADMIN_KEYS")
    monkeypatch.delenv("TEST_API_KEYS", raising=False)
    monkeypatch.delenv("TEST_ADMIN_KEYS", raising=False)
    app = KeySet.load(cfg)
    assert first_key(cfg, admin=False) == "sk-file-a" and app.check("Bearer sk-file-a")
    assert all(app.check(f"Bearer sk-file-{x}") for x in "abc") and len(app) == 3
    assert first_key(cfg, admin=True) == "sk-admin" and KeySet.load(cfg, admin=True).check("Bearer sk-admin")
    monkeypatch.setenv("TEST_API_KEYS", " sk-env-1 , sk-env-2")  # the environment's come first
    assert first_key(cfg, admin=False) == "sk-env-1" and KeySet.load(cfg).check("Bearer sk-env-1")


def test_a_key_file_missing_here_gives_the_cli_no_key_and_the_app_an_error(tmp_path, monkeypatch) -> None:
    cfg = AuthConfig(api_keys_file=str(tmp_path / "absent"), api_keys_env="TEST_API_KEYS")
    monkeypatch.delenv("TEST_API_KEYS", raising=False)
    assert first_key(cfg, admin=False) is None
    with pytest.raises(ValueError, match="cannot read the API key file"):
        KeySet.load(cfg)
    monkeypatch.setenv("TEST_API_KEYS", "sk-env")  # found before the file is read
    assert first_key(cfg, admin=False) == "sk-env"
