"""Llama forward pass in plain PyTorch over the paged KV arena.

One call runs a flat batch of tokens from many requests: decode tokens first (one per request,
attended in a few batched matmuls, by groups of similar context length), then prefill chunks (each
attended on its own, causal over its past).
Linear layers see the flat `[tokens, hidden]` batch, so no padding is computed outside attention.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from steadfast.kv.arena.arena import KVArena
from steadfast.model.batch import AttentionBatch, PagedDecodes, VerifyGroup
from steadfast.model.decode_layers import DecodeLayers, DecodePlan, LayerWeights
from steadfast.model.gguf_meta import LlamaConfig
from steadfast.model.layers import Linear, LMHead, NativeWeights
from steadfast.model.paged_attention import PagedAttention
from steadfast.model.quant_matmul import QuantMatmul, QuantWeight
from steadfast.model.rms_norm import AddRMSNorm
from steadfast.model.rope_kv import RopeKV
from steadfast.model.rowwise_matmul import RowwiseMatmul


class LlamaModel:
    def __init__(
        self,
        cfg: LlamaConfig,
        layout: dict[str, torch.Tensor],
        dtype: torch.dtype,
        max_positions: int,
        paged: PagedAttention | None = None,
        rowwise: RowwiseMatmul | None = None,
        native: NativeWeights | None = None,
        norm: AddRMSNorm | None = None,
        rope_kv: RopeKV | None = None,
        decode: DecodeLayers | None = None,
    ):
        """`layout`: `compute_layout`'s tensors (used as they are: never written); `native`: the GGUF's
        quantized weights for small calls, where they are used; `decode`: the SwiGLU kernel, and the
        decode step's layers in one call where every other kernel is in use."""

        def linear(name: str) -> Linear:
            return Linear(layout[name], rowwise, self._native(native, name))

        self.cfg = cfg
        self.paged = paged  # decode attention in place (the runner then builds PagedDecodes)
        self.norm = norm  # the residual add and RMSNorm of bf16 rows in one kernel call
        self.rope_kv = rope_kv  # RoPE and the K/V store in one kernel call
        self.dtype = dtype
        self.device = layout["embed"].device
        self.embed = layout["embed"]
        self.lm_head = LMHead(layout["lm_head.t"], layout["embed"], rowwise, self._native(native, "lm_head.t"))
        self.final_norm = layout["final_norm"]
        self.layers = [
            (
                layout[f"{i}.attn_norm"],
                linear(f"{i}.qkv.t"),
                linear(f"{i}.o.t"),
                layout[f"{i}.ffn_norm"],
                linear(f"{i}.gate_up.t"),
                linear(f"{i}.down.t"),
            )
            for i in range(cfg.num_layers)
        ]
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(self.device, dtype)  # [positions, head_dim]
        self.sin = emb.sin().to(self.device, dtype)
        self._scratch = torch.empty(0, dtype=dtype, device=self.device)
        self.decode = decode if decode is not None and decode.handles(cfg, cfg.intermediate_size) else None
        self.step = self._plan(native)
        self.deterministic = False  # set by the loader once `invariance_gaps` finds none (the runner reads it)

    def _plan(self, native: NativeWeights | None) -> tuple[DecodePlan, int] | None:
        """The decode step in one call, and the most rows it takes (`native`'s): where the fused norm,
        the RoPE/K-V and paged attention kernels are all in use and every projection is quantized and
        packed (the integer path: CPUs with AVX512-VNNI)."""
        if self.decode is None or native is None or None in (self.norm, self.rope_kv, self.paged):
            return None
        layers = []
        for attn_norm, w_qkv, w_o, ffn_norm, w_gate_up, w_down in self.layers:
            projections = [w.native[0] for w in (w_qkv, w_o, w_gate_up, w_down) if w.native is not None]
            if len(projections) < 4 or any(p.panels is None for p in projections):  # not packed: no VNNI
                return None
            layers.append(LayerWeights(attn_norm, ffn_norm, *projections))
        return self.decode.plan(self.cfg, layers, self.cos, self.sin), native.max_rows

    def invariance_gaps(self) -> list[str]:
        """What would make a row's result depend on the rows computed with it (empty: nothing; the
        runner then attends every row in place, prefill rows too: `model.deterministic`)."""
        gaps = [] if self.paged is not None else ["decode attention is not the in-place kernel"]
        if self.dtype == torch.bfloat16 and self.norm is None:
            gaps.append("the bf16 RMSNorm is not the row-wise kernel")
        linears = {"lm_head": self.lm_head.linear} | {
            f"layer {i} {name}": w
            for i, layer in enumerate(self.layers)
            for name, w in zip(("qkv", "o", "gate_up", "down"), (layer[1], layer[2], layer[4], layer[5]), strict=True)
        }
        for name, w in linears.items():
            if w.rowwise is None and (w.native is None or w.native[2] < sys.maxsize):
                gaps.append(f"{name} is computed by BLAS/oneDNN, whose results depend on the batch")
        if self.lm_head.rows_first is not None:
            gaps.append("the LM head computes several rows another way than one")
        return gaps

    def _decodes_only(self, n: int, batch: AttentionBatch, on_layer: Callable[[int], None] | None) -> bool:
        """Whether this step can take the one-call path: every row a decode, nobody watching layers."""
        d = batch.decodes
        return (
            self.step is not None
            and on_layer is None
            and isinstance(d, PagedDecodes)
            and d.count == n
            and n <= self.step[1]
            and not batch.prefills
            and batch.verifies is None
        )

    @staticmethod
    def _native(native: NativeWeights | None, name: str) -> tuple[QuantWeight, QuantMatmul, int] | None:
        weight = native.weights.get(name) if native is not None else None
        return (weight, native.matmul, native.max_rows) if native is not None and weight is not None else None

    def _verify_attention(self, q: torch.Tensor, kv_cache: torch.Tensor, g: VerifyGroup) -> torch.Tensor:
        """The verifying requests' rows, `[rows, heads * dim]` in flat-batch order."""
        cfg = self.cfg
        _, kv_heads, _, _, dim = kv_cache.shape
        group, n, w = cfg.group_size, g.count, g.width
        kv = self._gather(kv_cache, g.rows).view(2, kv_heads, n, -1, dim)
        k, v = kv[0], kv[1]  # [kv_heads, reqs, ctx, dim]
        qv = (q[g.queries] * dim**-0.5).view(n, w, kv_heads, group, dim)
        qv = qv.permute(2, 0, 3, 1, 4).reshape(kv_heads, n, group * w, dim)
        scores = torch.matmul(qv, k.transpose(-1, -2)).view(kv_heads, n, group, w, -1)
        scores.masked_fill_(g.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype).view(kv_heads, n, group * w, -1)
        out = torch.matmul(probs, v).view(kv_heads, n, group, w, dim)  # [kv_heads, reqs, group, rows, dim]
        out = out.permute(1, 3, 0, 2, 4).reshape(n * w, cfg.num_heads * dim)
        return out[g.real]

    def _gather(self, kv_cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The K/V rows `rows` (see `kv_rows`) of one layer: `[len(rows), block_size * dim]`, that is
        `[2 * kv_heads, blocks, block_size * dim]` flattened.

        Into one reused buffer (each layer's attention is done with it before the next gathers): a
        fresh multi-MB tensor per layer costs the CPU page faults on every touch, 3x the copy itself.
        """
        flat = kv_cache.view(-1, kv_cache.shape[-2] * kv_cache.shape[-1])
        need = rows.numel() * flat.shape[1]
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=flat.dtype, device=flat.device)
        out = self._scratch[:need].view(rows.numel(), flat.shape[1])
        return torch.index_select(flat, 0, rows, out=out)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, fused: bool) -> torch.Tensor:
        """`x += delta` in place (the residual add), then x normalised and scaled by `weight`; `fused`:
        the kernel handles x (asked once a step: the residual stream keeps its dtype and width)."""
        if fused:
            assert self.norm is not None
            return self.norm(x, delta, weight, self.cfg.rms_norm_eps)
        if delta is not None:
            x.add_(delta)
        return self._rms_norm(x, weight)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Normalised in fp32, scaled in the model dtype: the same rounding points as the reference.
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.cfg.rms_norm_eps)
        return weight * h.to(self.dtype)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        if self.decode is not None and gate_up.dtype == torch.bfloat16 and gate_up.device.type == "cpu":
            return self.decode.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [tokens, heads, head_dim]; cos/sin: [tokens, 1, head_dim]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        arena: KVArena,
        sample_rows: torch.Tensor,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run the flat batch; return fp32 logits `[len(sample_rows), vocab]` for the rows to sample.
        `on_layer(i)`, if given, runs as soon as layer i's K/V is written (to stream it elsewhere)."""
        x = self.embed[input_ids]  # x: [tokens, hidden], a copy: the residual stream, added to in place
        fused = self.norm is not None and self.norm.handles(x)
        if fused and self._decodes_only(x.shape[0], batch, on_layer):
            assert self.step is not None and isinstance(batch.decodes, PagedDecodes)
            d = batch.decodes
            delta = self.step[0].run(x, positions, batch.slots, d.tables, d.lens, arena.tensor)
        else:
            delta = self._layers(x, positions, batch, arena, on_layer, fused)
        last = None if delta is None else delta[sample_rows]
        return self.lm_head(self._add_norm(x[sample_rows], last, self.final_norm, fused)).float()

    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        batch: AttentionBatch,
        arena: KVArena,
        on_layer: Callable[[int], None] | None,
        fused: bool,
    ) -> torch.Tensor | None:
        """Every layer, one op at a time, on the residual stream x (updated in place); returns what the
        last layer adds to x (the final norm adds it), None for a model of no layers."""
        cfg = self.cfg
        n = x.shape[0]
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        if self.rope_kv is None:
            cos = self.cos[positions].unsqueeze(1)
            sin = self.sin[positions].unsqueeze(1)
        delta = None  # what the last layer adds to x (added by the next norm)
        for index, (attn_norm, w_qkv, w_o, ffn_norm, w_gate_up, w_down) in enumerate(self.layers):
            h = self._add_norm(x, delta, attn_norm, fused)
            qkv = w_qkv(h)
            kv_cache = arena.layer_kv(index)  # [2, kv_heads, blocks, block_size, dim]
            v = qkv[:, q_size + kv_size :].view(n, cfg.num_kv_heads, cfg.head_dim)
            if self.rope_kv is not None:  # RoPE in place and the K/V store, one kernel call
                self.rope_kv(qkv, self.cos, self.sin, positions, kv_cache, batch.slots, cfg.num_heads, cfg.num_kv_heads)
                q = qkv[:, :q_size].view(n, cfg.num_heads, cfg.head_dim)
                k = qkv[:, q_size : q_size + kv_size].view(n, cfg.num_kv_heads, cfg.head_dim)
            else:
                # Q and K heads side by side get RoPE in one pass: [tokens, heads + kv_heads, dim]
                qk = self._rope(
                    qkv[:, : q_size + kv_size].view(n, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim), cos, sin
                )
                q, k = qk[:, : cfg.num_heads], qk[:, cfg.num_heads :]
                k_cache, v_cache = kv_cache[0], kv_cache[1]
                heads, blocks, block_size, dim = k_cache.shape
                k_cache.view(heads, blocks * block_size, dim).index_copy_(1, batch.slots, k.transpose(0, 1))
                v_cache.view(heads, blocks * block_size, dim).index_copy_(1, batch.slots, v.transpose(0, 1))
            if on_layer is not None:
                on_layer(index)
            attn = self._attention(q, k, v, kv_cache, batch)
            h = self._add_norm(x, w_o(attn), ffn_norm, fused)
            delta = w_down(self._swiglu(w_gate_up(h)))
        return delta

    def _attention(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        kv_cache: torch.Tensor,
        batch: AttentionBatch,
    ) -> torch.Tensor:
        # q: [tokens, heads, dim]; k_new/v_new: [tokens, kv_heads, dim]
        # kv_cache: [2, kv_heads, blocks, block_size, dim]
        cfg = self.cfg
        _, kv_heads, blocks, block_size, dim = kv_cache.shape
        group = cfg.group_size
        parts = []
        start = 0
        if isinstance(batch.decodes, PagedDecodes):
            assert self.paged is not None
            start = batch.decodes.count
            out = torch.empty(start, cfg.num_heads * dim, dtype=q.dtype, device=q.device)
            self.paged(q[:start], kv_cache, batch.decodes.tables, batch.decodes.lens, out)
            parts.append(out)
        for g in batch.decodes if isinstance(batch.decodes, list) else ():
            nd = g.count
            # K and V of every request in one gather: [2, kv_heads, reqs, ctx, dim]
            kv = self._gather(kv_cache, g.rows).view(2, kv_heads, nd, -1, dim)
            k, v = kv[0], kv[1]
            qd = (q[start : start + nd] * dim**-0.5).view(nd, kv_heads, group, dim).transpose(0, 1)
            scores = torch.matmul(qd, k.transpose(-1, -2))  # [kv_heads, reqs, group, ctx]
            scores.masked_fill_(g.pad, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            out = torch.matmul(probs, v)  # [kv_heads, reqs, group, dim]
            parts.append(out.transpose(0, 1).reshape(nd, cfg.num_heads * dim))
            start += nd
        if batch.verifies is not None:
            parts.append(self._verify_attention(q, kv_cache, batch.verifies))
        for chunk in batch.prefills:
            span = slice(chunk.start, chunk.start + chunk.length)
            qc = q[span].transpose(0, 1).unsqueeze(0)  # [1, heads, new, dim]
            past = chunk.context_len - chunk.length
            if past == 0:
                # Nothing cached before this chunk: attend to its own fresh K/V, no gather.
                k = k_new[span].transpose(0, 1).unsqueeze(0)
                v = v_new[span].transpose(0, 1).unsqueeze(0)
                out = F.scaled_dot_product_attention(qc, k, v, is_causal=True, enable_gqa=True)
            else:
                n = chunk.context_len
                kv = self._gather(kv_cache, chunk.rows).view(2, 1, kv_heads, -1, dim)[:, :, :, :n]
                k, v = kv[0], kv[1]
                rows = torch.arange(chunk.length, device=q.device).unsqueeze(1) + past
                mask = torch.arange(n, device=q.device).unsqueeze(0) <= rows  # [new, ctx]
                out = F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, enable_gqa=True)
            parts.append(out[0].transpose(0, 1).reshape(chunk.length, cfg.num_heads * dim))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
