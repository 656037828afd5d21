"""A self-contained PyTorch drafter for folders written by `dblast export`.

For users who serve with PyTorch: `DBlastDrafterTorch.from_pretrained(folder)` loads any
export (plain DFlash layout for K = 1, plus the `dblast.`-prefixed tensors for the
latent-mixture additions, a learned mask embedding, the serial previous-token
correction head and a causal block) and computes the same branch logits and prior logits
as the JAX drafter (with a correction head or a causal block: given the previous tokens;
both draft left to right, a causal block with one drafter pass per position). It depends
only on torch and safetensors (the `torch` extra), never on the JAX code, so this file
can be copied out on its own.

The target's input embedding and LM head are arguments of `forward`, as in DFlash: the
drafter owns neither.

A K = 1 export with a token mask is also a plain DFlash checkpoint: z-lab's reference
`dflash.DFlashDraftModel.from_pretrained(folder)` loads it unchanged
(tests/test_dflash_interop.py), as DFlash servers (vLLM) should. Exports whose config.json has
`dblast_config.dblast_only` (K > 1, or a learned mask) need this module or dblast_jax.

Speculative decoding in PyTorch: `spec_generate(target_model, input_ids, ...)` runs the
drafter on top of any transformers causal LM target at batch 1, with a draft cache
(`DraftCache`: context K/V per drafter layer, appended from the target's hidden states
of newly accepted positions, docs/METHOD.md section 2) and the four verification modes
of docs/METHOD.md section 3 (the same math as dblast_jax/verify.py and sampler.py).

This file is also the Hugging Face remote code of an export (`write_remote_code` in
dblast_jax/io/hf_remote.py copies it as `modeling_dblast.py`): `DBlastDraftConfig` and
`DBlastDraftModel` (a PreTrainedModel with the same tensors and methods) are built on
first access, so plain use never imports transformers. Imports: torch and transformers,
plus safetensors (a dependency of transformers) for `DBlastDrafterTorch.from_pretrained`.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import NamedTuple, Optional, Sequence

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

    def context_kv(self, ctx, ctx_pos, inv_freq):
        """Keys / values of context features ctx [B, T, H] at positions ctx_pos [B, T]:
        k_proj, k_norm, RoPE (keys) and v_proj (values), each [B, T, nkv, d]."""
        bsz, t, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(bsz, t, self.nkv, self.d))
        v = self.v_proj(ctx).view(bsz, t, self.nkv, self.d)
        return _rope(k, ctx_pos, inv_freq), v

    def forward(self, x, ctx_k, ctx_v, blk_pos, visible, inv_freq):
        """x [B, b, H] block (normed); ctx_k / ctx_v [B, T, nkv, d] context keys / values
        (`context_kv`); visible [B, T + b] (every block slot sees the same keys) or
        [B, b, T + b] (per slot: a causal block)."""
        bsz, b, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(bsz, b, self.nq, self.d))
        q = _rope(q, blk_pos, inv_freq)
        blk_k, blk_v = self.context_kv(x, blk_pos, inv_freq)
        k = torch.cat([ctx_k.to(blk_k.dtype), blk_k], 1)
        v = torch.cat([ctx_v.to(blk_v.dtype), blk_v], 1)
        groups = self.nq // self.nkv
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
        scores = torch.einsum("bqnd,bsnd->bnqs", q.float(), k.float()) * self.d ** -0.5
        seen = visible[:, None, None, :] if visible.dim() == 2 else visible[:, None]
        scores = scores.masked_fill(~seen, float("-inf"))
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

    def forward(self, x, ctx_k, ctx_v, blk_pos, visible, inv_freq):
        x = x + self.self_attn(self.input_layernorm(x), ctx_k, ctx_v, blk_pos, visible,
                               inv_freq)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Weight(nn.Module):
    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape))


VERIFY_MODES = ("greedy-branch", "sampled-branch", "mixture", "sampled-mixture")


class _DrafterCore:
    """Submodules and methods shared by `DBlastDrafterTorch` (plain nn.Module) and the
    Hugging Face `DBlastDraftModel` (PreTrainedModel): the same tensor names, so one
    checkpoint loads into either."""

    def _build(self, c: dict) -> None:
        dflash = c.get("dflash_config") or {}
        dblast = c.get("dblast_config") or {}
        h, heads = int(c["hidden_size"]), int(c["num_attention_heads"])
        self.hidden_size = h
        self.block_size = int(c.get("block_size") or dflash.get("block_size") or 0)
        if self.block_size < 2:
            raise ValueError("config.json has no usable block_size")
        self.target_layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        self.learned_mask = dblast.get("mask", "token") == "learned"
        self.mask_token_id = None if self.learned_mask else dflash.get("mask_token_id")
        self.num_categories = int(dblast.get("num_categories", 1))
        self.expander_width = int(dblast.get("expander_width", 0))
        self.correction = dblast.get("correction", "none")
        if self.correction not in ("none", "previous-token"):
            raise ValueError(f"this export has a serial correction head (dblast_config."
                             f"correction {self.correction!r}) that this PyTorch drafter "
                             "does not know (it knows 'previous-token'): load it with the "
                             "dblast_jax version that wrote it")
        attention = dblast.get("block_attention",
                               "causal" if dflash.get("causal") else "bidirectional")
        if attention not in ("bidirectional", "causal"):
            raise ValueError(f"dblast_config.block_attention {attention!r} is not one this "
                             "PyTorch drafter knows (bidirectional, causal)")
        self.causal = attention == "causal"
        if "causal" in dflash and bool(dflash["causal"]) != self.causal:
            raise ValueError(f"dflash_config.causal {dflash['causal']!r} contradicts "
                             f"dblast_config.block_attention {attention!r}")
        if self.causal and self.correction != "none":
            raise ValueError("a causal block does not combine with a correction head")
        nkv = int(c.get("num_key_value_heads") or heads)
        d = int(c.get("head_dim") or h // heads)
        eps = float(c.get("rms_norm_eps", 1e-6))
        theta = c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta")
        self.rope_theta, self.head_dim = float(theta or 10000.0), d
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
        if self.correction == "previous-token":
            rank = dblast.get("correction_rank")
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
                raise ValueError(f"dblast_config.correction_rank must be an integer >= 1, "
                                 f"got {rank!r}")
            self.dblast.correction = nn.Module()  # offset = silu(e W_p + h W_c) W_o
            self.dblast.correction.prev_proj = nn.Linear(h, rank, bias=False)
            self.dblast.correction.ctx_proj = nn.Linear(h, rank, bias=False)
            self.dblast.correction.out_proj = nn.Linear(rank, h, bias=False)
            self.rms_eps = eps

    @property
    def inv_freq(self) -> torch.Tensor:
        """RoPE inverse frequencies, always float32 (computed, so no dtype cast or meta
        device initialisation can touch them)."""
        d = self.head_dim
        return 1.0 / (self.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32,
                                                       device=self.fc.weight.device) / d))

    # ---- forward ---------------------------------------------------------------------

    def context_features(self, taps: torch.Tensor) -> torch.Tensor:
        """taps [B, T, n_taps, H] (target layer order) -> [B, T, H]."""
        bsz, t, n, h = taps.shape
        w = self.fc.weight
        return self.hidden_norm(self.fc(taps.reshape(bsz, t, n * h).to(device=w.device,
                                                                     dtype=w.dtype)))

    def context_kv(self, taps: torch.Tensor, start: int | torch.Tensor = 0):
        """Per drafter layer, the context (keys, values) of taps [B, T, n_taps, H] at
        positions start .. start + T - 1 (start: an int or [B])."""
        bsz, t = taps.shape[:2]
        ctx = self.context_features(taps)
        dev = ctx.device
        start = torch.as_tensor(start, device=dev).long().reshape(-1, 1)
        pos = (start + torch.arange(t, device=dev)[None, :]).expand(bsz, t)
        inv = self.inv_freq
        return [layer.self_attn.context_kv(ctx, pos, inv) for layer in self.layers]

    def _block_hidden(self, kv, visible_ctx: torch.Tensor, anchor_tokens: torch.Tensor,
                      anchor_positions: torch.Tensor, embed_weight: torch.Tensor,
                      block_tokens: Optional[torch.Tensor] = None):
        """The block pass given context K/V per layer and visible_ctx [B, T] bool.
        block_tokens [B, b-1] (a causal block only): slots 1 .. b-1 hold these tokens'
        embeddings where >= 0 and MASK where -1 (default: MASK everywhere)."""
        dtype = self.fc.weight.dtype
        bsz = anchor_tokens.shape[0]
        b = self.block_size
        dev = self.fc.weight.device
        blk_pos = anchor_positions.long().to(dev)[:, None] + torch.arange(b, device=dev)[None, :]
        anchor = embed_weight[anchor_tokens.long()].to(device=dev, dtype=dtype)  # [B, H]
        mask = (self.dblast.mask_embedding if self.learned_mask
                else embed_weight[int(self.mask_token_id)]).to(device=dev, dtype=dtype)
        tail = mask.expand(bsz, b - 1, -1)
        if block_tokens is not None:
            toks = block_tokens.long().to(embed_weight.device)
            drafted = embed_weight[toks.clamp_min(0)].to(device=dev, dtype=dtype)
            tail = torch.where((toks >= 0).to(dev)[..., None], drafted, tail)
        x = torch.cat([anchor[:, None, :], tail], dim=1)
        visible = torch.cat([visible_ctx.to(dev),
                             torch.ones(bsz, b, dtype=torch.bool, device=dev)], dim=1)
        if self.causal:  # slot i sees the context and slots 0 .. i
            in_block = torch.ones(b, b, dtype=torch.bool, device=dev).tril()
            visible = visible[:, None, :].repeat(1, b, 1)
            visible[:, :, -b:] = in_block
        inv = self.inv_freq
        for layer, (k, v) in zip(self.layers, kv):
            x = layer(x, k, v, blk_pos, visible, inv)
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

    def draft_hidden(self, taps: torch.Tensor, anchor_tokens: torch.Tensor,
                     anchor_positions: torch.Tensor, embed_weight: torch.Tensor,
                     context_lengths: Optional[torch.Tensor] = None,
                     block_tokens: Optional[torch.Tensor] = None):
        """Branch hidden states [B, K, b-1, H] and prior logits [B, K] (float32).

        taps [B, T, n_taps, H]: target features of positions 0..T-1; anchor_tokens /
        anchor_positions [B]: the last verified token and its position s; the block sees
        context positions < context_lengths (default: s) plus the whole block.
        embed_weight [V, H]: the target's input embedding. block_tokens: see
        `_block_hidden` (a causal block's drafted prefix).
        """
        t = taps.shape[1]
        if context_lengths is None:
            context_lengths = anchor_positions
        dev = self.fc.weight.device
        visible = (torch.arange(t, device=dev)[None, :]
                   < context_lengths.long().to(dev)[:, None])
        return self._block_hidden(self.context_kv(taps), visible, anchor_tokens,
                                  anchor_positions, embed_weight, block_tokens)

    def draft_from_cache(self, cache: "DraftCache", anchor_tokens: torch.Tensor,
                         anchor_positions: torch.Tensor, embed_weight: torch.Tensor,
                         block_tokens: Optional[torch.Tensor] = None):
        """`draft_hidden` against a draft cache: the block sees every cached position."""
        bsz = anchor_tokens.shape[0]
        visible = torch.ones(bsz, cache.length, dtype=torch.bool, device=self.fc.weight.device)
        kv = cache.kv(self)
        if bsz > 1 and kv and kv[0][0].shape[0] == 1:  # several blocks on one context
            kv = [(k.expand(bsz, -1, -1, -1), v.expand(bsz, -1, -1, -1)) for k, v in kv]
        return self._block_hidden(kv, visible, anchor_tokens, anchor_positions,
                                  embed_weight, block_tokens)

    def forward(self, taps: torch.Tensor, anchor_tokens: torch.Tensor,
                anchor_positions: torch.Tensor, embed_weight: torch.Tensor,
                lm_head_weight: torch.Tensor, context_lengths: Optional[torch.Tensor] = None,
                prev_tokens: Optional[torch.Tensor] = None):
        """-> (branch logits [B, K, b-1, V] float32, prior logits [B, K] float32).

        lm_head_weight [V, H]: the target's LM head in torch layout (the embedding for
        tied targets). prev_tokens [B, b-1]: with a correction head or a causal block
        (only), the token before each draft position (the anchor, then the block's tokens
        d_1 .. d_{b-2}): the logits are those drafts are taken from given that prefix
        (teacher forcing in training; a causal block runs one pass per position here,
        the definition, where JAX's training pass does it in one). See `draft_hidden`
        for the other arguments."""
        if self.causal:  # slot i given the data's d_1 .. d_{i-1}: one pass per slot
            if prev_tokens is None:
                raise ValueError("this drafter has a causal block: forward needs "
                                 "prev_tokens [B, b-1] (the anchor, then d_1 .. d_{b-2})")
            self._check_prev(prev_tokens, anchor_tokens.shape[0])
            states = []
            for i in range(1, self.block_size):
                blk = prev_tokens[:, 1:].long().clone()
                blk[:, i - 1:] = -1
                blk = torch.cat([blk, torch.full_like(blk[:, :1], -1)], 1)
                branch, prior = self.draft_hidden(taps, anchor_tokens, anchor_positions,
                                                  embed_weight, context_lengths, blk)
                states.append(branch[:, :, i - 1])
            branch = torch.stack(states, 2)
            logits = torch.einsum("bkjh,vh->bkjv", branch.float(), lm_head_weight.float())
            return logits, prior
        branch, prior = self.draft_hidden(taps, anchor_tokens, anchor_positions, embed_weight,
                                          context_lengths)
        if self.correction != "none":
            if prev_tokens is None:
                raise ValueError("this drafter has a correction head: forward needs "
                                 "prev_tokens [B, b-1] (the anchor, then d_1 .. d_{b-2})")
            self._check_prev(prev_tokens, branch.shape[0])
            corr = self.dblast.correction
            pre = (self._prev_features(prev_tokens, embed_weight)[:, None]
                   + corr.ctx_proj(branch).float())  # [B, K, b-1, r]
            branch = branch + corr.out_proj(nn.functional.silu(pre).to(branch.dtype))
        elif prev_tokens is not None:
            raise ValueError("prev_tokens is for drafters with a correction head or a "
                             "causal block only")
        logits = torch.einsum("bkjh,vh->bkjv", branch.float(), lm_head_weight.float())
        return logits, prior

    def _check_prev(self, prev_tokens: torch.Tensor, batch: int) -> None:
        want = (batch, self.block_size - 1)
        if tuple(prev_tokens.shape) != want:
            raise ValueError(f"prev_tokens must be {list(want)}, got "
                             f"{list(prev_tokens.shape)}")

    def _prev_features(self, tokens: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """Previous tokens [..] -> rms(e) W_p [.., r] float32 (the correction's input
        side; e the target's embedding, normalised without a learned scale)."""
        w = self.dblast.correction.prev_proj.weight
        e = embed_weight[tokens.long().to(embed_weight.device)].to(w.device).float()
        e = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + self.rms_eps)
        return nn.functional.linear(e.to(w.dtype), w).float()

    # ---- speculative decoding --------------------------------------------------------

    @torch.no_grad()
    def spec_generate(self, target_model, input_ids, max_new_tokens: int,
                      temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                      verify_mode: str = "greedy-branch", category_temperature: float = 1.0,
                      draft_temperature: float = 1.0, stop_token_ids: Sequence[int] = (),
                      generator: Optional[torch.Generator] = None) -> "SpecOutput":
        """Speculative decoding of one prompt with a transformers causal LM target.

        input_ids: [1, T] or [T] token ids. Returns a `SpecOutput`: the new tokens (the
        first from the prefill, then accepted drafts + 1 per step, cut at max_new_tokens
        and after the first stop token), the accepted drafts of every step and the exact
        expected accepted count of every step (docs/METHOD.md section 3).

        temperature 0: argmax prefix match (every mode drafts argmaxes); otherwise the
        target's sampling distribution is temperature, then top_k, then top_p (as
        dblast_jax.sampling) and the output follows it exactly. verify_mode: one of
        VERIFY_MODES. category_temperature Z_T: the category z is drawn from
        softmax(prior / Z_T). draft_temperature: the drafts' temperature in the sampled
        modes. generator: a torch.Generator (on the target's device) for reproducible
        draws; the category, draft, acceptance and residual draws each get their own
        stream seeded from it.
        """
        if verify_mode not in VERIFY_MODES:
            raise ValueError(f"unknown verify_mode {verify_mode!r}; supported: "
                             f"{', '.join(VERIFY_MODES)}")
        if temperature < 0 or category_temperature <= 0 or draft_temperature <= 0:
            raise ValueError("temperature must be >= 0, category_temperature and "
                             "draft_temperature > 0")
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            raise ValueError(f"input_ids must be one non-empty prompt ([1, T]), got shape "
                             f"{tuple(ids.shape)}")
        if max_new_tokens < 1:
            return SpecOutput([], [], [])
        dev = target_model.get_input_embeddings().weight.device
        ids = ids.to(dev)
        streams = _Streams(generator, dev)
        embed = target_model.get_input_embeddings().weight
        head = target_model.get_output_embeddings()
        head_w = (head.weight if head is not None else embed).float()
        stops = {int(t) for t in stop_token_ids}

        out, past = _target_forward(target_model, ids, None)
        cache = DraftCache()
        cache.append(self, _taps(out.hidden_states, self.target_layer_ids), 0)
        first = _sample(sampling_probs(out.logits[0, -1], temperature, top_k, top_p)
                        if temperature > 0 else out.logits[0, -1], streams.first, temperature)
        tokens, accepted, expected = [first], [], []
        done = first in stops or max_new_tokens <= 1
        anchor, s = first, ids.shape[1]
        while not done:
            branch, prior = self.draft_from_cache(
                cache, torch.tensor([anchor], device=dev), torch.tensor([s], device=dev), embed)
            serial = None
            if self.correction != "none":  # each draft corrected by the token before it
                serial = _Serial(self, branch[0].to(dev), embed, head_w, anchor)
            elif self.causal:  # one drafter pass per position, the drafted prefix in it
                serial = _CausalSerial(self, cache, embed, head_w, anchor, s, branch[0])
            drafts, proposal = _propose(branch[0].to(dev), prior[0].to(dev), head_w,
                                        temperature, verify_mode, category_temperature,
                                        draft_temperature, streams, serial)
            block = torch.cat([torch.tensor([anchor], device=dev), drafts])[None]
            out, past = _target_forward(target_model, block, past)
            logits = out.logits[0].float()  # [b, V]
            if temperature <= 0:
                n, nxt, alphas = verify_greedy(logits, drafts)
            else:
                n, nxt, alphas = verify_block(sampling_probs(logits, temperature, top_k, top_p),
                                              drafts, proposal, streams.accept,
                                              streams.residual)
            _crop(past, s + n + 1)  # the anchor and the accepted drafts stay in the cache
            cache.append(self, _taps(out.hidden_states, self.target_layer_ids)[:, :n + 1], s)
            accepted.append(n)
            expected.append(float(torch.cumprod(alphas, 0).sum()))
            emitted = drafts[:n].tolist() + [nxt]
            for t in emitted:
                tokens.append(int(t))
                if t in stops or len(tokens) >= max_new_tokens:
                    done = True
                    break
            anchor, s = nxt, s + n + 1
        return SpecOutput(tokens, accepted, expected)


class DBlastDrafterTorch(_DrafterCore, nn.Module):
    """DFlash drafter + DBlast expander / prior head, from a `dblast export` folder."""

    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        self._build(config)

    @classmethod
    def from_pretrained(cls, folder: str, dtype: Optional[torch.dtype] = None,
                        device: str | torch.device = "cpu") -> "DBlastDrafterTorch":
        try:  # a dependency of transformers as well
            from safetensors.torch import load_file
        except ImportError as e:  # pragma: no cover
            raise ImportError("DBlastDrafterTorch.from_pretrained needs safetensors") from e
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


# ---- the draft cache and verification (docs/METHOD.md sections 2-3) ----------------------

class SpecOutput(NamedTuple):
    tokens: list  # new tokens (the prefill's first token included)
    accepted: list  # accepted drafts per speculative step (tau = mean(accepted + 1))
    expected: list  # exact expected accepted drafts per step: sum_k prod_{i<=k} alpha_i


class DraftCache:
    """Context K/V per drafter layer for positions 0 .. length - 1: only verified
    positions are ever appended, so the block sees the whole cache."""

    def __init__(self):
        self.keys: list = []
        self.values: list = []
        self.length = 0

    def append(self, model: _DrafterCore, taps: torch.Tensor, start: int) -> None:
        """Add the K/V of taps [B, T, n_taps, H], the target features of positions
        start .. start + T - 1 (start must equal the current length)."""
        if start != self.length:
            raise ValueError(f"draft cache holds {self.length} positions; cannot append at "
                             f"{start}")
        kv = model.context_kv(taps, start)
        if not self.keys:
            self.keys, self.values = [k for k, _ in kv], [v for _, v in kv]
        else:
            self.keys = [torch.cat([a, k], 1) for a, (k, _) in zip(self.keys, kv)]
            self.values = [torch.cat([a, v], 1) for a, (_, v) in zip(self.values, kv)]
        self.length += taps.shape[1]

    def kv(self, model: _DrafterCore):
        if not self.keys:  # an empty context
            d, nkv = model.head_dim, model.layers[0].self_attn.nkv
            empty = torch.zeros(1, 0, nkv, d, dtype=model.fc.weight.dtype,
                                device=model.fc.weight.device)
            return [(empty, empty)] * len(model.layers)
        return list(zip(self.keys, self.values))


def _target_forward(model, ids: torch.Tensor, past):
    """One target pass with hidden states and a KV cache -> (output, cache). Names the
    cache argument as the model's forward does (`cache` in newer transformers,
    `past_key_values` before)."""
    kwargs = {}
    if past is not None:
        names = inspect.signature(model.forward).parameters
        kwargs["cache" if "cache" in names else "past_key_values"] = past
    out = model(input_ids=ids, use_cache=True, output_hidden_states=True, **kwargs)
    new = getattr(out, "cache", None)
    if new is None:
        new = getattr(out, "past_key_values", None)
    if new is None:
        raise ValueError("the target returned no KV cache (use_cache=True)")
    return out, new


def _crop(past, length: int) -> None:
    """Keep the first `length` positions of a transformers cache (DynamicCache.crop:
    a negative argument removes that many positions, in every transformers version)."""
    extra = int(past.get_seq_length()) - length
    if extra > 0:
        past.crop(-extra)


def _taps(hidden_states, layer_ids) -> torch.Tensor:
    """transformers' hidden_states (entry 0 = embeddings) -> [B, T, n_taps, H]: the
    states after decoder layers `layer_ids` (hidden_states[i + 1])."""
    return torch.stack([hidden_states[i + 1] for i in layer_ids], dim=2)


class _Streams:
    """Independent generators for the first token, category, draft, acceptance and
    residual draws, seeded from the caller's generator (or torch's default one)."""

    def __init__(self, generator: Optional[torch.Generator], device):
        seeds = torch.randint(0, 2 ** 62, (5,), generator=generator,
                              device=generator.device if generator is not None else "cpu")
        gens = []
        for seed in seeds.tolist():
            g = torch.Generator(device=device)
            g.manual_seed(int(seed))
            gens.append(g)
        self.first, self.category, self.draft, self.accept, self.residual = gens


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
    """The target's sampling distribution, float32: temperature, then top-k (keeping
    ties with the k-th), then top-p (the smallest most-likely set whose mass reaches
    top_p, at least one token). The same as dblast_jax.sampling.sampling_logprobs."""
    if temperature <= 0:
        raise ValueError("sampling_probs needs temperature > 0")
    x = logits.float() / float(temperature)
    vocab = x.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
        probs = torch.softmax(sorted_x, dim=-1)
        keep_sorted = (torch.cumsum(probs, dim=-1) - probs) < top_p
        keep_sorted[..., 0] = True
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        x = x.masked_fill(~keep, float("-inf"))
    return torch.softmax(x, dim=-1)


def _sample(probs_or_logits: torch.Tensor, gen: torch.Generator, temperature: float) -> int:
    """One token: argmax at temperature 0, else a draw from the given probabilities."""
    if temperature <= 0:
        return int(torch.argmax(probs_or_logits))
    return int(torch.multinomial(probs_or_logits, 1, generator=gen))


def mixture_proposal(branch_probs: torch.Tensor, drafts: torch.Tensor,
                     draw_probs: torch.Tensor) -> torch.Tensor:
    """Q_i = sum_z post(z | d_<i) q_i(. | z), post proportional to
    pi'(z) prod_{j<i} q_j(d_j | z). branch_probs [K, n, V], drafts [n], draw_probs [K]
    (the law z was drawn from) -> [n, V] float32."""
    k, n, _ = branch_probs.shape
    q_at = branch_probs[:, torch.arange(n), drafts]  # [K, n]
    prefix = torch.cumprod(torch.cat([torch.ones_like(q_at[:, :1]), q_at[:, :-1]], 1), 1)
    weights = draw_probs[:, None] * prefix
    post = weights / weights.sum(0, keepdim=True).clamp_min(1e-30)
    return torch.einsum("kn,knv->nv", post, branch_probs)


class _Serial:
    """The correction head's drafting (dblast_jax/correction.py): position i's logits are
    lm_head(h_i) + silu(rms(e(x_{i-1})) W_p + h_i W_c) @ lm_head(W_o), so drafts are taken
    left to right. Everything with the vocabulary in it is computed once per step (base
    logits of every branch, the rank-r basis); a serial step is an embedding row, an
    [H] x [H, r] product and an [r] x [r, V] product."""

    def __init__(self, model: _DrafterCore, branch: torch.Tensor, embed: torch.Tensor,
                 head_w: torch.Tensor, anchor: int):
        corr = model.dblast.correction
        self.model, self.embed, self.anchor = model, embed, int(anchor)
        self.base = torch.einsum("kjh,vh->kjv", branch.float(), head_w)  # [K, b-1, V]
        self.ctx = corr.ctx_proj(branch).float()  # [K, b-1, r]
        self.basis = corr.out_proj.weight.float().T @ head_w.T  # [r, V]

    def logits(self, i: int, prev: torch.Tensor) -> torch.Tensor:
        """Position i's corrected logits [K, V] of every branch, given the previous token
        of each branch's chain, prev [K] (or one shared [1])."""
        pre = self.model._prev_features(prev, self.embed).to(self.ctx.device) + self.ctx[:, i]
        return self.base[:, i] + nn.functional.silu(pre) @ self.basis

    def greedy_chains(self) -> torch.Tensor:
        """Every branch's own argmax chain [K, b-1]."""
        k, n = self.base.shape[:2]
        prev = torch.full((k,), self.anchor, dtype=torch.long, device=self.base.device)
        chains = []
        for i in range(n):
            prev = torch.argmax(self.logits(i, prev), dim=-1)
            chains.append(prev)
        return torch.stack(chains, 1)

    def sampled(self, z: int, draft_temperature: float, gen: torch.Generator):
        """Drafts [b-1] drawn from branch z, and every branch's q on that prefix
        [K, b-1, V]."""
        n = self.base.shape[1]
        prev = torch.tensor([self.anchor], device=self.base.device)
        drafts, qs = [], []
        for i in range(n):
            q = torch.softmax(self.logits(i, prev) / draft_temperature, dim=-1)  # [K, V]
            prev = torch.multinomial(q[z], 1, generator=gen)
            drafts.append(prev[0])
            qs.append(q)
        return torch.stack(drafts), torch.stack(qs, 1)


class _CausalSerial(_Serial):
    """A causal block's drafting (dblast_jax/block_causal.py): position i's logits come
    from a drafter pass over [anchor, d_1 .. d_{i-1}, MASK ..] with the in-block causal
    mask, read at slot i. Here each pass recomputes the block (b is small; JAX's sampler
    computes two slots per pass)."""

    def __init__(self, model: _DrafterCore, cache: "DraftCache", embed: torch.Tensor,
                 head_w: torch.Tensor, anchor: int, position: int,
                 first: torch.Tensor):
        self.model, self.cache, self.embed, self.head_w = model, cache, embed, head_w
        self.anchor, self.position = int(anchor), int(position)
        self.base = first  # [K, b-1, H]: only its shape is read (slot 1 is recomputed)

    def logits(self, i: int, prefixes: torch.Tensor) -> torch.Tensor:
        """Draft i's (0-based: block slot i + 1) logits [M, K, V] of every branch, for M
        drafted prefixes [M, i + 1] (the anchor first)."""
        m = prefixes.shape[0]
        b = self.model.block_size
        dev = self.head_w.device
        blk = torch.full((m, b - 1), -1, dtype=torch.long, device=dev)
        blk[:, :i] = prefixes[:, 1:].to(dev)
        branch, _ = self.model.draft_from_cache(
            self.cache, torch.full((m,), self.anchor, device=dev),
            torch.full((m,), self.position, device=dev), self.embed, blk)
        return torch.einsum("mkh,vh->mkv", branch[:, :, i].float(), self.head_w)

    def greedy_chains(self) -> torch.Tensor:
        k, n = self.base.shape[:2]
        dev = self.head_w.device
        chains = torch.full((k, 1), self.anchor, dtype=torch.long, device=dev)
        for i in range(n):  # row z: branch z's own prefix
            logits = self.logits(i, chains)[torch.arange(k), torch.arange(k)]
            chains = torch.cat([chains, torch.argmax(logits, -1)[:, None]], 1)
        return chains[:, 1:]

    def sampled(self, z: int, draft_temperature: float, gen: torch.Generator):
        n = self.base.shape[1]
        prefix = torch.full((1, 1), self.anchor, dtype=torch.long, device=self.head_w.device)
        drafts, qs = [], []
        for i in range(n):  # one shared prefix; every branch's q on it
            q = torch.softmax(self.logits(i, prefix)[0] / draft_temperature, dim=-1)
            tok = torch.multinomial(q[z], 1, generator=gen)
            prefix = torch.cat([prefix, tok[None]], 1)
            drafts.append(tok[0])
            qs.append(q)
        return torch.stack(drafts), torch.stack(qs, 1)


def _propose(branch, prior, head_w, temperature, mode, category_temperature,
             draft_temperature, streams, serial: Optional[_Serial] = None):
    """drafts [b-1] and the proposal Q [b-1, V] (float32) of one step, as
    dblast_jax.sampler._draft. branch [K, b-1, H], prior [K]; serial: a correction
    head's left-to-right drafting (dblast_jax/correction.py), else None."""
    draw = torch.softmax(prior.float() / category_temperature, dim=-1)  # pi'
    z = int(torch.multinomial(draw, 1, generator=streams.category))
    sampled = temperature > 0  # at T = 0 every mode drafts argmaxes
    vocab = head_w.shape[0]
    if serial is not None:
        if mode in ("sampled-branch", "sampled-mixture") and sampled:
            drafts, q = serial.sampled(z, draft_temperature, streams.draft)
            if mode == "sampled-branch":
                return drafts, q[z]
            return drafts, mixture_proposal(q, drafts, draw)
        chains = serial.greedy_chains()  # [K, b-1]
        drafts = chains[z]
        if mode in ("mixture", "sampled-mixture"):
            one_hot = nn.functional.one_hot(chains, vocab).float()
            return drafts, mixture_proposal(one_hot, drafts, draw)
        return drafts, nn.functional.one_hot(drafts, vocab).float()
    if mode in ("mixture", "sampled-mixture"):
        logits = torch.einsum("kjh,vh->kjv", branch.float(), head_w)  # [K, b-1, V]
        if mode == "sampled-mixture" and sampled:
            q = torch.softmax(logits / draft_temperature, dim=-1)
            drafts = torch.multinomial(q[z], 1, generator=streams.draft)[:, 0]
            return drafts, mixture_proposal(q, drafts, draw)
        branch_tokens = torch.argmax(logits, dim=-1)  # [K, b-1]
        drafts = branch_tokens[z]
        one_hot = nn.functional.one_hot(branch_tokens, vocab).float()
        return drafts, mixture_proposal(one_hot, drafts, draw)
    logits = branch[z].float() @ head_w.T  # [b-1, V]
    if mode == "sampled-branch" and sampled:
        q = torch.softmax(logits / draft_temperature, dim=-1)
        return torch.multinomial(q, 1, generator=streams.draft)[:, 0], q
    drafts = torch.argmax(logits, dim=-1)
    return drafts, nn.functional.one_hot(drafts, vocab).float()


def verify_greedy(target_logits: torch.Tensor, drafts: torch.Tensor):
    """Temperature 0: the longest prefix equal to the target's argmax.
    target_logits [b, V], drafts [b-1] -> (accepted, next token, alphas [b-1])."""
    best = torch.argmax(target_logits, dim=-1)
    match = (drafts == best[:-1]).float()
    n = int(torch.cumprod(match, 0).sum())
    return n, int(best[n]), match


def verify_block(target_probs: torch.Tensor, drafts: torch.Tensor, proposal: torch.Tensor,
                 gen_accept: torch.Generator, gen_residual: torch.Generator):
    """Lossless verification against a dense proposal (docs/METHOD.md section 3).

    target_probs [b, V] float32 p_1..p_b; drafts [b-1]; proposal [b-1, V] Q_1..Q_{b-1}.
    d_i is accepted with probability min(1, p_i(d_i) / Q_i(d_i)); at the first rejection
    the token is drawn from normalise(max(0, p_i - Q_i)), after b-1 acceptances from p_b.
    -> (accepted, next token, alphas [b-1])."""
    b1 = drafts.shape[0]
    idx = torch.arange(b1, device=drafts.device)
    p_d = target_probs[idx, drafts]
    q_d = proposal[idx, drafts]
    alphas = torch.where(q_d > 0, torch.clamp(p_d / q_d.clamp_min(1e-30), max=1.0),
                         torch.zeros_like(q_d))
    uniforms = torch.rand(b1, generator=gen_accept, device=drafts.device)
    n = int(torch.cumprod((uniforms < alphas).float(), 0).sum())
    if n < b1:
        dist = torch.clamp(target_probs[n] - proposal[n], min=0.0)
        mass = dist.sum()
        # mass == 0 only when p_n == Q_n, where rejection has probability 0
        dist = dist / mass if mass > 0 else target_probs[n]
    else:
        dist = target_probs[b1]
    return n, int(torch.multinomial(dist, 1, generator=gen_residual)), alphas


# ---- Hugging Face remote code (AutoModel.from_pretrained(..., trust_remote_code=True)) --

_HF_CLASSES: dict = {}


def _hf_classes() -> dict:
    if not _HF_CLASSES:
        from transformers import PretrainedConfig, PreTrainedModel

        class DBlastDraftConfig(PretrainedConfig):
            """config.json of a DFlash / DBlast drafter export (kept as written)."""
            model_type = "qwen3"  # what export writes (DFlash checkpoints are Qwen3-style)

        class DBlastDraftModel(_DrafterCore, PreTrainedModel):
            """The drafter as a PreTrainedModel: `forward` gives branch and prior logits,
            `spec_generate` decodes with a transformers target (see _DrafterCore)."""
            config_class = DBlastDraftConfig
            base_model_prefix = "dblast_drafter"
            main_input_name = "taps"
            _no_split_modules: list = []

            def __init__(self, config):
                PreTrainedModel.__init__(self, config)
                self._build(config.to_dict())
                self.post_init()

            def _init_weights(self, module):  # every tensor comes from the checkpoint
                pass

        for cls in (DBlastDraftConfig, DBlastDraftModel):
            cls.__qualname__ = cls.__name__
        _HF_CLASSES.update(DBlastDraftConfig=DBlastDraftConfig,
                           DBlastDraftModel=DBlastDraftModel)
    return _HF_CLASSES


def __getattr__(name: str):
    if name in ("DBlastDraftConfig", "DBlastDraftModel"):
        return _hf_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
