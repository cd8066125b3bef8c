"""Llama forward pass in plain PyTorch over the paged KV arena.

One call runs a flat batch of tokens from many requests: decode tokens first (one per request,
attended in one batched SDPA), then prefill chunks (each attended on its own, causal over its past).
Linear layers see the flat `[tokens, hidden]` batch, so no padding is computed outside attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from steadfast.kv.arena import KVArena
from steadfast.model.gguf_loader import LlamaConfig


@dataclass
class PrefillChunk:
    start: int  # index of its first token in the flat batch
    length: int  # new tokens in this chunk
    context_len: int  # past + new tokens
    block_table: torch.Tensor  # [blocks covering context_len]


@dataclass
class AttentionBatch:
    """Where each new token's KV goes and what each token attends to."""

    slot_blocks: torch.Tensor  # [tokens] arena block of each new token
    slot_offsets: torch.Tensor  # [tokens] row inside that block
    num_decode: int  # the first num_decode tokens are decodes, one per request
    decode_block_tables: torch.Tensor | None  # [num_decode, max_blocks]
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, max_blocks * block_size] True = attend
    prefills: list[PrefillChunk]


class LlamaModel:
    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype, max_positions: int):
        self.cfg = cfg
        self.dtype = dtype
        self.embed = weights["token_embd.weight"]
        self.lm_head = weights.get("output.weight", self.embed)  # tied embeddings when absent
        self.final_norm = weights["output_norm.weight"]
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"blk.{i}."
            # Fused projections: one matmul for Q|K|V and one for gate|up keeps the op count low.
            qkv = torch.cat([weights[p + "attn_q.weight"], weights[p + "attn_k.weight"], weights[p + "attn_v.weight"]])
            gate_up = torch.cat([weights[p + "ffn_gate.weight"], weights[p + "ffn_up.weight"]])
            self.layers.append(
                (
                    weights[p + "attn_norm.weight"],
                    qkv.t().contiguous(),
                    weights[p + "attn_output.weight"].t().contiguous(),
                    weights[p + "ffn_norm.weight"],
                    gate_up.t().contiguous(),
                    weights[p + "ffn_down.weight"].t().contiguous(),
                )
            )
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = emb.cos().to(dtype)  # [positions, head_dim]
        self.sin = emb.sin().to(dtype)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return weight * h.to(self.dtype)

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
    ) -> torch.Tensor:
        """Run the flat batch; return fp32 logits `[len(sample_rows), vocab]` for the rows to sample."""
        cfg = self.cfg
        n = input_ids.shape[0]
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        x = self.embed[input_ids]  # x: [tokens, hidden]
        for index, (attn_norm, w_qkv, w_o, ffn_norm, w_gate_up, w_down) in enumerate(self.layers):
            h = self._rms_norm(x, attn_norm)
            qkv = h @ w_qkv
            q = qkv[:, :q_size].view(n, cfg.num_heads, cfg.head_dim)
            k = qkv[:, q_size : q_size + kv_size].view(n, cfg.num_kv_heads, cfg.head_dim)
            v = qkv[:, q_size + kv_size :].view(n, cfg.num_kv_heads, cfg.head_dim)
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            k_cache, v_cache = arena.layer(index)
            k_cache[batch.slot_blocks, batch.slot_offsets] = k
            v_cache[batch.slot_blocks, batch.slot_offsets] = v
            attn = self._attention(q, k_cache, v_cache, batch)
            x = x + attn @ w_o
            h = self._rms_norm(x, ffn_norm)
            gate, up = (h @ w_gate_up).chunk(2, dim=-1)
            x = x + (F.silu(gate) * up) @ w_down
        x = self._rms_norm(x[sample_rows], self.final_norm)
        return (x @ self.lm_head.t()).float()

    def _attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        # q: [tokens, heads, head_dim]; caches: [blocks, block_size, kv_heads, head_dim]
        cfg = self.cfg
        parts = []
        nd = batch.num_decode
        if nd:
            assert batch.decode_block_tables is not None
            k = k_cache[batch.decode_block_tables].flatten(1, 2).transpose(1, 2)  # [reqs, kv_heads, ctx, dim]
            v = v_cache[batch.decode_block_tables].flatten(1, 2).transpose(1, 2)
            qd = q[:nd].unsqueeze(2)  # [reqs, heads, 1, dim]
            out = F.scaled_dot_product_attention(qd, k, v, attn_mask=batch.decode_mask, enable_gqa=True)
            parts.append(out.reshape(nd, cfg.num_heads * cfg.head_dim))
        for chunk in batch.prefills:
            qc = q[chunk.start : chunk.start + chunk.length].transpose(0, 1).unsqueeze(0)  # [1, heads, new, dim]
            k = k_cache[chunk.block_table].flatten(0, 1)[: chunk.context_len].transpose(0, 1).unsqueeze(0)
            v = v_cache[chunk.block_table].flatten(0, 1)[: chunk.context_len].transpose(0, 1).unsqueeze(0)
            past = chunk.context_len - chunk.length
            if past == 0:
                out = F.scaled_dot_product_attention(qc, k, v, is_causal=True, enable_gqa=True)
            else:
                rows = torch.arange(chunk.length).unsqueeze(1) + past
                mask = torch.arange(chunk.context_len).unsqueeze(0) <= rows  # [new, ctx]
                out = F.scaled_dot_product_attention(qc, k, v, attn_mask=mask, enable_gqa=True)
            parts.append(out[0].transpose(0, 1).reshape(chunk.length, cfg.num_heads * cfg.head_dim))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
