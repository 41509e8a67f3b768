"""The audit log of the operator's actions: one line per admin action (abort, drain, undrain, migrate) that says
what was done, to what, by which admin key (its id: `key-` and a prefix of its sha256, never the key) and from where,
and how it ended. Written to the `specfleet.audit` logger at INFO (the replica's log, under Ray's session folder;
route that logger to a file or a collector of its own to keep it apart)."""

from __future__ import annotations

import logging

from deploy.serve.auth import Tenant

audit_log = logging.getLogger("specfleet.audit")


def record(action: str, target: str, key: Tenant, client: str | None, outcome: str) -> str:
    """Write one audit line; returns it."""
    line = f"admin action={action} target={target!r} key={key.name} client={client or '-'} outcome={outcome}"
    audit_log.info(line)
    return line
