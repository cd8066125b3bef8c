"""The `steadfast` command: `serve` runs the server, `generate` prints one completion in-process;
`drain`, `migrate`, `rollout`, `degrade` and `status` call a running server's admin routes (ops/admin_cli.py,
ops/status_cli.py); `bench` measures any OpenAI-compatible server (ops/harness/bench_cli.py)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from steadfast.config import Config, ConfigError, load_config
from steadfast.model.gguf_meta import ModelLoadError
from steadfast.ops import admin_cli, status_cli
from steadfast.ops.harness import bench_cli, chaos_cli
from steadfast.util.log import setup_logging


def _config(args: argparse.Namespace) -> Config:
    overrides: dict[str, dict[str, object]] = {"model": {}, "server": {}}
    if args.model:
        overrides["model"]["path"] = args.model
    if args.dtype:
        overrides["model"]["dtype"] = args.dtype
    if getattr(args, "port", None) is not None:
        overrides["server"]["port"] = args.port
    if getattr(args, "host", None):
        overrides["server"]["host"] = args.host
    if getattr(args, "workers", None):
        overrides["server"]["workers"] = args.workers
    cfg = load_config(args.config, overrides)
    cfg.model.resolved_path  # noqa: B018 - fail now, with a clear message, if there is no model
    return cfg


def cmd_serve(args: argparse.Namespace) -> int:
    from steadfast.cluster.node import ClusterPart, PartRole
    from steadfast.ops.supervisor.launcher import Launcher, StartupError

    cfg = _config(args)
    cluster = None
    role = PartRole(args.role)
    if role is not PartRole.ALL:
        where = (args.join, args.cluster_keys, args.advertise, args.node, args.outputs_port)
        cluster = ClusterPart.create(cfg, role, *where)
        if cluster.membership is not None:
            cfg = cluster.node_config(cfg)
    elif args.join:
        raise ConfigError("--join is for the parts of a deployment over hosts: add --role router or --role node")
    launcher = Launcher(cfg, cluster=cluster)

    def stop_starting(signum: int, frame: object) -> None:
        if launcher.router_started:  # clients may be streaming already: a stop in order, in `wait`
            launcher.signals.append(signum)
            return
        raise SystemExit(128 + signum)  # so `finally` cleans up (children, arena folder) mid-start too

    # Until `wait` installs its own handlers: a SIGTERM (or Ctrl-C) while starting must not skip the
    # clean-up; once the router runs, it stops the server in order (`wait`, then `stop`), exit 0.
    signal.signal(signal.SIGTERM, stop_starting)
    signal.signal(signal.SIGINT, stop_starting)
    try:
        t0 = time.perf_counter()
        launcher.start()
        ready = f"ready in {time.perf_counter() - t0:.1f}s"
        if cluster is not None and cluster.membership is not None:
            print(f"Steadfast node {cluster.membership.name} joined {args.join} ({ready})", flush=True)
        elif cluster is not None:
            print(f"Steadfast router at {launcher.url}/v1, nodes join at {args.join} ({ready})", flush=True)
        else:
            print(f"Steadfast serving {cfg.model.name} at {launcher.url}/v1 ({ready})", flush=True)
        return launcher.wait()
    except StartupError as exc:
        print(f"steadfast: {exc}", file=sys.stderr)
        return 1
    finally:
        launcher.stop()


def cmd_cluster_keys(args: argparse.Namespace) -> int:
    from steadfast.wire.curve import write_cluster_keys

    try:
        paths = write_cluster_keys(args.folder)
    except FileExistsError as exc:
        print(f"steadfast: {exc.filename} exists; keys are never overwritten", file=sys.stderr)
        return 1
    for side, path in paths.items():
        print(f"{side}: {path} (copy it to every {side} host, mode 0600)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    import random

    from steadfast.wire.worker import AddRequest, SamplingParams
    from steadfast.worker.engine import Engine
    from steadfast.worker.loaded import load_model, private_arena

    cfg = _config(args).replace(cache={"kv_memory_mb": 256})
    loaded = load_model(cfg)
    with tempfile.TemporaryDirectory(dir=cfg.cache.arena_dir) as tmp:
        arena = private_arena(cfg, loaded.model_cfg, str(Path(tmp) / "generate.kv"))
        engine = Engine(cfg, loaded, arena)
        tok = loaded.tokenizer
        ids = tok.encode(args.prompt) if args.raw else tok.encode_chat([{"role": "user", "content": args.prompt}])
        seed = args.seed if args.seed is not None else random.getrandbits(63)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed)
        engine.add_request(AddRequest("generate", ids, params))
        while engine.has_work:
            for out in engine.step():
                if out.error:
                    print(f"steadfast: {out.error}", file=sys.stderr)
                    return 1
                print(out.text, end="", flush=True)
        print()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="steadfast", description="An LLM server that keeps serving through failure")
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", help="path of a llama-architecture GGUF (default: SmolLM2-135M-Instruct)")
        p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], help="weights and KV dtype")
        p.add_argument("--config", help="YAML config file")

    serve = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    common(serve)
    serve.add_argument("--port", type=int)
    serve.add_argument("--host")
    serve.add_argument("--workers", type=int, help="number of worker processes")
    serve.add_argument(
        "--log-format", choices=["text", "json"], help="every process's log lines (default: STEADFAST_LOG_FORMAT, text)"
    )
    serve.add_argument(
        "--role",
        choices=["all", "router", "node"],
        default="all",
        help="all parts on this host (default), or one part of a deployment over hosts (with --join)",
    )
    serve.add_argument("--join", default="", help="etcd://host:port,.../prefix the parts find each other in")
    serve.add_argument("--node", default="", help="this node's name in the deployment (default: the host name)")
    serve.add_argument("--advertise", default="", help="this host's address the other parts reach it at")
    serve.add_argument("--cluster-keys", default="", help="folder (or file) of the keys from `steadfast cluster-keys`")
    serve.add_argument("--outputs-port", type=int, default=0, help="router part: workers' outputs port (port+1)")
    serve.set_defaults(func=cmd_serve)

    keys = sub.add_parser("cluster-keys", help="make the router's and the nodes' keys for a deployment over hosts")
    keys.add_argument("folder", help="where to write router.keys and node.keys (made 0700)")
    keys.set_defaults(func=cmd_cluster_keys)

    gen = sub.add_parser("generate", help="print one completion, computed in this process")
    common(gen)
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    gen.set_defaults(func=cmd_generate)
    admin_cli.add_commands(sub)
    status_cli.add_command(sub)
    bench_cli.add_command(sub)
    chaos_cli.add_command(sub)

    args = parser.parse_args(argv)
    if getattr(args, "log_format", None):
        os.environ["STEADFAST_LOG_FORMAT"] = args.log_format  # the children inherit it
    setup_logging("steadfast")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if getattr(args, "admin", False):
        return admin_cli.run(args.func, args)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"steadfast: configuration error: {exc}", file=sys.stderr)
        return 2
    except ModelLoadError as exc:
        print(f"steadfast: cannot load the model: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
