"""Model runner: turns a scheduled step into the model's flat batch and returns logits to sample."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from steadfast.kv.arena.arena import KVArena
from steadfast.model import paged_attention
from steadfast.model.batch import AttentionBatch, DecodeGroup, PagedDecodes, PrefillChunk, VerifyGroup, kv_rows
from steadfast.model.llama import LlamaModel
from steadfast.worker.core.block_manager import BlockManager
from steadfast.worker.core.request import Request
from steadfast.worker.core.scheduler import ScheduledStep

# One more decode group costs about as much as this many padding blocks of one request (its extra ops
# per layer against the gathers and matmuls a padding block adds); measured on CPU, see BENCHMARKS.md.
GROUP_COST_BLOCKS = 64
MAX_DISTINCT = 32


@dataclass
class FlatBatch:
    """The step's tokens in model order, where each one's KV goes, and the rows sampled (for whom)."""

    block_size: int
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    samplers: list[Request] = field(default_factory=list)
    score_rows: list[int] = field(default_factory=list)  # prompt rows whose logits score the next prompt token
    scorers: list[tuple[Request, int]] = field(default_factory=list)  # (for whom, at which position)

    def add(
        self, token: int, pos: int, table: list[int], sampled_for: Request | None, prompt: Request | None = None
    ) -> None:
        """`prompt`: a prompt token's row, its logits kept where that request scores its prompt."""
        self.tokens.append(token)
        self.positions.append(pos)
        self.slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
        if sampled_for is not None:
            self.sample_rows.append(len(self.tokens) - 1)
            self.samplers.append(sampled_for)
        elif prompt is not None and prompt.scores(pos):
            self.score_rows.append(len(self.tokens) - 1)
            self.scorers.append((prompt, pos))


def _scorer(request: Request) -> Request | None:
    """The request as its prompt rows' scorer where it asks for prompt logprobs (a row's check then runs
    for it alone, not for every prefill token of every request)."""
    return request if request.params.prompt_logprobs >= 0 else None


