"""A self-contained PyTorch drafter for folders written by `dblast export`.

For users who serve with PyTorch: `DBlastDrafterTorch.from_pretrained(folder)` loads any
export (plain DFlash layout for K = 1, plus the `dblast.`-prefixed tensors for the
latent-mixture additions and a learned mask embedding) and computes the same branch
logits and prior logits as the JAX drafter. It depends only on torch and safetensors
(the `torch` extra), never on the JAX code, so this file can be copied out on its own.

The target's input embedding and LM head are arguments of `forward`, as in DFlash: the
drafter owns neither.

A K = 1 export with a token mask is also a plain DFlash checkpoint: z-lab's reference
`dflash.DFlashDraftModel.from_pretrained(folder)` loads it unchanged
(tests/test_dflash_interop.py), as DFlash servers (vLLM) should. Exports whose config.json has
`dblast_config.dblast_only` (K > 1, or a learned mask) need this module or dblast_jax.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
from torch import nn

DBLAST_PREFIX = "dblast."


class _RMSNorm(nn.Module):
    """weight * normalise(x): statistics in float32, result in the input dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x [B, T, N, D], positions [B, T]."""
    angles = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    cos, sin = angles.cos()[:, :, None, :], angles.sin()[:, :, None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, h: int, nq: int, nkv: int, d: int, eps: float):
        super().__init__()
        self.nq, self.nkv, self.d = nq, nkv, d
        self.q_proj = nn.Linear(h, nq * d, bias=False)
        self.k_proj = nn.Linear(h, nkv * d, bias=False)
        self.v_proj = nn.Linear(h, nkv * d, bias=False)
        self.o_proj = nn.Linear(nq * d, h, bias=False)
        self.q_norm = _RMSNorm(d, eps)
        self.k_norm = _RMSNorm(d, eps)

    def forward(self, x, ctx, blk_pos, ctx_pos, visible, inv_freq):
        """x [B, b, H] block (normed), ctx [B, T, H] context features; visible [B, T + b]."""
        bsz, b, _ = x.shape
        t = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).view(bsz, b, self.nq, self.d))
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], 1).view(bsz, t + b, self.nkv, self.d)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], 1).view(bsz, t + b, self.nkv, self.d)
        k = self.k_norm(k)
        q = _rope(q, blk_pos, inv_freq)
        k = _rope(k, torch.cat([ctx_pos, blk_pos], 1), inv_freq)
        groups = self.nq // self.nkv
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
        scores = torch.einsum("bqnd,bsnd->bnqs", q.float(), k.float()) * self.d ** -0.5
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        weights = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.einsum("bnqs,bsnd->bqnd", weights, v).reshape(bsz, b, self.nq * self.d)
        return self.o_proj(out)


class _MLP(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, h, f, nq, nkv, d, eps):
        super().__init__()
        self.input_layernorm = _RMSNorm(h, eps)
        self.self_attn = _Attention(h, nq, nkv, d, eps)
        self.post_attention_layernorm = _RMSNorm(h, eps)
        self.mlp = _MLP(h, f)

    def forward(self, x, ctx, blk_pos, ctx_pos, visible, inv_freq):
        x = x + self.self_attn(self.input_layernorm(x), ctx, blk_pos, ctx_pos, visible,
                               inv_freq)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Weight(nn.Module):
    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape))


class DBlastDrafterTorch(nn.Module):
    """DFlash drafter + DBlast expander / prior head, from a `dblast export` folder."""

    def __init__(self, config: dict):
        super().__init__()
        c = config
        self.config = c
        dflash = c.get("dflash_config") or {}
        dblast = c.get("dblast_config") or {}
        h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        self.hidden_size = h
        self.block_size = int(c.get("block_size", dflash.get("block_size", 0)))
        if self.block_size < 2:
            raise ValueError("config.json has no usable block_size")
        self.target_layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        self.learned_mask = dblast.get("mask", "token") == "learned"
        self.mask_token_id = None if self.learned_mask else dflash.get("mask_token_id")
        self.num_categories = int(dblast.get("num_categories", 1))
        self.expander_width = int(dblast.get("expander_width", 0))
        nkv = int(c.get("num_key_value_heads", heads))
        d = int(c.get("head_dim") or h // heads)
        eps = float(c.get("rms_norm_eps", 1e-6))
        theta = c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        self.register_buffer(
            "inv_freq", 1.0 / (float(theta) ** (torch.arange(0, d, 2, dtype=torch.float32) / d)),
            persistent=False)
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = _RMSNorm(h, eps)
        self.layers = nn.ModuleList(
            [_Layer(h, int(c["intermediate_size"]), heads, nkv, d, eps)
             for _ in range(int(c["num_hidden_layers"]))])
        self.norm = _RMSNorm(h, eps)
        self.dblast = nn.Module()
        if self.learned_mask:
            self.dblast.mask_embedding = nn.Parameter(torch.zeros(h))
        if self.expander_width > 0:
            k, e = self.num_categories, self.expander_width
            self.dblast.expander = nn.Module()
            self.dblast.expander.in_proj = _Weight(k, e, h)   # per category (out, in)
            self.dblast.expander.out_proj = _Weight(k, h, e)
        if self.num_categories > 1:
            self.dblast.prior = nn.Linear(h, self.num_categories)

    @classmethod
    def from_pretrained(cls, folder: str, dtype: Optional[torch.dtype] = None,
                        device: str | torch.device = "cpu") -> "DBlastDrafterTorch":
        from safetensors.torch import load_file
        path = os.path.join(folder, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"{folder!r} is not a drafter export: no config.json")
        with open(path) as f:
            config = json.load(f)
        if "dflash_config" not in config:
            raise ValueError(f"{folder!r} is not a DFlash/DBlast drafter: no dflash_config")
        model = cls(config)
        state = {}
        for name in sorted(os.listdir(folder)):
            if name.endswith(".safetensors"):
                state.update(load_file(os.path.join(folder, name)))
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise ValueError(f"{folder!r}: missing tensors {sorted(missing)}, unexpected "
                             f"tensors {sorted(unexpected)}")
        stored = next(iter(state.values())).dtype if state else torch.float32
        return model.to(device=device, dtype=dtype or stored).eval()

    # ---- forward ---------------------------------------------------------------------

    def context_features(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, T, n_taps, H] (target layer order) -> [B, T, H]."""
        bsz, t, n, h = taps.shape
        return self.hidden_norm(self.fc(taps.reshape(bsz, t, n * h).to(self.fc.weight.dtype)))

    def draft_hidden(self, taps: torch.Tensor, anchor_tokens: torch.Tensor,
                     anchor_positions: torch.Tensor, embed_weight: torch.Tensor,
                     context_lengths: Optional[torch.Tensor] = None):
        """Branch hidden states [B, K, b-1, H] and prior logits [B, K] (float32).

        taps [B, T, n_taps, H]: target features of positions 0..T-1; anchor_tokens /
        anchor_positions [B]: the last verified token and its position s; the block sees
        context positions < context_lengths (default: s) plus the whole block.
        embed_weight [V, H]: the target's input embedding.
        """
        dtype = self.fc.weight.dtype
        bsz, t = taps.shape[:2]
        b = self.block_size
        dev = taps.device
        if context_lengths is None:
            context_lengths = anchor_positions
        ctx = self.context_features(taps)
        ctx_pos = torch.arange(t, device=dev)[None, :].expand(bsz, t)
        blk_pos = anchor_positions.long()[:, None] + torch.arange(b, device=dev)[None, :]
        anchor = embed_weight[anchor_tokens.long()].to(dtype)  # [B, H]
        mask = (self.dblast.mask_embedding if self.learned_mask
                else embed_weight[int(self.mask_token_id)]).to(dtype)
        x = torch.cat([anchor[:, None, :], mask.expand(bsz, b - 1, -1)], dim=1)
        visible = torch.cat([torch.arange(t, device=dev)[None, :] < context_lengths.long()[:, None],
                             torch.ones(bsz, b, dtype=torch.bool, device=dev)], dim=1)
        for layer in self.layers:
            x = layer(x, ctx, blk_pos, ctx_pos, visible, self.inv_freq)
        u = self.norm(x)
        tail = u[:, 1:]
        branch = tail[:, None]
        if self.expander_width > 0:
            ex = self.dblast.expander
            a = nn.functional.silu(torch.einsum("bjh,zeh->bzje", tail, ex.in_proj.weight))
            branch = branch + torch.einsum("bzje,zhe->bzjh", a, ex.out_proj.weight)
        if self.num_categories > 1:
            prior = self.dblast.prior(u[:, 0]).float()
        else:
            prior = torch.zeros(bsz, 1, device=dev)
        return branch, prior

    def forward(self, taps: torch.Tensor, anchor_tokens: torch.Tensor,
                anchor_positions: torch.Tensor, embed_weight: torch.Tensor,
                lm_head_weight: torch.Tensor, context_lengths: Optional[torch.Tensor] = None):
        """-> (branch logits [B, K, b-1, V] float32, prior logits [B, K] float32).

        lm_head_weight [V, H]: the target's LM head in torch layout (the embedding for
        tied targets). See `draft_hidden` for the other arguments."""
        branch, prior = self.draft_hidden(taps, anchor_tokens, anchor_positions, embed_weight,
                                          context_lengths)
        logits = torch.einsum("bkjh,vh->bkjv", branch.float(), lm_head_weight.float())
        return logits, prior
