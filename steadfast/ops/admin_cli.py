"""`steadfast drain`, `migrate`, `rollout`, `degrade`: an operator's calls to a running server's admin routes
(the admin key from STEADFAST_ADMIN_KEY when the server asks for one)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import httpx

from steadfast.config import env


class AdminError(RuntimeError):
    pass


def call(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    key = env.admin_api_key()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        # (a JSON body even when empty: the router takes admin writes only as JSON, which no page of
        # another site can send it unasked)
        body = body if body is not None or method == "GET" else {}
        r = httpx.request(method, args.url.rstrip("/") + path, json=body, headers=headers, timeout=args.timeout)
    except httpx.HTTPError as exc:
        raise AdminError(f"cannot reach {args.url}: {exc}") from None
    data = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code >= 400:
        message = data.get("error", {}).get("message", r.text) if isinstance(data, dict) else r.text
        raise AdminError(f"{r.status_code}: {message}")
    return data


def _worker(args: argparse.Namespace, worker_id: int) -> dict[str, Any] | None:
    rows = call(args, "GET", "/admin/workers")
    return next((w for w in rows if w["id"] == worker_id), None)  # type: ignore[union-attr]


def cmd_drain(args: argparse.Namespace) -> int:
    answer = call(args, "POST", f"/admin/workers/{args.worker}/drain" + ("?force=true" if args.force else ""))
    print(f"draining worker {args.worker}: {answer['requests']} requests to migrate", flush=True)
    if args.no_wait:
        return 0
    t0 = time.monotonic()
    while (w := _worker(args, args.worker)) is not None and w["state"] != "dead":
        time.sleep(0.2)
    print(f"worker {args.worker} drained and retired in {time.monotonic() - t0:.1f}s")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"to": args.to, "mode": args.mode}
    print(json.dumps(call(args, "POST", f"/admin/requests/{args.request_id}/migrate", body), indent=2))
    return 0


def cmd_rollout(args: argparse.Namespace) -> int:
    state = call(args, "POST", "/admin/rollout")
    print(f"rolling restart of workers {state['workers']}", flush=True)
    seen = 0
    while state["state"] == "running":
        time.sleep(0.5)
        state = call(args, "GET", "/admin/rollout")
        for step in state["steps"][seen:]:
            if step["step"] == "retired":
                print(f"  worker {step['old']} → worker {step['new']} ({step['seconds']:.1f}s)", flush=True)
                seen += 1
    if state["state"] != "done":
        raise AdminError(f"rollout {state['state']}: {state['error']}")
    print(f"rollout done in {state['seconds']:.1f}s")
    return 0


def cmd_degrade(args: argparse.Namespace) -> int:
    if args.level is None:
        state = call(args, "GET", "/admin/degradation")
    else:
        level: int | str = "auto" if args.level == "auto" else int(args.level)
        state = call(args, "POST", "/admin/degradation", {"level": level})
    print(f"L{state['level']} ({state['mode']}): {state['action']}; {state['reason']}")
    for name, p in state["priorities"].items():
        print(f"  {name:6} admission {p['admission']}; speculative {p['speculative']}; shortened {p['shortened']}")
    return 0


def admin_options(p: argparse.ArgumentParser) -> None:
    """The options of every command that calls a running server's admin routes (`run` reports their errors)."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per call")
    p.set_defaults(admin=True)


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    common = admin_options

    drain = sub.add_parser("drain", help="migrate a worker's requests to others, then retire it")
    common(drain)
    drain.add_argument("worker", type=int, help="worker id (GET /admin/workers)")
    drain.add_argument("--no-wait", action="store_true", help="return once the drain has started")
    drain.add_argument("--force", action="store_true", help="drain even the last worker serving its role")
    drain.set_defaults(func=cmd_drain)

    migrate = sub.add_parser("migrate", help="move one running request to another worker")
    common(migrate)
    migrate.add_argument("request_id")
    migrate.add_argument("--to", type=int, help="worker id (default: the least loaded with room)")
    migrate.add_argument("--mode", choices=["kv", "recompute"], default="kv")
    migrate.set_defaults(func=cmd_migrate)

    rollout = sub.add_parser("rollout", help="restart every worker in turn with no failed request")
    common(rollout)
    rollout.set_defaults(func=cmd_rollout)

    degrade = sub.add_parser("degrade", help="show the degradation level, or set it (0..5) or give it back (auto)")
    common(degrade)
    degrade.add_argument("--level", choices=[*map(str, range(6)), "auto"], help="absent: show it")
    degrade.set_defaults(func=cmd_degrade)


def run(func, args: argparse.Namespace) -> int:  # noqa: ANN001 - one of the commands above
    try:
        return int(func(args))
    except AdminError as exc:
        print(f"steadfast: {exc}", file=sys.stderr)
        return 1
