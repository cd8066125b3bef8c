"""Steadfast against the servers a user would pick instead, one after another on this machine, through the
same load generator (`steadfast/ops/harness/loadgen.py`): closed loop, short chat prompts, `--max-tokens` output
tokens (EOS ignored), temperature 0, at each concurrency level; `--rounds` rounds, the order of the
servers reversed each round (these machines drift: compare within a round, as ratios).

Servers, each where given (`../shared/design/PEERS.md` says how to build or install them):
- Steadfast as `make serve` ships it (no config: bf16, ledger, standby, admission control), the same
  with settings of its own (`--variant NAME=YAML`), and any other checkout of it (`--steadfast
  NAME=DIR`, e.g. a worktree of an earlier commit: "no regression against ...");
- llama.cpp's `llama-server` (`--llama-server PATH`), on the GGUF itself, two threads, restarted at each
  level with `--parallel` = the level (its slots keep state between runs);
- vLLM's CPU build (`--vllm-python PATH` of its venv, `--vllm-model DIR`: a Hugging Face-style copy of the
  model, made from the GGUF with `--make-vllm-model DIR`), bf16.

    python benchmarks/bench_peers.py --concurrency 1 8 32 --rounds 2 \\
        --variant "ladder off=degradation: {enabled: false}" \\
        --steadfast base=/tmp/wt-132b2ce --llama-server PATH/llama-server \\
        --vllm-python PATH/bin/python --vllm-model /tmp/smollm2-hf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_serving import load as serving_load  # noqa: E402
from benchmarks.common import run_info  # noqa: E402
from steadfast.config import default_model_path  # noqa: E402
from tests.integration.server import ServerProcess, free_port  # noqa: E402


@dataclass
class Peer:
    """A server to measure: `start(level)` gives its URL for that level (None: one start serves all)."""

    name: str
    command: list[str] = field(default_factory=list)  # a non-Steadfast server's ({port}, {level}, {ctx})
    env: dict[str, str] = field(default_factory=dict)
    code_dir: str = ""  # Steadfast: the checkout to serve ("" this one)
    config: str = "{}\n"  # Steadfast: its settings (none: the shipped defaults)
    per_level: bool = False
    ready_s: float = 600.0

    @property
    def steadfast(self) -> bool:
        return not self.command

    @contextmanager
    def serving(self, level: int) -> Iterator[str]:
        if self.steadfast:
            tmp = Path(tempfile.mkdtemp(prefix=f"peers-{self.name}-"))
            server = ServerProcess(tmp, self.config, code_dir=self.code_dir)
            try:
                server.wait_ready(self.ready_s)
                yield server.url
            finally:
                server.stop()
            return
        port = free_port()
        argv = [a.format(port=port, level=level, ctx=1024 * level) for a in self.command]
        log = tempfile.NamedTemporaryFile(prefix=f"peers-{self.name}-", suffix=".log", delete=False)  # noqa: SIM115
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=os.environ | self.env, start_new_session=True
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + self.ready_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited early; its log: {log.name}")
                try:
                    if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} not ready in {self.ready_s:.0f}s; its log: {log.name}")
                time.sleep(1)
            yield url
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()


async def load(url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    """`bench_serving`'s closed loop, patient with refusals for load (Steadfast's admission control may
    refuse at first; the peers queue everything)."""
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    return await serving_load(url, model, concurrency, requests, max_tokens, retry_refused=True)


def measure(peer: Peer, args: argparse.Namespace) -> dict[int, dict]:
    out: dict[int, dict] = {}

    def level(url: str, c: int) -> None:
        asyncio.run(load(url, c, c, 16))  # warm-up at this concurrency, untimed
        out[c] = asyncio.run(load(url, c, max(args.min_requests, args.waves * c), args.max_tokens))
        print(f"{peer.name} c={c}: {out[c]}", flush=True)

    if peer.per_level:
        for c in args.concurrency:
            with peer.serving(c) as url:
                level(url, c)
    else:
        with peer.serving(max(args.concurrency)) as url:
            for c in args.concurrency:
                level(url, c)
    return out


def make_vllm_model(target: str) -> None:
    """The default GGUF as a Hugging Face checkpoint (vLLM's GGUF loading is CUDA-only): loaded by
    `transformers`, its weights copied into a model built from the config (a GGUF-loaded model cannot be
    saved as it is), saved with the tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(default_model_path())
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(target)
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(target)
    print(f"wrote {target}")


def peers(args: argparse.Namespace) -> list[Peer]:
    found = [Peer("steadfast")]
    for spec in args.variant:
        name, _, yaml = spec.partition("=")
        found.append(Peer(f"steadfast [{name}]", config=yaml + "\n"))
    for spec in args.steadfast:
        name, _, folder = spec.partition("=")
        found.append(Peer(f"steadfast [{name}]", code_dir=str(Path(folder).resolve())))
    if args.llama_server:
        threads = str(args.threads)
        command = [args.llama_server, "-m", default_model_path(), "--port", "{port}", "--threads", threads]
        # Each slot gets the context divided by the slots: 1024 tokens a slot hold a short prompt and its answer.
        command += ["--parallel", "{level}", "--ctx-size", "{ctx}"]
        found.append(Peer("llama-server", command, per_level=True))
    if args.vllm_python and args.vllm_model:
        command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", args.vllm_model]
        command += ["--tokenizer", args.vllm_model, "--dtype", "bfloat16", "--max-model-len", "2048"]
        command += ["--max-num-seqs", "64", "--port", "{port}"]
        cpus = f"0-{args.threads - 1}"
        env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": cpus}
        found.append(Peer("vllm", command, env))
    return found


def table(rounds: list[dict[str, dict[int, dict]]], levels: list[int]) -> str:
    names = list(rounds[0])
    head = "| server | " + " | ".join(f"c = {c} out tok/s" for c in levels) + f" | TTFT p99 at c = {levels[-1]} |"
    lines = [head, "|---" * (len(levels) + 2) + "|"]
    for name in names:
        cells = [" / ".join(f"{r[name][c]['out_tok_s']:.0f}" for r in rounds) for c in levels]
        ttft = " / ".join(f"{r[name][levels[-1]]['ttft_p99_ms']:.0f} ms" for r in rounds)
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {ttft} |")
    ours = "steadfast"
    for other in names[1:]:
        ratios = [
            " / ".join(f"{r[ours][c]['out_tok_s'] / r[other][c]['out_tok_s']:.2f}x" for r in rounds) for c in levels
        ]
        lines.append(f"| steadfast ÷ {other} | " + " | ".join(ratios) + " | |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--waves", type=int, default=2, help="requests per level = waves x concurrency")
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="the peers' CPU threads (Steadfast sizes its own)")
    p.add_argument("--steadfast", action="append", default=[], metavar="NAME=DIR", help="another checkout")
    p.add_argument(
        "--variant", action="append", default=[], metavar="NAME=YAML", help="this checkout with these settings"
    )
    p.add_argument("--llama-server", default="", metavar="PATH")
    p.add_argument("--vllm-python", default="", metavar="PATH")
    p.add_argument("--vllm-model", default="", metavar="DIR")
    p.add_argument("--make-vllm-model", default="", metavar="DIR", help="write the HF copy of the model, exit")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "peers.json"))
    args = p.parse_args()
    if args.make_vllm_model:
        make_vllm_model(args.make_vllm_model)
        return
    servers = peers(args)
    rounds: list[dict[str, dict[int, dict]]] = []
    for r in range(args.rounds):
        order = servers if r % 2 == 0 else servers[::-1]
        rounds.append({s.name: measure(s, args) for s in order})
        rounds[-1] = {s.name: rounds[-1][s.name] for s in servers}  # the table's order
    print(table(rounds, args.concurrency))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"run": run_info(args), "rounds": rounds}, indent=1))


if __name__ == "__main__":
    main()
