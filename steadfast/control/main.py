"""The router process: loads the tokenizer, connects to the workers, serves HTTP with uvicorn; on SIGTERM
it stops admitting, lets its streams finish (control/http/shutdown.py) and exits 0."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os

import uvicorn

from steadfast.cluster.members import ROUTER_TTL_S, Members, RouterRecord
from steadfast.cluster.membership import Membership
from steadfast.config import config_from_dict, env
from steadfast.control.fleet.client import EngineClient
from steadfast.control.fleet.parts import FleetParts
from steadfast.control.http.access import own_names
from steadfast.control.http.api import create_app
from steadfast.control.http.dashboard import Dashboard
from steadfast.control.http.guard import GuardConfig
from steadfast.control.http.limits import bounded_protocol
from steadfast.control.http.metrics import Metrics
from steadfast.control.http.resume_token import ResumeSigner
from steadfast.control.http.serving import Limits, ServingContext
from steadfast.control.http.shutdown import GracefulServer, Shutdown
from steadfast.control.ladder.degrade import Degradation, Sources
from steadfast.model.gguf_meta import max_model_len, open_gguf, read_config
from steadfast.model.tokenizer import GGUFTokenizer
from steadfast.util.log import setup_logging
from steadfast.util.proc import die_with_parent
from steadfast.wire.curve import ClusterSide, KeyFile
from steadfast.wire.worker import WorkerRole

log = logging.getLogger("steadfast.router")


async def serve(
    cfg_json: str,
    workers: list[tuple[int, str, WorkerRole]],
    output: str,
    ledger_urls: list[str],
    supervisor: str = "",
    join: str = "",
    cluster_keys: str = "",
) -> None:
    """`join`, `cluster_keys`: a router part's etcd URL and key file: it learns its workers there."""
    cfg = config_from_dict(json.loads(cfg_json)).with_env_keys()  # (keys never come on the command line)
    reader = open_gguf(cfg.model.resolved_path)
    model_cfg = read_config(reader)
    srv = cfg.server
    metrics = Metrics()
    keys = KeyFile.load(cluster_keys, ClusterSide.ROUTER) if cluster_keys else None
    parts = FleetParts.make(output, keys, cfg.routing, cfg.cache.block_size)
    degradation = Degradation(
        cfg.degradation,
        cfg.slo,
        cfg.scheduler,
        cfg.cache.block_size,
        Sources(parts.registry, parts.in_flight, parts.hub.broadcast, parts.cached_on),
        on_change=metrics.level_changed,
        on_refuse=metrics.refused,
    )
    client = EngineClient(
        workers,
        output,
        cfg.server.status_interval_s,
        cfg.fault_recovery.takeover,
        cfg.fault_recovery.request.idempotency_window,
        ledger_urls,
        cfg.scheduler.max_num_seqs,
        srv.request_timeout,
        cfg.migration,
        cfg.cache.block_size,
        supervisor,
        health=cfg.health,
        routing=cfg.routing,
        scheduler=cfg.scheduler,
        keys=keys,
        startup_timeout_s=srv.startup_timeout_s,
        on_handoff=metrics.handoff,
        on_migration=metrics.migration,
        parts=parts,
        # KV-aware routing weighs a prompt's cached prefix against each worker's load as the ladder models it.
        loads=lambda rid: {load.worker_id: load for load in degradation.loads(exclude=rid)},
    )
    await client.start()
    tasks = []
    if join:
        members = Members(join)
        ledgers = client.resumption_records.ledger_urls
        membership = Membership(members, client.notice, lambda url: url in ledgers or ledgers.append(url))
        # (each task its own etcd client: a client is used by one thread at a time)
        tasks += [asyncio.create_task(membership.run()), asyncio.create_task(publish(Members(join), output))]
    ctx = ServingContext(
        client=client,
        tokenizer=GGUFTokenizer.from_gguf(reader),
        model_name=cfg.model.name,
        max_model_len=max_model_len(cfg, model_cfg),
        block_size=cfg.cache.block_size,
        metrics=metrics,
        signer=ResumeSigner(env.resume_key()),
        limits=Limits(srv.max_messages, srv.max_prompt_chars, srv.max_pending_requests, srv.max_n),
        degradation=degradation,
        keepalive_s=srv.sse_keepalive,
    )
    ladder = asyncio.create_task(degradation.run())
    shutdown = Shutdown()
    guard = GuardConfig(
        srv.api_key,
        srv.admin_api_key,
        srv.open_metrics,
        srv.max_body_bytes,
        srv.max_connections,
        shutdown,
        cfg.access,
        (srv.host,),
        own_names(),
    )
    dashboard = Dashboard(ctx)
    sampler = asyncio.create_task(dashboard.run())
    app = create_app(ctx, guard, dashboard, srv.soak_report)
    if cfg.server.router_nice:
        # Only now: a router restarted on a loaded machine must come up at full priority, because its
        # clients are waiting to resume; serving, it yields the CPU to the workers.
        os.nice(cfg.server.router_nice)
    server = GracefulServer(
        uvicorn.Config(
            app,
            host=cfg.server.host,
            port=cfg.server.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
            http=bounded_protocol(cfg.access.header_timeout, cfg.access.max_header_bytes),
            # X-Forwarded-For names the client only when it comes from a proxy the operator named
            # (uvicorn's default believes any loopback peer).
            proxy_headers=bool(cfg.access.trusted_proxies),
            forwarded_allow_ips=list(cfg.access.trusted_proxies) or None,
        ),
        shutdown,
    )
    drain = asyncio.create_task(shutdown.drain(client, server, srv.shutdown_timeout))
    try:
        await server.serve()
    finally:
        for task in (drain, ladder, sampler, *tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await client.close()


async def publish(members: Members, output: str) -> None:
    """A router part's address in etcd, under a lease renewed while this router runs."""
    record = RouterRecord(output, os.getpid())
    lease = 0
    while True:
        try:
            if lease == 0:
                lease, _ = await asyncio.to_thread(members.etcd.lease_grant, ROUTER_TTL_S)
                await asyncio.to_thread(members.publish_router, record, lease)
            else:
                lease = await asyncio.to_thread(members.router_alive, record, lease)
        except Exception as exc:  # noqa: BLE001 - etcd unreachable: the record stands until its lease ends
            log.warning("the router's record not renewed: %s", exc)
        await asyncio.sleep(ROUTER_TTL_S / 3)


def main() -> None:
    parser = argparse.ArgumentParser(description="Steadfast router process")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--worker", action="append", default=[], help="ID=ADDRESS of a worker taking traffic")
    parser.add_argument("--standby", action="append", default=[], help="ID=ADDRESS of a standby (repeat)")
    parser.add_argument(
        "--ledger", action="append", default=[], help="a node's ledger URL, to resume requests after a restart"
    )
    parser.add_argument("--output", required=True, help="address to bind for worker outputs")
    parser.add_argument("--supervisor", default="", help="the supervisor's address, to ask for new workers")
    parser.add_argument("--join", default="", help="a router part's etcd URL: workers join from the nodes' records")
    parser.add_argument("--cluster-keys", default="", help="a router part's key file (router.keys)")
    args = parser.parse_args()
    die_with_parent()
    setup_logging("router")
    workers = [(*_worker(a), WorkerRole.MIXED) for a in args.worker]
    workers += [(*_worker(a), WorkerRole.STANDBY) for a in args.standby]
    asyncio.run(
        serve(args.config_json, workers, args.output, args.ledger, args.supervisor, args.join, args.cluster_keys)
    )


def _worker(arg: str) -> tuple[int, str]:
    """`3=ipc:///run/worker3` → (3, address): ids are the workers' own (after deaths, not 0..n-1)."""
    worker_id, _, address = arg.partition("=")
    return int(worker_id), address


if __name__ == "__main__":
    main()
