"""What the benchmarks share: the run's description, percentiles, prompts of an exact token length, a
streaming client that timestamps every token it receives."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

import httpx
import torch

from steadfast.model.tokenizer import GGUFTokenizer

TEXT = (
    "The history of the lighthouse is a history of light, glass, oil and patience. Keepers trimmed wicks, "
    "wound clockwork and logged the weather through long nights, while ships passed safely in the dark. "
)


def run_info(args: argparse.Namespace) -> dict:
    """What a result file says about its run: the exact command, when, where, and the arguments."""
    return {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "torch": torch.__version__,
        "args": vars(args),
    }


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] if s else float("nan")


def prompt_of(tokenizer: GGUFTokenizer, n: int, tag: str = "") -> list[int]:
    """`n` token ids of text; a distinct `tag` makes the first block (and so every block) distinct,
    so that no prefix-cache hit shortens the prompt."""
    ids = tokenizer.encode(f"{tag} " * bool(tag) + TEXT * (1 + n // 30))
    return ids[:n]


def wait_until(predicate, timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError("condition not met")


class Stream(threading.Thread):
    """One streamed completion of a token-id prompt; `arrivals` holds each token's arrival time and
    `request_id` the chunks' id (what the admin routes take). `stop` set: the stream is closed at its next
    chunk (the server aborts the request)."""

    def __init__(self, url: str, model: str, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.prompt, self.max_tokens = url, model, prompt, max_tokens
        self.started = 0.0
        self.arrivals: list[float] = []  # one per token received
        self.error: str | None = None
        self.request_id = ""
        self.stop = threading.Event()

    def run(self) -> None:
        body = {
            "model": self.model,
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        }
        self.started = time.perf_counter()
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=600) as r:
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            self.error = chunk["error"]["message"]
                            return
                        now = time.perf_counter()
                        self.request_id = chunk.get("id", self.request_id)
                        for choice in chunk["choices"]:
                            self.arrivals.extend(now for _ in choice.get("token_ids", []))
        except Exception as exc:  # noqa: BLE001 - recorded as this stream's result
            self.error = repr(exc)
