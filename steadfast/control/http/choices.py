"""A request's `n` choices: each its own engine request (`<id>-<i>`, choice 0 keeping the request's id), so
a takeover, a migration or a resume moves each one as it moves any request; the prompt's KV is shared
through the prefix cache (choice 0 runs its prefill first, the others start once it has; each of them
computes at most the prompt's last partial block); choice i is sampled with seed + i, so it is
reproducible alone as a request of that seed. Their outputs are merged into one stream, each tagged
with its choice. No HTTP framing here (streams.py)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

import msgspec

from steadfast.control.http.serving import Generation, Prepared
from steadfast.wire.worker import AddRequest, RequestOutput

_SEED_MASK = (1 << 63) - 1


def choice_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}-{index}"


def fan_out(prepared: Prepared, n: int, base: str = "", first: int = 0) -> list[Prepared]:
    """The `n` choices of an admitted prompt (n = 1: itself), numbered from `first` among the request's
    choices (a list of prompts: prompt p's are p * n on), ids made from `base` (the request's id; by
    default `prepared`'s)."""
    choices = [prepared]
    params = prepared.add.params
    base = base or prepared.request_id
    for i in range(1, n):
        add = AddRequest(
            choice_id(base, first + i),
            prepared.add.prompt_ids,
            # (the prompt's logprobs: its first choice's, the same for all)
            msgspec.structs.replace(params, seed=(params.seed + i) & _SEED_MASK, prompt_logprobs=-1),
            prepared.add.priority,
        )
        choices.append(dataclasses.replace(prepared, request_id=add.request_id, add=add, choice=first + i))
    return choices


async def merged(
    gens: Sequence[Generation], quiet_s: float | None, shared_prefill: bool = True
) -> AsyncIterator[tuple[int, RequestOutput] | None]:
    """The outputs of every generation as they come, each with its position in `gens`; a None each time
    `quiet_s` passes with none. With `shared_prefill`, a choice starts once the first choice of its
    prompt has its first output (the prompt then in the prefix cache). Leaving the iteration stops every
    generation."""
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()
    leaders: dict[int, int] = {}  # (a prompt's choices share its list of ids: fan_out)
    leader = [leaders.setdefault(id(g.p.add.prompt_ids), i) for i, g in enumerate(gens)]
    first_out = [asyncio.Event() for _ in gens]

    async def run(i: int, gen: Generation) -> None:
        started = first_out[i]
        try:
            if leader[i] != i and shared_prefill:
                await first_out[leader[i]].wait()
            async for out in gen.outputs():
                if out is not None:
                    started.set()
                    queue.put_nowait((i, out))
        except BaseException as exc:  # (its consumer raises it: one choice's failure is the request's)
            started.set()
            queue.put_nowait((i, exc))
            if isinstance(exc, asyncio.CancelledError):
                raise
        else:
            started.set()
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(run(i, g)) for i, g in enumerate(gens)]
    running = len(tasks)
    try:
        while running:
            try:
                i, item = await asyncio.wait_for(queue.get(), quiet_s) if quiet_s else await queue.get()
            except TimeoutError:
                yield None
                continue
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
