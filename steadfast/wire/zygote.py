"""Supervisor <-> worker zygote: one socket pair, one message per packet; msgspec, never pickled."""

from __future__ import annotations

import msgspec


class ZygoteReady(msgspec.Struct, tag="zready", array_like=True):
    """From the zygote, once: the model is built and it forks workers from now on."""

    seconds: float  # its own start to ready (imports, model)


class ForkWorker(msgspec.Struct, tag="fork", array_like=True):
    """To the zygote: fork a worker that runs `steadfast.worker.main` with these arguments."""

    argv: list[str]


class WorkerForked(msgspec.Struct, tag="forked", array_like=True, omit_defaults=True):
    """From the zygote: the forked worker's pid (a child of the supervisor now), or why there is none."""

    pid: int = 0
    error: str = ""


_to_zygote = msgspec.msgpack.Decoder(ForkWorker)
_from_zygote = msgspec.msgpack.Decoder(ZygoteReady | WorkerForked)


def decode_to_zygote(data: bytes) -> ForkWorker:
    return _to_zygote.decode(data)


def decode_from_zygote(data: bytes) -> ZygoteReady | WorkerForked:
    return _from_zygote.decode(data)
