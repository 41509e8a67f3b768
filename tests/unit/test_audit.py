"""Admin actions leave an audit line naming the admin key's id, never the key (deploy/serve/audit.py)."""

from __future__ import annotations

import logging

from pydantic import SecretStr

from cluster.config import AuthConfig
from deploy.serve.audit import record
from deploy.serve.auth import KeySet


def test_an_admin_action_is_recorded_with_the_keys_id_and_not_the_key(caplog, monkeypatch) -> None:
    monkeypatch.delenv("TEST_ADMIN_KEYS", raising=False)
    keys = KeySet.load(AuthConfig(admin_keys=(SecretStr("sk-admin-secret"),), admin_keys_env="TEST_ADMIN_KEYS"),
                       admin=True)
    admin = keys.match("Bearer sk-admin-secret")
    with caplog.at_level(logging.INFO, logger="specfleet.audit"):
        record("drain", "inst-1", admin, "10.0.0.7", "ok: migrate")
    [entry] = [r for r in caplog.records if r.name == "specfleet.audit"]
    assert "action=drain" in entry.message and "'inst-1'" in entry.message and admin.name in entry.message
    assert admin.name.startswith("key-") and "sk-admin-secret" not in entry.message and "10.0.0.7" in entry.message