def split_by_width(widths: list[int], max_groups: int, group_cost: int = GROUP_COST_BLOCKS) -> list[int]:
    """Cut rows sorted by width (blocks, longest first) into at most `max_groups` runs, each padded to
    its first row's width, minimising padded blocks + `group_cost` per run. Returns the run lengths.

    Exact, by dynamic programming over the distinct widths (few: contexts / block size), up to
    `MAX_DISTINCT` of them.
    """
    if not widths:
        return []
    # Beyond MAX_DISTINCT widths (long, varied contexts) the cost is judged on widths rounded up to a
    # common step: the cut stays between rows, and the search stays cheap on the step's hot path.
    step = max(1, -(-widths[0] // MAX_DISTINCT)) if len(set(widths)) > MAX_DISTINCT else 1
    distinct: list[list[int]] = []  # [width, rows]
    for w in (-(-w // step) * step for w in widths):
        if distinct and distinct[-1][0] == w:
            distinct[-1][1] += 1
        else:
            distinct.append([w, 1])
    m = len(distinct)
    # best[g][i]: cost of cutting the first i distinct widths into g runs; cut[g][i]: where the last run starts
    inf = float("inf")
    best = [[inf] * (m + 1) for _ in range(max_groups + 1)]
    cut = [[0] * (m + 1) for _ in range(max_groups + 1)]
    best[0][0] = 0
    for g in range(1, max_groups + 1):
        for i in range(1, m + 1):
            rows = 0
            for j in range(i - 1, -1, -1):  # last run = distinct[j:i], padded to distinct[j]'s width
                rows += distinct[j][1]
                cost = best[g - 1][j] + rows * distinct[j][0] + group_cost
                if cost < best[g][i]:
                    best[g][i], cut[g][i] = cost, j
    groups = min(range(1, max_groups + 1), key=lambda g: best[g][m])
    runs, i = [], m
    for g in range(groups, 0, -1):
        j = cut[g][i]
        runs.append(sum(rows for _, rows in distinct[j:i]))
        i = j
    return runs[::-1]


class ModelRunner:
    def __init__(self, model: LlamaModel, arena: KVArena, blocks: BlockManager, max_groups: int = 4) -> None:
        self.model = model
        self.max_groups = max_groups
        self.arena = arena
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.device = model.device
        self._strips = 2 * arena.spec.num_kv_heads  # K/V rows of one block in a layer
        # The in-place kernel is built for one block size: an arena of another takes the torch path.
        self.paged = model.paged is not None and arena.spec.block_size == paged_attention.BLOCK_SIZE

    def execute(
        self, step: ScheduledStep, on_layer: Callable[[int], None] | None = None
    ) -> tuple[torch.Tensor, list[Request], list[tuple[Request, int]]]:
        """Run the step; return logits `[rows, vocab]`, the request each row samples for (a verifying
        request has a row per draft and one more, consecutive), then the prompt rows that score a prompt's
        next token (their logits follow the sampled rows'). `on_layer(i)` is called once layer i's K/V of
        the whole batch is in the arena."""
        bs = self.block_size
        flat = FlatBatch(bs)

        # Longest context first, so that each decode group is a run of consecutive rows.
        decodes = sorted(step.decodes, key=lambda r: r.num_computed, reverse=True)
        tables = []
        for request in decodes:
            pos = request.num_computed
            table = self.blocks.block_table(request.request_id)
            flat.add(request.all_ids[pos], pos, table, request)
            tables.append(table[: pos // bs + 1])
        groups: list[DecodeGroup] | PagedDecodes = []
        verifies = None
        chunks: list[PrefillChunk] = []
        prefills = step.prefills
        if self.paged and self.model.deterministic:
            # Every row a decode row to the kernel, a prefill token attending up to its own position: a
            # token's attention is then the same whichever step, chunk or batch computes it.
            self._verify_rows(step.verifies, flat, tables)
            for request, n in step.prefills:
                table = self.blocks.block_table(request.request_id)
                scorer = _scorer(request)
                for pos in range(request.num_computed, request.num_computed + n):
                    sampled = request if pos == request.num_tokens - 1 else None
                    flat.add(request.all_ids[pos], pos, table, sampled, scorer)
                    tables.append(table[: pos // bs + 1])
            groups = self._paged(tables, flat.positions)
            prefills = []
        elif self.paged and (tables or step.verifies):
            # A verifying request's rows are decode rows to the kernel, each attending up to its own
            # position: attended as a plain decode is, whatever the number of drafts beside it.
            self._verify_rows(step.verifies, flat, tables)
            groups = self._paged(tables, flat.positions[: len(tables)])
        else:
            first = 0
            for count in split_by_width([len(t) for t in tables], self.max_groups):
                positions = flat.positions[first : first + count]
                groups.append(self._decode_group(tables[first : first + count], positions))
                first += count
            verifies = self._verifies(step.verifies, flat)

        for request, n in prefills:
            start, pos0 = len(flat.tokens), request.num_computed
            table = self.blocks.block_table(request.request_id)
            ids = request.all_ids
            context = pos0 + n
            scorer = _scorer(request)
            for pos in range(pos0, context):
                # The prompt fully computed: its last row yields a token.
                last = pos == context - 1 and context == request.num_tokens
                flat.add(ids[pos], pos, table, request if last else None, scorer)
            chunks.append(PrefillChunk(start, n, context, self._rows(table[: -(-context // bs)])))

        batch = AttentionBatch(slots=self._tensor(flat.slots), decodes=groups, prefills=chunks, verifies=verifies)
        logits = self.model.forward(
            self._tensor(flat.tokens),
            self._tensor(flat.positions),
            batch,
            self.arena,
            self._tensor(flat.sample_rows + flat.score_rows),
            on_layer,
        )
        return logits.cpu(), flat.samplers, flat.scorers  # (sampled on the CPU: seeded generators live there)

    def _verify_rows(
        self, verifies: list[tuple[Request, list[int]]], flat: FlatBatch, tables: list[list[int]] | None = None
    ) -> None:
        """Each verifying request's last token and drafts, appended to the flat batch, every row
        sampled (row i checks draft i; the last yields the token after all drafts), and each row's
        block table to `tables` if given (the kernel's rows)."""
        for request, drafts in verifies:
            pos0 = request.num_computed
            table = self.blocks.block_table(request.request_id)
            for j, token in enumerate([request.all_ids[pos0], *drafts]):
                flat.add(token, pos0 + j, table, request)
                if tables is not None:
                    tables.append(table[: (pos0 + j) // self.block_size + 1])

    def _verifies(self, verifies: list[tuple[Request, list[int]]], flat: FlatBatch) -> VerifyGroup | None:
        """The verifying requests' rows appended (`_verify_rows`), and the group that attends them all
        at once on the torch path."""
        if not verifies:
            return None
        bs = self.block_size
        first = len(flat.tokens)
        self._verify_rows(verifies, flat)
        width = 1 + max(len(d) for _, d in verifies)
        tables, queries, real, limits = [], [], [], []
        for i, (request, drafts) in enumerate(verifies):
            pos0, last = request.num_computed, len(drafts)
            real += [i * width + j for j in range(last + 1)]
            queries += [first + min(j, last) for j in range(width)]
            limits += [pos0 + min(j, last) for j in range(width)]  # the last position row j attends
            tables.append(self.blocks.block_table(request.request_id)[: (pos0 + last) // bs + 1])
            first += last + 1
        most = max(len(t) for t in tables)
        rows = self._rows([b for t in tables for b in (*t, *([0] * (most - len(t))))])
        cols = torch.arange(most * bs, device=self.device)
        mask = cols.view(1, -1) > self._tensor(limits).view(-1, 1)  # [reqs * width, ctx]
        return VerifyGroup(
            len(verifies),
            width,
            self._tensor(queries),
            self._tensor(real),
            rows,
            mask.view(1, len(verifies), 1, width, -1),
        )

    def _decode_group(self, tables: list[list[int]], positions: list[int]) -> DecodeGroup:
        width = len(tables[0])  # the longest: rows are sorted
        # Pad each table to the group's widest with block 0: its rows are masked out below.
        rows = self._rows([b for t in tables for b in (*t, *([0] * (width - len(t))))])
        lens = self._tensor([p + 1 for p in positions])
        pad = torch.arange(width * self.block_size, device=self.device).unsqueeze(0) >= lens.unsqueeze(1)
        return DecodeGroup(len(tables), rows, pad.view(1, len(tables), 1, -1))

    def _paged(self, tables: list[list[int]], positions: list[int]) -> PagedDecodes:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        return PagedDecodes(
            len(tables),
            torch.tensor(padded, dtype=torch.int32).to(self.device),
            torch.tensor([p + 1 for p in positions], dtype=torch.int32).to(self.device),
        )

    def _rows(self, block_ids: list[int]) -> torch.Tensor:
        return self._tensor(kv_rows(block_ids, self._strips, self.arena.spec.num_blocks))

    def _tensor(self, values: list[int]) -> torch.Tensor:
        # Built on the CPU, copied once: one small host-to-device transfer per index list.
        return torch.tensor(values, dtype=torch.long).to(self.device, non_blocking=True)
