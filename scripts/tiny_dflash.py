"""A DFlash drafter in plain PyTorch, with the weight names SGLang 0.5.17's ``DFlashDraftModel``
(``sglang/srt/models/dflash.py``) loads, plus the target-side helpers used to train and
evaluate it.

What SGLang does at a draft step (read from ``dflash.py`` and ``dflash_worker_v2.py``), and what
:class:`DFlashDrafter` reproduces:

- context: the target's residual stream after each layer in ``dflash_config.target_layer_ids``
  (SGLang captures "before layer k+1", so every id must be < num_target_layers - 1), concatenated
  per token to ``[T, K*hidden]``, projected by ``fc`` (no bias) and normed by ``hidden_norm``:
  ``ctx = hidden_norm(fc(concat))``. Every draft layer reads the SAME ``ctx``: its K/V for a
  context token are ``k_norm(k_proj(ctx))`` with RoPE at the token's position and
  ``v_proj(ctx)`` (``kv_proj_only``; no input_layernorm on the context).
- block: ``[bonus, MASK x (B-1)]`` at positions ``L .. L+B-1`` (L = committed length), embedded
  with the TARGET's embedding. Queries come from the block only; each block token attends to all
  context tokens ``< L`` and to all B block tokens (non-causal: the draft layers are
  ``ENCODER_ONLY`` attention unless the config says ``is_causal``).
- layers are Qwen3 pre-norm blocks (q_norm / k_norm per head before RoPE, SiLU MLP); a final
  ``norm``; logits come from the TARGET's ``lm_head``. Block position i (1..B-1) proposes the
  token at position ``L+i``.
- the drafter owns no embedding and no lm_head.

Checkpoint names (no ``model.`` prefix; SGLang accepts both): ``fc.weight``,
``hidden_norm.weight``, ``norm.weight`` and per layer ``layers.{i}.input_layernorm.weight``,
``layers.{i}.post_attention_layernorm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``
(SGLang fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` while loading).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class DraftShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_context_features: int  # K = len(target_layer_ids)
    rope_theta: float
    rms_norm_eps: float = 1e-6


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm: normalize in fp32, cast back, then scale (same as SGLang's RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float):
    """Neox-style (HF ``rotate_half``) RoPE tables.

    positions: int64 ``[N, S]`` -> cos, sin: float32 ``[N, S, head_dim]``.
    """
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq  # [N, S, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: ``[N, S, H, D]``; cos/sin: ``[N, S, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    cos = cos[:, :, None, :].to(x.dtype)
    sin = sin[:, :, None, :].to(x.dtype)
    return x * cos + rotated * sin


class DraftAttention(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)
        self.q_norm = RMSNorm(s.head_dim, s.rms_norm_eps)
        self.k_norm = RMSNorm(s.head_dim, s.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n_heads, self.s.head_dim)

    def forward(self, x, ctx, x_rope, ctx_rope, mask):
        """x: ``[N, Q, h]`` normed block hidden; ctx: ``[N, T, h]`` projected context;
        mask: bool ``[N, Q, T+Q]`` (True = may attend). Returns ``[N, Q, h]``."""
        s = self.s
        q = apply_rope(self.q_norm(self._heads(self.q_proj(x), s.num_heads)), *x_rope)
        k_blk = apply_rope(self.k_norm(self._heads(self.k_proj(x), s.num_kv_heads)), *x_rope)
        k_ctx = apply_rope(self.k_norm(self._heads(self.k_proj(ctx), s.num_kv_heads)), *ctx_rope)
        k = torch.cat([k_ctx, k_blk], dim=1)  # [N, T+Q, KV, D]
        v = torch.cat([self._heads(self.v_proj(ctx), s.num_kv_heads),
                       self._heads(self.v_proj(x), s.num_kv_heads)], dim=1)
        group = s.num_heads // s.num_kv_heads  # q head i reads kv head i // group
        # Norms return fp32 under autocast while v_proj returns bf16: give SDPA one dtype.
        q, k, v = (t.to(v.dtype).transpose(1, 2) for t in (q, k, v))  # [N, heads, S, D]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], s.num_heads * s.head_dim)
        return self.o_proj(out)


class DraftMLP(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, s: DraftShape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = DraftAttention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = DraftMLP(s)

    def forward(self, x, ctx, x_rope, ctx_rope, mask):
        x = x + self.self_attn(self.input_layernorm(x), ctx, x_rope, ctx_rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """The DFlash draft network (no embedding, no lm_head; see the module docstring)."""

    def __init__(self, s: DraftShape):
        super().__init__()
        self.s = s
        self.layers = nn.ModuleList([DraftLayer(s) for _ in range(s.num_layers)])
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.fc = nn.Linear(s.num_context_features * s.hidden_size, s.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def project_context(self, target_feats: torch.Tensor) -> torch.Tensor:
        """``[N, T, K*h]`` concatenated target features -> ``[N, T, h]``."""
        return self.hidden_norm(self.fc(target_feats))

    def forward(self, block_embeds, block_pos, ctx, mask):
        """Run the draft layers over blocks.

        Parameters
        ----------
        block_embeds : ``[N, Q, h]`` target embeddings of the block tokens (Q = blocks x B).
        block_pos : int64 ``[N, Q]`` absolute positions of the block tokens.
        ctx : ``[N, T, h]`` projected context (row t sits at position t).
        mask : bool ``[N, Q, T+Q]``, True where a block token may attend (context keys first).

        Returns
        -------
        ``[N, Q, h]`` final-normed hidden states; apply the target lm_head for logits.
        """
        ctx_pos = torch.arange(ctx.shape[1], device=ctx.device).expand(ctx.shape[0], -1)
        x_rope = rope_cos_sin(block_pos, self.s.head_dim, self.s.rope_theta)
        ctx_rope = rope_cos_sin(ctx_pos, self.s.head_dim, self.s.rope_theta)
        x = block_embeds
        for layer in self.layers:
            x = layer(x, ctx, x_rope, ctx_rope, mask)
        return self.norm(x)


def block_attention_mask(anchors: torch.Tensor, ctx_len: int, block_size: int) -> torch.Tensor:
    """Attention mask for several draft blocks per sequence, trained in one pass.

    anchors: int64 ``[N, m]`` block start positions (the bonus token's position). Block j's B
    queries see context tokens at positions ``< anchors[:, j]`` and the B keys of block j only,
    which is exactly what each would see in its own SGLang draft step.

    Returns bool ``[N, m*B, ctx_len + m*B]``.
    """
    n, m = anchors.shape
    dev = anchors.device
    q_block = torch.arange(m * block_size, device=dev) // block_size  # [mB]
    ctx_ok = torch.arange(ctx_len, device=dev)[None, None, :] < anchors[:, q_block][:, :, None]
    blk_ok = (q_block[:, None] == q_block[None, :]).expand(n, -1, -1)
    return torch.cat([ctx_ok, blk_ok], dim=-1)


def make_blocks(seqs: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_id: int):
    """Block inputs and labels for anchors.

    seqs: int64 ``[N, T]``; anchors: int64 ``[N, m]`` with ``anchors + block_size <= T``.
    Returns ids ``[N, m*B]`` (bonus = seqs[anchor], then MASK), positions ``[N, m*B]`` and
    labels ``[N, m, B-1]`` = seqs[anchor+1 .. anchor+B-1] (what positions 1..B-1 must propose).
    """
    offs = torch.arange(block_size, device=seqs.device)
    pos = anchors[:, :, None] + offs  # [N, m, B]
    toks = torch.gather(seqs, 1, pos.flatten(1)).view_as(pos)
    ids = torch.full_like(toks, mask_id)
    ids[:, :, 0] = toks[:, :, 0]
    return ids.flatten(1), pos.flatten(1), toks[:, :, 1:]


def position_weights(block_size: int, gamma: float, device) -> torch.Tensor:
    """Loss weight of draft position k = 1..B-1: exp(-(k-1)/gamma). Early positions matter
    most because a chain stops at its first miss (DFlash paper's weighting; gamma=7 for B=16)."""
    k = torch.arange(1, block_size, device=device, dtype=torch.float32)
    return torch.exp(-(k - 1) / gamma)


class TargetFeatures:
    """Collect a HF Qwen3 target's residual stream after the given layers via forward hooks.

    ``feats(ids)`` returns ``[N, T, K*h]`` in layer-id order: the tensor SGLang hands the
    drafter (it captures ``hidden_states + residual`` before layer k+1).
    """

    def __init__(self, model, layer_ids: Sequence[int]):
        self.model = model
        self.layer_ids = list(layer_ids)
        self._store: Dict[int, torch.Tensor] = {}
        layers = model.model.layers
        if max(self.layer_ids) >= len(layers) - 1:
            raise ValueError(
                f"target_layer_ids {self.layer_ids} must be < num_layers - 1 = {len(layers) - 1} "
                "(SGLang captures layer k's output at layer k+1's input)"
            )
        for i in self.layer_ids:
            layers[i].register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def fn(_module, _inputs, output):
            self._store[i] = output[0] if isinstance(output, tuple) else output
        return fn

    def feats(self, ids: torch.Tensor) -> torch.Tensor:
        self._store.clear()
        self.model.model(input_ids=ids, use_cache=False)
        return torch.cat([self._store[i] for i in self.layer_ids], dim=-1)


@torch.no_grad()
def simulate_dflash_greedy(
    drafter: DFlashDrafter, embed_weight: torch.Tensor, feats: torch.Tensor, seqs: torch.Tensor,
    starts: torch.Tensor, ends: torch.Tensor, block_size: int, mask_id: int,
    topks: Sequence[int] = (1, 4, 8),
) -> dict:
    """Replay greedy DFlash decoding against a known greedy continuation.

    Row r holds prompt + the target's greedy continuation in ``seqs[r, :ends[r]]``; the prompt is
    ``seqs[r, :starts[r]]``. With greedy verification the output is that continuation, so a step
    at committed length L (bonus = ``seqs[r, L]``) drafts B-1 tokens from context ``< L``,
    accepts the longest prefix matching ``seqs[r, L+1:]`` and emits accepted + 1 tokens
    (SGLang's accept length). Also counts, per draft depth, how often the true token is in the
    drafter's top-k (an upper bound on what a draft tree of that width could catch there).

    feats: ``[N, T, K*h]`` target features of ``seqs`` (right padding is harmless: causal).
    """
    n, t_len = seqs.shape
    dev = seqs.device
    ctx = drafter.project_context(feats)
    committed = starts.clone()
    steps = torch.zeros(n, dtype=torch.long, device=dev)
    emitted = torch.zeros(n, dtype=torch.long, device=dev)
    hist = torch.zeros(block_size + 1, dtype=torch.long)  # tokens per step: 1..block_size
    depth_hits = {k: torch.zeros(block_size - 1) for k in topks}
    depth_count = torch.zeros(block_size - 1)
    offs = torch.arange(1, block_size, device=dev)
    while True:
        active = (committed < ends - 1).nonzero().flatten()
        if active.numel() == 0:
            break
        anchors = committed[active][:, None]
        seq_a = seqs[active]
        block_pos = anchors + torch.arange(block_size, device=dev)  # [n, B]
        ids = torch.full_like(block_pos, mask_id)
        ids[:, 0] = torch.gather(seq_a, 1, anchors)[:, 0]  # bonus token
        mask = block_attention_mask(anchors, t_len, block_size)
        hidden = drafter(F.embedding(ids, embed_weight), block_pos, ctx[active], mask)
        logits = hidden[:, 1:].float() @ embed_weight.float().T  # [n, B-1, V]
        ref_pos = committed[active][:, None] + offs  # [n, B-1]
        valid = ref_pos < ends[active][:, None]
        ref = torch.gather(seq_a, 1, ref_pos.clamp(max=t_len - 1))
        draft = logits.argmax(-1)
        accepted = ((draft == ref) & valid).long().cumprod(1).sum(1)
        remaining = ends[active] - 1 - committed[active]
        step_tokens = torch.minimum(accepted + 1, remaining)
        hist += torch.bincount(step_tokens.cpu(), minlength=block_size + 1)
        top = logits.topk(max(topks), dim=-1).indices  # [n, B-1, kmax]
        for k in topks:
            hit = (top[..., :k] == ref[..., None]).any(-1) & valid
            depth_hits[k] += hit.float().sum(0).cpu()
        depth_count += valid.float().sum(0).cpu()
        committed[active] += step_tokens
        steps[active] += 1
        emitted[active] += step_tokens
    total_steps = int(steps.sum())
    return {
        "mean_accept_length": float(emitted.sum()) / max(total_steps, 1),
        "steps": total_steps,
        "tokens": int(emitted.sum()),
        "accept_length_histogram": hist.tolist(),
        "topk_hit_rate_by_depth": {
            str(k): (depth_hits[k] / depth_count.clamp(min=1)).tolist() for k in topks
        },
    }


def drafter_state_dict_for_sglang(drafter: DFlashDrafter, dtype=torch.bfloat16) -> Dict[str, torch.Tensor]:
    """Checkpoint tensors, named as SGLang's ``DFlashDraftModel.load_weights`` expects."""
    return {k: v.detach().to(dtype).contiguous().cpu() for k, v in drafter.state_dict().items()}


def expected_sglang_param_names(num_layers: int) -> List[str]:
    """Hard list of the checkpoint names a ``DFlashDraftModel`` (SGLang 0.5.17) consumes, read
    from ``dflash.py``; tests also derive them from the real class when SGLang is importable."""
    names = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    for i in range(num_layers):
        p = f"layers.{i}."
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{w}.weight" for w in ("q_proj", "k_proj", "v_proj", "o_proj",
                                                       "q_norm", "k_norm")]
        names += [p + f"mlp.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")]
    return sorted(names)
