"""A node's worker zygote: a process that has imported torch and the worker's code and built the served
model once (mapped from the node's weight store, oneDNN's packed bf16 copy included), then forks every
new worker from that state on the supervisor's word. A forked worker is serving after its own small
state (KV arena, sockets, a warm-up): a fraction of a second, where a fresh interpreter spends seconds
importing torch and building the model. Its model pages stay shared with the zygote copy-on-write.

Each worker is forked twice (zygote → short-lived middle → worker; the middle exits at once), so the
worker is re-parented to the supervisor, a child subreaper: the supervisor reaps it and reads its exit
code like any child's, its parent-death signal is tied to the supervisor, and the zygote's own death
touches no worker.

libgomp cannot fork a process that has run an OpenMP parallel region (the child hangs in its next
one), so the zygote computes on one thread only; each worker sets its own thread count.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import json
import logging
import os
import socket
import struct
import sys
import threading
import time

import torch

from steadfast.config import Config, config_from_dict
from steadfast.util.log import setup_logging
from steadfast.util.proc import die_with_parent
from steadfast.wire.codec import encode
from steadfast.wire.zygote import WorkerForked, ZygoteReady, decode_to_zygote
from steadfast.worker import main as worker_main
from steadfast.worker.core.step_cost import StepCost
from steadfast.worker.engine import Engine
from steadfast.worker.loaded import LoadedModel, load_model, private_arena
from steadfast.worker.startup import since_process_start, trim_heap

log = logging.getLogger("steadfast.zygote")

MAX_PACKET = 1 << 20  # a fork request is a worker's command line: a few KiB (the config is the bulk)
_PR_SET_NAME = 15


def _name_process(name: str) -> None:
    """The worker's name in `ps` / /proc/PID/comm (its command line stays the zygote's)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except OSError:
        pass


def _arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1] if flag in argv[:-1] else ""


def _worker_id(argv: list[str]) -> str:
    return _arg(argv, "--worker-id") or "?"


def _run_worker(argv: list[str], loaded: LoadedModel | None, control: socket.socket, middle: int) -> None:
    """In the forked worker: detach from the zygote's socket and group, wait to be the supervisor's
    child, run the worker; never return into the zygote's loop."""
    code = 1
    try:
        control.close()
        os.setpgid(0, 0)  # a group of its own, as the supervisor gives every child it starts
        while os.getppid() == middle:  # the middle exits at once; then the supervisor is the parent
            time.sleep(0.0005)
        _name_process(f"sf-worker{_worker_id(argv)}")
        sys.argv = ["steadfast.worker.main", *argv]
        worker_main.main(argv, loaded)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - whatever it was, this process must end here
        log.exception("forked worker failed")
    finally:
        logging.shutdown()
        os._exit(code)


def fork_worker(argv: list[str], loaded: LoadedModel | None, control: socket.socket) -> int:
    """Fork a worker through a middle process that exits at once; return the worker's pid."""
    read_end, write_end = os.pipe()
    middle = os.fork()
    if middle == 0:
        try:
            os.close(read_end)
            me = os.getpid()  # (not the worker's getppid(): once this process is gone, that is the supervisor)
            worker = os.fork()
            if worker == 0:
                os.close(write_end)
                _run_worker(argv, loaded, control, me)
            os.write(write_end, struct.pack("q", worker))
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        data = os.read(read_end, 8)
    finally:
        os.close(read_end)
        os.waitpid(middle, 0)
    if len(data) != 8:
        raise OSError("the forked worker's middle process exited without its pid")
    return struct.unpack("q", data)[0]


def serve(control: socket.socket, loaded: LoadedModel | None, cfg_json: str, weights_dir: str) -> None:
    """Answer fork requests until the supervisor closes its end. A worker of another configuration or
    weight store than the zygote's is forked without the model (it builds its own)."""
    while True:
        data = control.recv(MAX_PACKET)
        if not data:
            return
        try:
            ask = decode_to_zygote(data)
            same = _arg(ask.argv, "--config-json") == cfg_json and _arg(ask.argv, "--weights-dir") == weights_dir
            pid = fork_worker(ask.argv, loaded if same else None, control)
            log.info("forked worker %s as pid %d", _worker_id(ask.argv), pid)
            reply = WorkerForked(pid=pid)
        except Exception as exc:  # noqa: BLE001 - a malformed request or a failed fork: say so, go on
            log.warning("could not fork a worker: %s", exc)
            reply = WorkerForked(error=str(exc)[:500])
        control.send(encode(reply))


def warm_up(cfg: Config, loaded: LoadedModel, folder: str) -> StepCost:
    """A warm-up on an arena of its own (a few blocks, removed after): the kernels chosen, the caches
    made once here and inherited by every fork. On one thread (no parallel region before a fork); the
    arena's background thread is waited for (no thread may be mid-call when the process forks).
    Returns what its steps cost: on one thread it errs long, so a fork's first prefill chunks beside
    decodes err short, until its own steps correct it."""
    small = cfg.replace(cache={"num_blocks": 64, "kv_memory_mb": 0})
    arena = private_arena(small, loaded.model_cfg, os.path.join(folder, f"zygote-{os.getpid()}.kv"))
    try:
        engine = Engine(small, loaded, arena)
        worker_main.warm_up(engine)
    finally:
        arena.unlink()
    for thread in threading.enumerate():
        if thread is not threading.main_thread():
            thread.join(timeout=10)
    return engine.scheduler.cost


def main() -> None:
    parser = argparse.ArgumentParser(description="Steadfast worker zygote")
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--weights-dir", required=True, help="folder of the node's weight store")
    parser.add_argument("--control-fd", type=int, required=True, help="the supervisor's socket (SOCK_SEQPACKET)")
    args = parser.parse_args()
    die_with_parent()
    setup_logging("zygote")
    control = socket.socket(fileno=args.control_fd)
    cfg = config_from_dict(json.loads(args.config_json))
    torch.set_num_threads(1)  # see the module's note: no parallel region before a fork
    # On a GPU the model's device copy cannot be inherited (CUDA does not survive a fork): there the
    # zygote saves each worker its imports only.
    loaded = load_model(cfg, args.weights_dir) if cfg.model.resolved_device == "cpu" else None
    if loaded is not None:
        loaded = dataclasses.replace(loaded, step_cost=warm_up(cfg, loaded, args.weights_dir))
    gc.collect()
    trim_heap()
    gc.freeze()  # what is built now is never collected: the collector would dirty its shared pages
    seconds = since_process_start()
    log.info("ready in %.1fs: forks workers %s", seconds, "with the model built" if loaded else "after imports")
    try:
        control.send(encode(ZygoteReady(seconds)))
    except OSError:  # its socket closed while it loaded: a rollout started a newer zygote
        log.info("the supervisor no longer listens (another zygote replaced this one); exiting")
        return
    serve(control, loaded, args.config_json, args.weights_dir)


if __name__ == "__main__":
    main()
