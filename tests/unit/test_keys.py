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
    keys.chmod(0o600)
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


def test_a_key_file_others_can_read_is_refused_with_the_fix(tmp_path, monkeypatch) -> None:
    """A key file readable (or writable) by other users of the machine is a leaked key: refused, with the chmod
    that fixes it, by the app and by the CLI alike (as ssh refuses a private key others can read)."""
    keys = tmp_path / "api-key"
    keys.write_text("sk-file\n")
    monkeypatch.delenv("TEST_API_KEYS", raising=False)
    cfg = AuthConfig(api_keys_file=str(keys), api_keys_env="TEST_API_KEYS")
    for mode in (0o644, 0o660, 0o602, 0o640):
        keys.chmod(mode)
        with pytest.raises(ValueError, match=rf"mode 0?o?{mode:o}.*chmod 600 {keys}"):
            KeySet.load(cfg)
        with pytest.raises(ValueError, match="chmod 600"):
            first_key(cfg, admin=False)
    for mode in (0o600, 0o400):
        keys.chmod(mode)
        assert KeySet.load(cfg).check("Bearer sk-file")


def test_the_cli_reads_its_keys_from_files_not_only_from_argv(tmp_path, monkeypatch) -> None:
    """`--admin-key` on the command line is visible to every user in `ps`: `--admin-key-file` and `--api-key-file`
    read them from files (refused when others can read them), and the environment still works."""
    import argparse

    from deploy.cli.admin_cmd import add_endpoint_flags, endpoint

    monkeypatch.delenv("SPECFLEET_ADMIN_KEYS", raising=False)
    monkeypatch.delenv("SPECFLEET_API_KEYS", raising=False)
    parser = argparse.ArgumentParser()
    add_endpoint_flags(parser)
    admin, api = tmp_path / "admin", tmp_path / "api"
    admin.write_text("sk-admin-file\n")
    api.write_text("sk-api-file\n")
    for f in (admin, api):
        f.chmod(0o600)
    e = endpoint(parser.parse_args(["--admin-key-file", str(admin), "--api-key-file", str(api)]))
    assert (e.admin_key, e.api_key) == ("sk-admin-file", "sk-api-file")
    admin.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        endpoint(parser.parse_args(["--admin-key-file", str(admin)]))
    monkeypatch.setenv("SPECFLEET_ADMIN_KEYS", "sk-admin-env")
    assert endpoint(parser.parse_args([])).admin_key == "sk-admin-env"
