"""What a deployment hands its children and leaves open: secrets passed through the environment (never a
command line), and a warning at start for each way it is reachable unprotected."""

from __future__ import annotations

import dataclasses
import logging
import secrets

from steadfast.cluster.node import PartRole
from steadfast.config import Config, env
from steadfast.config.ledger_url import is_loopback_host, plaintext_remote_members

log = logging.getLogger("steadfast.launcher")


def hand_keys_to_children(cfg: Config) -> None:
    """Secrets reach the children through their inherited environment, never their command lines
    (which every local user can read); the resume key is made once per deployment, so a restarted
    router accepts the event ids its predecessor sent."""
    client_keys = [dataclasses.asdict(k) for k in cfg.access.keys]
    env.export_keys(
        cfg.server.api_key, cfg.server.admin_api_key, env.resume_key() or secrets.token_bytes(32), client_keys
    )


def warn_exposure(cfg: Config, role: PartRole, join: str = "") -> None:
    """Log a warning, once at start, for what this deployment leaves open on the network: a router on a
    non-loopback address with no API key (anyone who reaches it may use /v1), and a ledger or join URL
    naming etcd members on other hosts over plain HTTP (every prompt and token crosses in clear)."""
    srv = cfg.server
    if role is not PartRole.NODE and not (srv.api_key or cfg.access.keys) and not is_loopback_host(srv.host):
        log.warning(
            "the router listens on %s with no API key: anyone who reaches it may use /v1 "
            "(set server.api_key or STEADFAST_API_KEY, or listen on 127.0.0.1)%s",
            srv.host or "every address",
            ""
            if cfg.access.client_priority != "auto"
            else "; every request is served at normal priority "
            "(keys with max_priority in access.keys, or access.client_priority: on)",
        )
    warned: set[str] = set()
    for url in (cfg.fault_recovery.kv_cache.resolved_ledger_url, join):
        members = [m for m in plaintext_remote_members(url) if m not in warned]
        if members:
            warned.update(members)
            log.warning(
                "etcd member(s) %s are reached over plain HTTP: every prompt and generated token in the "
                "ledger crosses the network unencrypted (use etcd+https://)",
                ", ".join(members),
            )
