"""Where the time to first token goes under a burst: one wave of `--requests` concurrent streamed chat
completions against checkouts of Steadfast side by side (alternating rounds), each request's TTFT split
into stages from timestamps that temporary log lines in the *checkouts* record:

  client → router  the client sent it → the router is about to send its `AddRequest` to a worker
  router → worker  sent → the worker drained it from its inbox
  worker           drained → the worker sent the step's outputs holding its first token
  worker → client  those outputs sent → the client read the first token

It also prints the worker's first drains (how the burst split into the first steps) and the router's CPU
seconds over the wave. The probe lines are written into the given checkouts (git worktrees made for this:
`git worktree add /tmp/sf-a REV`); it refuses to touch this repository's own tree.

    python benchmarks/ttft_stages.py --code before=/tmp/sf-before --code after=/tmp/sf-after --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import prompts, stream_body  # noqa: E402
from benchmarks.common import run_info  # noqa: E402
from tests.integration.server import ServerProcess  # noqa: E402

_OUTPUTS_SENT = "                    self.outbox.send(StepOutputs(self.worker_id, outputs))\n"


def instrument(code: Path) -> None:
    """Write the probe lines into a checkout (idempotent)."""
    if code.resolve() == ROOT:
        raise SystemExit("refusing to instrument this repository's own tree: pass a git worktree")
    worker = code / "steadfast/worker/main.py"
    s = worker.read_text()
    if "PROBE W" not in s:
        s = s.replace("class WorkerLoop:", "_PROBE: dict = {}\n\n\nclass WorkerLoop:", 1)
        s = s.replace(
            "                for msg in self.inbox.drain():\n",
            "                _drain = True\n"
            "                for msg in self.inbox.drain():\n"
            "                    if isinstance(msg, AddRequest):\n"
            "                        if _drain:  # the first request of this drain\n"
            "                            log.warning('PROBE P %.6f', time.time())\n"
            "                            _drain = False\n"
            "                        _PROBE[msg.request_id] = time.time()\n",
            1,
        )
        s = s.replace(
            _OUTPUTS_SENT,
            _OUTPUTS_SENT + "                    _now = time.time()\n"
            "                    for _o in outputs:\n"
            "                        if _o.token_ids and _o.request_id in _PROBE:\n"
            "                            _got = _PROBE.pop(_o.request_id)\n"
            "                            log.warning('PROBE W %s %.6f %.6f', _o.request_id, _got, _now)\n",
            1,
        )
        worker.write_text(s)
    router = code / "steadfast/control/fleet/client.py"
    s = router.read_text()
    if "PROBE R" not in s:
        if "await worker.sock.send(protocol.encode(request))" in s:  # the router before the redesign
            s = s.replace(
                "            await worker.sock.send(protocol.encode(request))\n",
                "            log.warning('PROBE R %s %.6f', rid, time.time())\n"
                "            await worker.sock.send(protocol.encode(request))\n",
                1,
            )
        else:
            s = s.replace(
                "            if not await self._send(worker, request):\n",
                "            log.warning('PROBE R %s %.6f', rid, time.time())\n"
                "            if not await self._send(worker, request):\n",
                1,
            )
        s = s.replace(
            "                flight.queue.put_nowait(out)",
            "                if out.token_ids and out.index == 0:\n"
            "                    log.warning('PROBE D %s %.6f', out.request_id, time.time())\n"
            "                flight.queue.put_nowait(out)",
            1,
        )
        if "\nimport time\n" not in s:
            s = s.replace("import asyncio\n", "import asyncio\nimport time\n", 1)
        router.write_text(s)
    for f, mark in ((worker, "PROBE W"), (router, "PROBE R")):
        if mark not in f.read_text():
            raise SystemExit(f"{f}: its code has changed where the probe goes; update ttft_stages.py")


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> tuple:
    body = stream_body(model, prompt, max_tokens)
    t0, first, rid = time.time(), None, None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if rid is None and line.startswith("data: {"):
                rid = json.loads(line[6:])["id"]
            if first is None and '"content":"' in line and '"content":""' not in line:
                first = time.time()
    return rid, t0, first


async def wave(url: str, model: str, n: int, max_tokens: int) -> list[tuple]:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=n + 4)) as client:
        return await asyncio.gather(*(one(client, url, model, p, max_tokens) for p in prompts(n)))


def cpu_seconds(pids: list[str]) -> float:
    total = 0.0
    for pid in pids:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    return total


def run(code: str, args: argparse.Namespace) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="ttft-"))
    cfg = f"model: {{dtype: {args.dtype}}}\ncache: {{kv_memory_mb: 2048}}\n"
    server = ServerProcess(tmp, cfg, code_dir=code)
    try:
        server.wait_ready()
        model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
        asyncio.run(wave(server.url, model, args.requests, 16))  # warm-up, untimed
        mark = len(server.output())
        pids = subprocess.run(["pgrep", "-f", "steadfast.control.main"], capture_output=True, text=True).stdout.split()
        c0 = cpu_seconds(pids)
        res = asyncio.run(wave(server.url, model, args.requests, args.max_tokens))
        router_cpu = cpu_seconds(pids) - c0
        log = server.output()[mark:]
    finally:
        server.stop()
    sent = {m[1]: float(m[2]) for m in re.finditer(r"PROBE R (\S+) ([\d.]+)", log)}
    worker = {m[1]: (float(m[2]), float(m[3])) for m in re.finditer(r"PROBE W (\S+) ([\d.]+) ([\d.]+)", log)}
    start = min(t0 for _, t0, _ in res)
    stages: dict[str, list[float]] = {k: [] for k in ("client_router", "router_worker", "worker", "worker_client")}
    ttft = []
    for rid, t0, first in res:
        if rid in sent and rid in worker and first is not None:
            got, out = worker[rid]
            for k, v in zip(stages, (sent[rid] - t0, got - sent[rid], out - got, first - out), strict=True):
                stages[k].append(v)
            ttft.append(first - t0)
    drains = [round(1000 * (float(m[1]) - start)) for m in re.finditer(r"PROBE P ([\d.]+)", log)]
    firsts = sorted(round(1000 * (g - start)) for g, _ in worker.values())
    return {
        "requests": len(ttft),
        "ttft_p50_ms": round(1000 * statistics.median(ttft), 1),
        **{f"{k}_p50_ms": round(1000 * statistics.median(v), 1) for k, v in stages.items()},
        "worker_drains_ms": drains[:4],  # when the worker took in requests of the wave, from the first send
        "worker_got_ms_p10_p50_p90": [
            firsts[len(firsts) // 10],
            firsts[len(firsts) // 2],
            firsts[9 * len(firsts) // 10],
        ],
        "router_cpu_s": round(router_cpu, 2),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--code", action="append", required=True, help="NAME=DIR of a worktree to instrument and serve")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ttft_stages.json"))
    args = p.parse_args()
    codes = dict(spec.split("=", 1) for spec in args.code)
    for d in codes.values():
        instrument(Path(d))
    rounds = []
    for i in range(args.rounds):
        order = list(codes) if i % 2 == 0 else list(reversed(codes))
        r = {name: run(codes[name], args) for name in order}
        rounds.append(r)
        for name in codes:
            print(f"round {i + 1} {name}: {r[name]}", flush=True)
    Path(args.out).write_text(json.dumps({**run_info(args), "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
