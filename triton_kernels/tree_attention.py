"""Tree-verify attention over SGLang's paged KV cache (MHA / GQA), with split-K and a reduction.

DDTree verifies ``N = budget + 1`` tree tokens per request in one target forward (node 0 is the
root, i.e. the bonus token). Query ``i`` of request ``b`` attends to

- every token of the request's prefix (``seq_lens[b]`` tokens already in the KV cache), and
- the tree tokens ``j`` with ``tree_mask[b, i, j]`` (``j`` is ``i`` or an ancestor of ``i``; see
  ``/work/notes/tree_contract.md``: the ``ancestor_mask`` of a ``DraftTree``). A plan with
  ``ordered_mask=False`` takes any mask instead (the drafter's bidirectional block).

The tree tokens' own K/V were already written to the cache at ``out_cache_loc`` (SGLang saves KV
before calling the backend), so the kernel reads everything by *slot index*: prefix slots from a
``req_to_token`` row (or a flat ``kv_indices`` / ``kv_indptr`` pair as SGLang's triton backend
builds) and tree slots from ``out_cache_loc``. Slots are token-granular for any page size, so the
same kernel serves page_size 1 and > 1.

Work split. One program owns one (request, KV head, block of query rows, prefix split). Its rows are
``(tree token, q head of the KV head's group)`` pairs, so a KV tile is loaded once for all ``G`` query
heads of a GQA group and all tree tokens in the block (SGLang's extend kernel re-reads KV once per
query head). With ``S > 1`` splits, split ``s`` covers one contiguous chunk of the prefix (at least
256 keys: ``S`` is sized for the longest context, so a short prefix leaves later splits empty), the
last split also covers the tree tokens, and each non-empty split writes a normalised partial output
plus its log2-sum-exp (an empty one only its -inf log-sum-exp); :func:`_tree_attn_reduce_kernel`
merges them, reading only the partials of splits with weight.

Capture safety. :meth:`TreeAttention.plan` sizes every buffer from (max batch, N, heads, dims, max
context) once; :meth:`TreeAttention.run` only launches kernels whose grids depend on static shapes
(batch size, N, heads) and never reads device data on the host, so it can be captured in a CUDA graph
and replayed with new inputs. Split chunk bounds are computed inside the kernel from ``seq_lens``;
empty chunks just write an empty partial.

Prefix from elsewhere. ``run(..., prefix_out=, prefix_lse=)`` takes the prefix part of the
attention from another kernel (e.g. FlashMLA's non-causal decode over the prefix pages: its
normalised output and natural-log log-sum-exp per row) and computes only the tree part here, one
split, merging the two by their log-sum-exps in the epilogue (no reduce launch).

The MLA (absorbed, latent KV) variant lives in ``tree_attention_mla.py`` and reuses these kernels;
tile configs and split counts are chosen in ``tree_attention_plan.py``.
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .tree_attention_plan import (
    _PARTIAL_BYTES,
    KernelConfig,
    _batch_config,
    _default_config,
    _latent_rows,
    _merge_config,
    _num_sms,
    _reduce_chunk,
    mha_split_count,
    mla_programs_per_sm,
    split_count,
)

# Triton's CPU interpreter (TRITON_INTERPRET=1, used by CI) mis-evaluates tl.dot on bf16 tiles
# (it multiplies raw bit patterns) and rejects tensor loop bounds in range() under numpy >= 2, so
# under the interpreter every dot runs in fp32 and loops are while loops (INTERPRET flag).
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

_LOG2E = 1.4426950408889634
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@triton.jit
def _tanh(x):
    # tl has no tanh on every backend; 2*sigmoid(2x) - 1 is exact enough in fp32.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _softmax_step(m_i, l_i, s, allowed, qk_scale, logit_cap, HAS_CAP: tl.constexpr):
    """One key tile's online-softmax step on raw scores ``s`` [BM, BN]: scaled (and capped),
    masked by ``allowed``; returns the tile's probabilities, the rescale of the running output,
    and the new running max and sum (log2 domain)."""
    if HAS_CAP:
        # logit soft cap as SGLang applies it: cap * tanh(scaled / cap), then to log2 domain
        s = logit_cap * _tanh(s * qk_scale / logit_cap) * 1.4426950408889634
    else:
        s = s * qk_scale
    s = tl.where(allowed, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows stay at zero
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _accumulate(acc, alpha, p, v, INTERPRET: tl.constexpr):
    """The running output rescaled and the tile's ``p @ v`` added."""
    if INTERPRET:
        return acc * alpha[:, None] + tl.dot(p, v)
    return acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)


@triton.jit
def _attend_tile(
    acc, m_i, l_i,            # running output [BM, BDV] fp32, max [BM] and sum [BM] (log2 domain)
    q, q_pe,                  # [BM, BDK] and [BM, D_PE] query tiles (q_pe unused when D_PE == 0;
                              # q unused when DK_CHUNK > 0: its chunks are read from q_rows)
    q_rows, row_ok,           # [BM] pointers to each row's query, [BM] row exists
    k_ptr, v_ptr,             # cache base pointers already offset to this KV head
    slots,                    # [BN] int64 slot of each key in the tile
    allowed,                  # [BM, BN] bool: which (row, key) pairs may attend
    key_ok,                   # [BN] bool: key exists (guards every cache read)
    stride_kt, stride_vt,
    qk_scale, logit_cap, dv0,  # dv0: first output column of this program (DV_SPLIT > 1)
    acc_t, m_t, l_t, q_t, allowed_t,  # the tail block's state, query and mask (TAIL_M > 0)
    DK: tl.constexpr, BLOCK_DK: tl.constexpr, D_PE: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    SHARED_KV: tl.constexpr, HAS_CAP: tl.constexpr, INTERPRET: tl.constexpr,
    DV_SPLIT: tl.constexpr, DK_CHUNK: tl.constexpr, TAIL_M: tl.constexpr,
):
    qdt = q_rows.dtype.element_ty
    if DK_CHUNK == 0:
        offs_dk = tl.arange(0, BLOCK_DK)
        k = tl.load(
            k_ptr + slots[:, None] * stride_kt + offs_dk[None, :],
            mask=key_ok[:, None] & (offs_dk[None, :] < DK), other=0.0,
        )  # [BN, BDK]
        if INTERPRET:
            kd = k.to(tl.float32)
        else:
            kd = k.to(qdt)  # fp8 caches are upcast; the scale is folded into qk_scale / v_scale
        s = tl.dot(q, tl.trans(kd))
        if TAIL_M > 0:
            s_t = tl.dot(q_t, tl.trans(kd))
    else:
        # the QK reduction in DK_CHUNK-wide slices of the query (re-read, L1-resident) and of
        # the keys, so neither full-width tile stays live in registers (MLA: 512 dims)
        s = tl.zeros(allowed.shape, dtype=tl.float32)
        for c in tl.static_range(0, BLOCK_DK, DK_CHUNK):
            offs_c = c + tl.arange(0, DK_CHUNK)
            qc = tl.load(q_rows[:, None] + offs_c[None, :],
                         mask=row_ok[:, None] & (offs_c[None, :] < DK), other=0.0)
            kc = tl.load(k_ptr + slots[:, None] * stride_kt + offs_c[None, :],
                         mask=key_ok[:, None] & (offs_c[None, :] < DK), other=0.0)
            if INTERPRET:
                qc = qc.to(tl.float32)
                kc = kc.to(tl.float32)
            else:
                kc = kc.to(qdt)
            s += tl.dot(qc, tl.trans(kc))
    if D_PE > 0:
        offs_pe = DK + tl.arange(0, D_PE)
        k_pe = tl.load(k_ptr + slots[:, None] * stride_kt + offs_pe[None, :],
                       mask=key_ok[:, None], other=0.0)
        if INTERPRET:
            k_pe = k_pe.to(tl.float32)
        else:
            k_pe = k_pe.to(qdt)
        s += tl.dot(q_pe, tl.trans(k_pe))
    p, alpha, m_i, l_i = _softmax_step(m_i, l_i, s, allowed, qk_scale, logit_cap, HAS_CAP)
    if TAIL_M > 0:
        p_t, alpha_t, m_t, l_t = _softmax_step(m_t, l_t, s_t, allowed_t, qk_scale, logit_cap,
                                               HAS_CAP)
    if SHARED_KV and DV_SPLIT == 1 and DK_CHUNK == 0:
        v = kd  # absorbed MLA: V is the first DV (= DK) latent dims of the same row
    else:
        # BLOCK_DV columns from dv0 (all of them unless the output columns are split across
        # programs; a split shared-KV program re-reads its slice of the latent row)
        offs_dv = dv0 + tl.arange(0, BLOCK_DV)
        v = tl.load(
            v_ptr + slots[:, None] * stride_vt + offs_dv[None, :],
            mask=key_ok[:, None] & (offs_dv[None, :] < DV), other=0.0,
        )
        if INTERPRET:
            v = v.to(tl.float32)
        else:
            v = v.to(qdt)
    acc = _accumulate(acc, alpha, p, v, INTERPRET)
    if TAIL_M > 0:
        acc_t = _accumulate(acc_t, alpha_t, p_t, v, INTERPRET)
    return acc, m_i, l_i, acc_t, m_t, l_t


@triton.jit
def _prefix_tile(n0, end, acc, m_i, l_i, q, q_pe, q_rows, k_base, v_base, kv_table_ptr, row_base,
                 row_ok, stride_kt, stride_vt, qk_scale, logit_cap, dv0,
                 acc_t, m_t, l_t, q_t, row_ok_t, BLOCK_N: tl.constexpr,
                 DK: tl.constexpr, BLOCK_DK: tl.constexpr, D_PE: tl.constexpr,
                 DV: tl.constexpr, BLOCK_DV: tl.constexpr, SHARED_KV: tl.constexpr,
                 HAS_CAP: tl.constexpr, INTERPRET: tl.constexpr, DV_SPLIT: tl.constexpr,
                 DK_CHUNK: tl.constexpr, TAIL_M: tl.constexpr):
    # prefix keys [n0, n0 + BLOCK_N) clipped to the split's end: every row may see them
    pos = n0 + tl.arange(0, BLOCK_N)
    key_ok = pos < end
    slots = tl.load(kv_table_ptr + row_base + pos, mask=key_ok, other=0).to(tl.int64)
    allowed = row_ok[:, None] & key_ok[None, :]
    if TAIL_M > 0:
        allowed_t = row_ok_t[:, None] & key_ok[None, :]
    else:
        allowed_t = allowed
    return _attend_tile(acc, m_i, l_i, q, q_pe, q_rows, row_ok, k_base, v_base, slots, allowed,
                        key_ok, stride_kt, stride_vt, qk_scale, logit_cap, dv0,
                        acc_t, m_t, l_t, q_t, allowed_t,
                        DK, BLOCK_DK, D_PE, DV, BLOCK_DV, SHARED_KV, HAS_CAP, INTERPRET,
                        DV_SPLIT, DK_CHUNK, TAIL_M)


@triton.jit
def _tree_tile(j0, N, acc, m_i, l_i, q, q_pe, q_rows, k_base, v_base, loc_row, mask_row, row_ok,
               stride_kt, stride_vt, qk_scale, logit_cap, dv0,
               acc_t, m_t, l_t, q_t, mask_row_t, row_ok_t, BLOCK_N: tl.constexpr,
               DK: tl.constexpr, BLOCK_DK: tl.constexpr, D_PE: tl.constexpr,
               DV: tl.constexpr, BLOCK_DV: tl.constexpr, SHARED_KV: tl.constexpr,
               HAS_CAP: tl.constexpr, INTERPRET: tl.constexpr, DV_SPLIT: tl.constexpr,
               DK_CHUNK: tl.constexpr, TAIL_M: tl.constexpr):
    # tree keys [j0, j0 + BLOCK_N): a row sees key j iff tree_mask[b, row's token, j]
    j = j0 + tl.arange(0, BLOCK_N)
    key_ok = j < N
    slots = tl.load(loc_row + j, mask=key_ok, other=0).to(tl.int64)
    anc = tl.load(mask_row[:, None] + j[None, :], mask=row_ok[:, None] & key_ok[None, :],
                  other=0)
    if TAIL_M > 0:
        anc_t = tl.load(mask_row_t[:, None] + j[None, :],
                        mask=row_ok_t[:, None] & key_ok[None, :], other=0) != 0
    else:
        anc_t = anc != 0
    return _attend_tile(acc, m_i, l_i, q, q_pe, q_rows, row_ok, k_base, v_base, slots,
                        anc != 0, key_ok, stride_kt, stride_vt, qk_scale, logit_cap, dv0,
                        acc_t, m_t, l_t, q_t, anc_t,
                        DK, BLOCK_DK, D_PE, DV, BLOCK_DV, SHARED_KV, HAS_CAP, INTERPRET,
                        DV_SPLIT, DK_CHUNK, TAIL_M)


@triton.jit
def _epilogue(acc, m_i, l_i, row_ok, row_live, tok, head, t_glob, b, split, dvp, dv0,
              Hq, num_splits, o_ptr, part_o_ptr, part_lse_ptr, v_scale,
              stride_ot, stride_oh, pre_o_ptr, pre_lse_ptr, stride_pot, stride_poh,
              stride_plb, stride_plh, stride_pln,
              DV: tl.constexpr, BLOCK_DV: tl.constexpr, SPLIT: tl.constexpr,
              MERGE_PREFIX: tl.constexpr):
    """Normalise a row block's output and write it: to ``o`` (merged with a given prefix part
    under MERGE_PREFIX), or as this split's partial and log2-sum-exp (SPLIT)."""
    offs_dv = dv0 + tl.arange(0, BLOCK_DV)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    if not SPLIT:
        out = out * v_scale
        if MERGE_PREFIX:
            # both parts normalised; weights from their log-sum-exps (log2 units here: qk_scale
            # holds log2 e, and the prefix kernel's natural-log value is converted)
            t_lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
            p_lse = tl.load(pre_lse_ptr + b.to(tl.int64) * stride_plb + head * stride_plh
                            + tok * stride_pln, mask=row_ok, other=float("-inf"))
            # an empty prefix: -inf, or +inf as FlashAttention marks a row with no keys
            p_lse = tl.where(p_lse == float("inf"), float("-inf"), p_lse * 1.4426950408889634)
            p_out = tl.load(pre_o_ptr + t_glob[:, None] * stride_pot + head[:, None] * stride_poh
                            + offs_dv[None, :],
                            mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
            p_out = tl.where((p_lse == float("-inf"))[:, None], 0.0, p_out.to(tl.float32))
            top = tl.maximum(t_lse, p_lse)
            top = tl.where(top == float("-inf"), 0.0, top)
            w_t = tl.exp2(t_lse - top)
            w_p = tl.exp2(p_lse - top)
            den = tl.where(w_t + w_p == 0.0, 1.0, w_t + w_p)
            out = (w_t[:, None] * out + w_p[:, None] * p_out) / den[:, None]
        o_off = t_glob[:, None] * stride_ot + head[:, None] * stride_oh + offs_dv[None, :]
        tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    else:
        # partial layout is contiguous [T, Hq, num_splits, DV]
        ph = (t_glob * Hq + head) * num_splits + split
        tl.store(part_o_ptr + ph[:, None] * DV + offs_dv[None, :], out,
                 mask=row_live[:, None] & (offs_dv[None, :] < DV))
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_safe))
        tl.store(part_lse_ptr + ph, lse, mask=row_ok & (dvp == 0))  # the same in every part


@triton.jit
def _tree_attn_fwd_kernel(
    q_ptr,            # [T, Hq, DK (+ D_PE)] queries, T = bs * N (request-major, node order)
    k_ptr,            # [num_slots, Hkv, DK + D_PE] key cache (bf16/fp16/fp8)
    v_ptr,            # [num_slots, Hkv, DV] value cache (unused when SHARED_KV)
    o_ptr,            # [T, Hq, DV] output, written directly unless SPLIT
    part_o_ptr,       # [T, Hq, num_splits, DV] fp32 normalised split outputs (SPLIT)
    part_lse_ptr,     # [T, Hq, num_splits] fp32 split log2-sum-exp (SPLIT)
    kv_table_ptr,     # [pool, max_ctx] req_to_token, or [total] kv_indices when USE_INDPTR
    kv_row_ptr,       # [bs] req_pool_indices, or [bs + 1] kv_indptr when USE_INDPTR
    seq_lens_ptr,     # [bs] prefix lengths (unused when USE_INDPTR)
    tree_loc_ptr,     # [T] out_cache_loc: cache slot of each tree token
    tree_mask_ptr,    # [bs, N, N] uint8 ancestor-or-self mask
    N,                # tree tokens per request (budget + 1)
    num_splits,       # prefix splits (runtime, so batch sizes share one compiled kernel)
    qk_scale,         # sm_scale * k_scale (* log2 e unless HAS_CAP)
    v_scale,
    logit_cap,
    stride_qt, stride_qh,
    qpe_ptr,          # [T, Hq, D_PE] rope part of the queries (D_PE > 0): q's last D_PE dims,
    stride_qpt, stride_qph,  # or a tensor of its own (MLA's split convention, no concat)
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_table,     # row stride of req_to_token
    stride_mb, stride_mi,
    pre_o_ptr,        # [T, Hq, DV] normalised prefix-only output (MERGE_PREFIX)
    pre_lse_ptr,      # prefix-only natural-log log-sum-exp of row (b, head, tok) (MERGE_PREFIX)
    stride_pot, stride_poh,
    stride_plb, stride_plh, stride_pln,
    G: tl.constexpr,  # query heads per KV head
    DK: tl.constexpr, BLOCK_DK: tl.constexpr, D_PE: tl.constexpr,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,  # num_splits > 1: write partials for the reduce kernel
    USE_INDPTR: tl.constexpr, SHARED_KV: tl.constexpr, HAS_CAP: tl.constexpr,
    INTERPRET: tl.constexpr,
    DV_SPLIT: tl.constexpr = 1,  # programs sharing a row block, each BLOCK_DV output columns
    DK_CHUNK: tl.constexpr = 0,  # > 0: QK in slices of this many dims (query not held whole)
    MIN_CHUNK: tl.constexpr = 256,  # fewest prefix keys a non-empty split covers
    MERGE_PREFIX: tl.constexpr = False,  # prefix part given (pre_o, pre_lse): tree keys only
    ORDERED_MASK: tl.constexpr = True,  # a row's mask admits no later token (a tree); False:
                                        # any token may be a key (a bidirectional block)
    TAIL_M: tl.constexpr = 0,  # > 0: the TAIL_M rows after the last full block ride with it
                               # (the last program's; masked off in the others), so a tree of
                               # k x BLOCK_M + a few rows runs k programs, not k + 1
):
    pid_m = tl.program_id(0)        # fastest: blocks sharing a KV chunk run together (L2 reuse)
    pid_hs = tl.program_id(1)       # (kv_head * num_splits + split) * DV_SPLIT + column part
    b = tl.program_id(2)
    dvp = pid_hs % DV_SPLIT
    pid_hs = pid_hs // DV_SPLIT
    kvh = pid_hs // num_splits
    split = pid_hs % num_splits
    Hq = tl.num_programs(1) // DV_SPLIT // num_splits * G
    dv0 = dvp * BLOCK_DV

    # rows of this block: r = token * G + head-in-group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < N * G
    tok = rows // G
    head = kvh * G + rows % G
    t_glob = (b * N + tok).to(tl.int64)

    if USE_INDPTR:
        row_base = tl.load(kv_row_ptr + b).to(tl.int64)
        prefix_len = (tl.load(kv_row_ptr + b + 1) - row_base).to(tl.int32)
    else:
        row_base = tl.load(kv_row_ptr + b).to(tl.int64) * stride_table
        prefix_len = tl.load(seq_lens_ptr + b).to(tl.int32)

    # this split's prefix chunk, BLOCK_N-aligned so only the last tile of the prefix is ragged,
    # and at least MIN_CHUNK keys: the split count is sized from the longest context the server
    # allows (static, for CUDA graphs), so a short prefix leaves the later splits empty instead
    # of cutting it into one-tile chunks whose partial outputs outweigh the keys they cover
    chunk = tl.maximum(tl.cdiv(tl.cdiv(prefix_len, num_splits), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    start = split * chunk
    end = tl.minimum(start + chunk, prefix_len)
    if MERGE_PREFIX:
        end = start  # another kernel attended the prefix: its result is merged below
    # an empty split (not the last, which holds the tree tokens) loads nothing and writes only
    # its -inf log-sum-exp; the reduce kernel skips its partial
    live = (start < end) | (split == num_splits - 1)
    row_live = rows < tl.where(live, N * G, 0)  # row_ok, and nothing in an empty split

    q_rows = q_ptr + t_glob * stride_qt + head * stride_qh
    if DK_CHUNK == 0:
        offs_dk = tl.arange(0, BLOCK_DK)
        q = tl.load(q_rows[:, None] + offs_dk[None, :],
                    mask=row_live[:, None] & (offs_dk[None, :] < DK), other=0.0)
    else:
        q = row_ok  # unused: _attend_tile reads the query in slices
    if D_PE > 0:
        offs_pe = tl.arange(0, D_PE)
        q_pe = tl.load(
            qpe_ptr + t_glob[:, None] * stride_qpt + head[:, None] * stride_qph
            + offs_pe[None, :],
            mask=row_live[:, None], other=0.0,
        )
    else:
        q_pe = q
    if INTERPRET:
        q = q.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # the tail block (TAIL_M > 0; the plan allows it only with DK_CHUNK == 0 and D_PE == 0):
    # rows from the end of the last full block, live in the last program only
    last_block = pid_m == tl.num_programs(0) - 1
    if TAIL_M > 0:
        rows_t = tl.num_programs(0) * BLOCK_M + tl.arange(0, TAIL_M)
        row_ok_t = (rows_t < N * G) & last_block
        row_live_t = row_ok_t & live
        tok_t = rows_t // G
        head_t = kvh * G + rows_t % G
        t_glob_t = (b * N + tok_t).to(tl.int64)
        q_rows_t = q_ptr + t_glob_t * stride_qt + head_t * stride_qh
        q_t = tl.load(q_rows_t[:, None] + offs_dk[None, :],
                      mask=row_live_t[:, None] & (offs_dk[None, :] < DK), other=0.0)
        if INTERPRET:
            q_t = q_t.to(tl.float32)
        acc_t = tl.zeros([TAIL_M, BLOCK_DV], dtype=tl.float32)
        m_t = tl.full([TAIL_M], float("-inf"), dtype=tl.float32)
        l_t = tl.zeros([TAIL_M], dtype=tl.float32)
    else:  # placeholders, never read
        row_ok_t = row_ok
        tok_t = tok
        q_t = q
        acc_t = 0.0
        m_t = 0.0
        l_t = 0.0

    k_base = k_ptr + kvh.to(tl.int64) * stride_kh
    v_base = v_ptr + kvh.to(tl.int64) * stride_vh

    # the interpreter walks the same tiles with a while loop; compiled code keeps range(),
    # which Triton software-pipelines
    if INTERPRET:
        n0 = start
        while n0 < end:
            acc, m_i, l_i, acc_t, m_t, l_t = _prefix_tile(
                n0, end, acc, m_i, l_i, q, q_pe, q_rows, k_base, v_base, kv_table_ptr, row_base,
                row_ok, stride_kt, stride_vt, qk_scale, logit_cap, dv0,
                acc_t, m_t, l_t, q_t, row_ok_t, BLOCK_N,
                DK, BLOCK_DK, D_PE, DV, BLOCK_DV, SHARED_KV, HAS_CAP, INTERPRET, DV_SPLIT,
                DK_CHUNK, TAIL_M)
            n0 += BLOCK_N
    else:
        for n0 in range(start, end, BLOCK_N):
            acc, m_i, l_i, acc_t, m_t, l_t = _prefix_tile(
                n0, end, acc, m_i, l_i, q, q_pe, q_rows, k_base, v_base, kv_table_ptr, row_base,
                row_ok, stride_kt, stride_vt, qk_scale, logit_cap, dv0,
                acc_t, m_t, l_t, q_t, row_ok_t, BLOCK_N,
                DK, BLOCK_DK, D_PE, DV, BLOCK_DV, SHARED_KV, HAS_CAP, INTERPRET, DV_SPLIT,
                DK_CHUNK, TAIL_M)

    if split == num_splits - 1:
        # tree tokens: a row only sees ancestors, which precede it in node order, so keys past
        # the block's last token are never needed (a bound that depends on pid alone; the last
        # program's tail rows reach the last token); an unordered mask (the drafter's
        # bidirectional block) needs all N
        if ORDERED_MASK:
            last_tok = tl.minimum((pid_m + 1) * BLOCK_M - 1, N * G - 1) // G
            if TAIL_M > 0:
                last_tok = tl.where(last_block, N - 1, last_tok)
        else:
            last_tok = N - 1
        mask_row = tree_mask_ptr + b.to(tl.int64) * stride_mb + tok * stride_mi
        mask_row_t = tree_mask_ptr + b.to(tl.int64) * stride_mb + tok_t * stride_mi
        loc_row = tree_loc_ptr + b.to(tl.int64) * N
        if INTERPRET:
            j0 = 0
            while j0 <= last_tok:
                acc, m_i, l_i, acc_t, m_t, l_t = _tree_tile(
                    j0, N, acc, m_i, l_i, q, q_pe, q_rows, k_base, v_base, loc_row, mask_row,
                    row_ok, stride_kt, stride_vt, qk_scale, logit_cap, dv0,
                    acc_t, m_t, l_t, q_t, mask_row_t, row_ok_t, BLOCK_N,
                    DK, BLOCK_DK, D_PE, DV, BLOCK_DV, SHARED_KV, HAS_CAP, INTERPRET, DV_SPLIT,
                    DK_CHUNK, TAIL_M)
                j0 += BLOCK_N
        else:
            for j0 in range(0, last_tok + 1, BLOCK_N):
                acc, m_i, l_i, acc_t, m_t, l_t = _tree_tile(
                    j0, N, acc, m_i, l_i, q, q_pe, q_rows, k_base, v_base, loc_row, mask_row,
                    row_ok, stride_kt, stride_vt, qk_scale, logit_cap, dv0,
                    acc_t, m_t, l_t, q_t, mask_row_t, row_ok_t, BLOCK_N,
                    DK, BLOCK_DK, D_PE, DV, BLOCK_DV, SHARED_KV, HAS_CAP, INTERPRET, DV_SPLIT,
                    DK_CHUNK, TAIL_M)

    _epilogue(acc, m_i, l_i, row_ok, row_live, tok, head, t_glob, b, split, dvp, dv0,
              Hq, num_splits, o_ptr, part_o_ptr, part_lse_ptr, v_scale,
              stride_ot, stride_oh, pre_o_ptr, pre_lse_ptr, stride_pot, stride_poh,
              stride_plb, stride_plh, stride_pln, DV, BLOCK_DV, SPLIT, MERGE_PREFIX)
    if TAIL_M > 0:
        _epilogue(acc_t, m_t, l_t, row_ok_t, row_live_t, tok_t, head_t, t_glob_t, b,
                  split, dvp, dv0, Hq, num_splits, o_ptr, part_o_ptr, part_lse_ptr, v_scale,
                  stride_ot, stride_oh, pre_o_ptr, pre_lse_ptr, stride_pot, stride_poh,
                  stride_plb, stride_plh, stride_pln, DV, BLOCK_DV, SPLIT, MERGE_PREFIX)


# The same kernel for tree verify, with N and the mask strides (N, N x N) not specialized, so
# every budget runs one binary: the one the verify benchmarks timed (budgets 8 / 16 / 32 / 64,
# N never a multiple of 16). At N = 32 / 64 (budgets 31 / 63) Triton's divisible-by-16
# specialization of the three compiled the MLA tile (32 x 64, 4 warps) to 116,736 bytes of
# shared memory, one program per H200 SM, where the split planner counts two (split_count's
# slots; N = 33: 114,688 bytes, two). In the Kimi profile budget 31's verify attention took
# 32.6 us a call against budget 32's 26.4
# (bench_results/profile_step_kimi_l8_int4_b7_b31_h200_s30.json).
# scripts/tree_verify_static.py --budget compiles either; tests/test_tree_verify_static.py
# holds the served MLA tiles to two. The drafter's block (N = 16, unordered mask) keeps
# _tree_attn_fwd_kernel, the specialized binary its benchmarks timed (session 24).
_tree_attn_verify_kernel = triton.jit(do_not_specialize=("N", "stride_mb", "stride_mi"))(
    _tree_attn_fwd_kernel.fn)


@triton.jit
def _weighted_part(part_o_ptr, ph, s, w, offs_s, offs_dv, DV: tl.constexpr):
    # split s's partial output times its softmax weight; an empty split (weight 0, its partial
    # never written) is not read
    w_s = tl.sum(tl.where(offs_s == s, w, 0.0), 0)
    part = tl.load(part_o_ptr + (ph + s) * DV + offs_dv,
                   mask=offs_dv < tl.where(w_s > 0.0, DV, 0), other=0.0)
    return w_s * part


@triton.jit
def _weighted_chunk(part_o_ptr, part_lse_ptr, ph, s0, num_splits, m, w_sum, offs_dv,
                    DV: tl.constexpr, CHUNK_S: tl.constexpr):
    """Splits s0 .. s0 + CHUNK_S - 1: their partial outputs times their softmax weights,
    summed over the splits (an empty split, weight 0, is not read)."""
    offs_c = s0 + tl.arange(0, CHUNK_S)
    lse_c = tl.load(part_lse_ptr + ph + offs_c, mask=offs_c < num_splits, other=float("-inf"))
    w_c = tl.exp2(lse_c - m) / w_sum
    part = tl.load(part_o_ptr + (ph + offs_c)[:, None] * DV + offs_dv[None, :],
                   mask=(w_c > 0.0)[:, None] & (offs_dv < DV)[None, :], other=0.0)
    return tl.sum(w_c[:, None] * part, 0)


@triton.jit
def _tree_attn_reduce_kernel(
    part_o_ptr,       # [T, Hq, num_splits, DV] fp32
    part_lse_ptr,     # [T, Hq, num_splits] fp32 (log2 domain, -inf for empty splits)
    o_ptr,            # [T, Hq, DV]
    v_scale,
    stride_ot, stride_oh,
    Hq, num_splits,
    BLOCK_S: tl.constexpr,  # next power of two >= num_splits
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, INTERPRET: tl.constexpr,
    # > 1: sum that many splits per step as a [CHUNK_S, BLOCK_DV] tile, each thread's columns
    # in registers; 1: a split per step, its weight picked out of the weight vector by a
    # block-wide sum (a barrier per split). Both fixed order, deterministic; _reduce_chunk
    # says which rows take which.
    CHUNK_S: tl.constexpr = 1,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ph = (t * Hq + h) * num_splits
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(part_lse_ptr + ph + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    # m is finite whenever the row saw any key; rows that saw none (a padded request with an
    # empty prefix and an all-false mask row) get zeros rather than NaN
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    w_sum = tl.sum(w, 0)
    w_sum = tl.where(w_sum == 0.0, 1.0, w_sum)
    offs_dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    if CHUNK_S > 1:
        if INTERPRET:
            s0 = 0
            while s0 < num_splits:
                acc += _weighted_chunk(part_o_ptr, part_lse_ptr, ph, s0, num_splits, m, w_sum,
                                       offs_dv, DV, CHUNK_S)
                s0 += CHUNK_S
        else:
            for s0 in range(0, num_splits, CHUNK_S):
                acc += _weighted_chunk(part_o_ptr, part_lse_ptr, ph, s0, num_splits, m, w_sum,
                                       offs_dv, DV, CHUNK_S)
    else:
        w = w / w_sum
        if INTERPRET:
            s = 0
            while s < num_splits:
                acc += _weighted_part(part_o_ptr, ph, s, w, offs_s, offs_dv, DV)
                s += 1
        else:
            for s in range(num_splits):
                acc += _weighted_part(part_o_ptr, ph, s, w, offs_s, offs_dv, DV)
    tl.store(o_ptr + t * stride_ot + h * stride_oh + offs_dv,
             (acc * v_scale).to(o_ptr.dtype.element_ty), mask=offs_dv < DV)


# --------------------------------------------------------------------------------------------
# Host side: planning (allocates, not graph-safe) and running (launch-only, graph-safe)
# --------------------------------------------------------------------------------------------

def _check(cond: bool, what: str, expected, actual) -> None:
    if not cond:
        raise ValueError(f"tree attention: {what}: expected {expected}, got {actual}")


class TreeAttention:
    """Tree-verify attention (MHA / GQA) over a paged KV cache.

    Use :meth:`plan` once (at model init or before CUDA-graph capture) and :meth:`run` per layer
    per step. ``plan`` allocates and sizes everything; it is NOT graph-safe. ``run`` only launches
    kernels with grids fixed by the batch size and the planned sizes: it is CUDA-graph safe (no host
    syncs, no data-dependent grids, no allocations when ``out`` is given).

    Attributes
    ----------
    num_tree_tokens : int
        N = budget + 1 query tokens per request.
    max_splits : int
        Upper bound on prefix splits; the split count for a batch size is :meth:`num_splits`.
    """

    def __init__(self, *, max_batch_size: int, num_tree_tokens: int, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, v_head_dim: int, rope_dim: int,
                 max_context_len: int, device, sm_scale: float, logit_cap: float,
                 num_kv_splits: Optional[int], config: Optional[KernelConfig],
                 shared_kv: bool, ordered_mask: bool = True,
                 merge_config: Optional[KernelConfig] = None):
        self.device = torch.device(device)
        self.ordered_mask = bool(ordered_mask)
        self.max_batch_size = int(max_batch_size)
        self.num_tree_tokens = int(num_tree_tokens)
        self.num_q_heads = int(num_q_heads)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)            # DK: dims of the dot product besides rope_dim
        self.rope_dim = int(rope_dim)            # D_PE: MLA rope dims stored after head_dim
        self.v_head_dim = int(v_head_dim)
        self.max_context_len = int(max_context_len)
        self.sm_scale = float(sm_scale)
        self.logit_cap = float(logit_cap)
        self.shared_kv = shared_kv
        _check(self.num_q_heads % self.num_kv_heads == 0, "num_q_heads % num_kv_heads",
               0, self.num_q_heads % self.num_kv_heads)
        _check(self.num_tree_tokens >= 1, "num_tree_tokens", ">= 1", self.num_tree_tokens)
        _check(self.rope_dim in (0, 16, 32, 64, 128), "rope_dim", "0 or a power of two >= 16",
               self.rope_dim)
        self.group = self.num_q_heads // self.num_kv_heads
        self._num_sms = _num_sms(self.device)
        rows = self.num_tree_tokens * self.group
        # one config per batch size (each batch size is its own CUDA graph, so the choice is
        # static): the default tile, or another where the batch size decides (_batch_config)
        self.config = config or _default_config(self.head_dim, self.rope_dim, self.v_head_dim,
                                                rows, self.device)
        self._configs = {}
        for bs in range(1, self.max_batch_size + 1):
            chosen = None if config else _batch_config(
                self.head_dim, self.rope_dim, self.v_head_dim, rows, bs * self.num_kv_heads,
                self.device)
            self._configs[bs] = chosen or self.config
        # the launch that attends the tree keys alone and merges a prefix part given by
        # another kernel (run(prefix_out=)): its own tile (_merge_config), not the full verify's
        self._merge_config = merge_config or _merge_config(
            self.head_dim, self.rope_dim, self.v_head_dim, self.device)
        for cfg in set(self._configs.values()) | ({self._merge_config} - {None}):
            dvs = cfg.dv_split
            _check(dvs >= 1 and dvs & (dvs - 1) == 0
                   and triton.next_power_of_2(self.v_head_dim) % dvs == 0
                   and triton.next_power_of_2(self.v_head_dim) // dvs >= 16, "config.dv_split",
                   "a power of two leaving at least 16 columns per program", dvs)
            dkc = cfg.dk_chunk
            _check(dkc == 0 or (dkc >= 16 and dkc & (dkc - 1) == 0
                                and triton.next_power_of_2(self.head_dim) % dkc == 0),
                   "config.dk_chunk", "0 or a power of two >= 16 dividing the padded head dim",
                   dkc)
            _check(cfg.min_split_keys >= 1, "config.min_split_keys", ">= 1", cfg.min_split_keys)
            tm = cfg.tail_m
            _check(tm == 0 or (tm >= 16 and tm & (tm - 1) == 0 and cfg.dk_chunk == 0
                               and self.rope_dim == 0),
                   "config.tail_m", "0, or a power of two >= 16 without dk_chunk or rope dims",
                   (tm, cfg.dk_chunk, self.rope_dim))
        self._fixed_splits = num_kv_splits
        # static per batch size: computed once here, read by every run
        self._splits = {bs: self._count_splits(bs) for bs in range(1, self.max_batch_size + 1)}
        self.max_splits = max(self._splits.values())
        # partial buffers hold bs * N * Hq * S rows; S shrinks as bs grows, so size for the max
        rows = max(bs * splits for bs, splits in self._splits.items())
        rows = rows * self.num_tree_tokens * self.num_q_heads if self.max_splits > 1 else 1
        self.part_o = torch.empty(rows * self.v_head_dim, dtype=torch.float32, device=self.device)
        self.part_lse = torch.empty(rows, dtype=torch.float32, device=self.device)

    @classmethod
    def plan(cls, *, max_batch_size: int, num_tree_tokens: int, num_q_heads: int,
             num_kv_heads: int, head_dim: int, max_context_len: int, device,
             v_head_dim: Optional[int] = None, sm_scale: Optional[float] = None,
             logit_cap: float = 0.0, num_kv_splits: Optional[int] = None,
             config: Optional[KernelConfig] = None,
             ordered_mask: bool = True,
             merge_config: Optional[KernelConfig] = None) -> "TreeAttention":
        """Size and allocate everything for MHA/GQA tree verify (not graph-safe).

        Parameters
        ----------
        max_batch_size : int
            Largest batch ``run`` will see (the largest captured batch size).
        num_tree_tokens : int
            N = budget + 1.
        num_q_heads, num_kv_heads, head_dim : int
            Per-rank head counts and the q/k head dim; ``v_head_dim`` defaults to ``head_dim``.
        max_context_len : int
            Longest prefix; bounds the split count (chunks of at least 256 keys).
        sm_scale : float, optional
            Softmax scale, default ``head_dim ** -0.5``. ``logit_cap`` > 0 enables
            ``cap * tanh(s / cap)`` on the scaled logits.
        num_kv_splits : int, optional
            Fixed prefix split count (1 disables split-K); default picks per batch size.
        ordered_mask : bool
            True (a tree): no row's mask admits a later token, so a row block skips the tree
            keys past its last token. False: any mask (the drafter's bidirectional block);
            every row block reads all N tree keys.
        merge_config : KernelConfig, optional
            Tile of the launches that merge a prefix part given by another kernel
            (``run(prefix_out=)``); default: the plan's merge tile (see ``merge_config_for``).
        """
        return cls(max_batch_size=max_batch_size, num_tree_tokens=num_tree_tokens,
                   num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   v_head_dim=v_head_dim or head_dim, rope_dim=0,
                   max_context_len=max_context_len, device=device,
                   sm_scale=sm_scale if sm_scale is not None else head_dim ** -0.5,
                   logit_cap=logit_cap, num_kv_splits=num_kv_splits, config=config,
                   shared_kv=False, ordered_mask=ordered_mask, merge_config=merge_config)

    def config_for(self, batch_size: int) -> KernelConfig:
        """The kernel config ``run`` launches for ``batch_size`` requests."""
        return self._configs.get(int(batch_size), self.config)

    def merge_config_for(self, batch_size: int) -> KernelConfig:
        """The kernel config of a launch that merges a given prefix part
        (``run(prefix_out=, prefix_lse=)``: the tree keys alone, one split) for ``batch_size``
        requests: the plan's merge tile where it has one (see _merge_config), else the full
        launch's."""
        return self._merge_config or self.config_for(batch_size)

    def _launch_config(self, batch_size: Optional[int], merge: bool) -> KernelConfig:
        if batch_size is None:
            return self.config
        return self.merge_config_for(batch_size) if merge else self.config_for(batch_size)

    def tail_rows(self, batch_size: Optional[int] = None, merge: bool = False) -> int:
        """TAIL_M of the launch for ``batch_size``: the config's tail_m where the rows past the
        last full block fit it (see KernelConfig.tail_m), else 0. ``merge``: of the launch
        that merges a given prefix part."""
        cfg = self._launch_config(batch_size, merge)
        rows = self.num_tree_tokens * self.group
        extra = rows % cfg.block_m
        return cfg.tail_m if cfg.tail_m and rows > cfg.block_m and extra <= cfg.tail_m \
            and extra else 0

    def num_blocks_m(self, batch_size: Optional[int] = None, merge: bool = False) -> int:
        cfg = self._launch_config(batch_size, merge)
        rows = self.num_tree_tokens * self.group
        if self.tail_rows(batch_size, merge):
            return rows // cfg.block_m  # the leftover rows ride with the last block
        return triton.cdiv(rows, cfg.block_m)

    def num_splits(self, batch_size: int) -> int:
        """Prefix splits used for ``batch_size`` requests (a pure function of static sizes)."""
        splits = self._splits.get(int(batch_size))
        return self._count_splits(batch_size) if splits is None else splits

    def _count_splits(self, batch_size: int) -> int:
        if self._fixed_splits is not None:
            return max(1, int(self._fixed_splits))
        cfg = self.config_for(batch_size)
        programs = batch_size * self.num_kv_heads * self.num_blocks_m(batch_size) * cfg.dv_split
        # at most one split per min_split_keys keys of the longest context (the buffers are
        # sized from it at plan time, so it is fixed there)
        cap = max(1, self.max_context_len // cfg.min_split_keys)
        # and the fp32 partial outputs of a launch within _PARTIAL_BYTES (each split's are
        # written and read back by the reduce: at short prefixes that traffic is the cost)
        per_split = batch_size * self.num_tree_tokens * self.num_q_heads * self.v_head_dim * 4
        max_splits = max(1, min(64, _PARTIAL_BYTES // per_split))
        if _latent_rows(self.head_dim, self.rope_dim, self.v_head_dim):
            # MLA's latent rows: whole waves (H200 A/B of both rules, 60 points,
            # bench_results/tree_verify_ab_splits_h200_s19.json: never slower beyond 1.3 %,
            # up to 1.67x faster, geometric mean 1.18x)
            return split_count(programs, mla_programs_per_sm(cfg, self.device) * self._num_sms,
                               cap, max_splits=max_splits)
        return mha_split_count(programs, self._num_sms, cfg.num_warps, cap, max_splits)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            out_cache_loc: torch.Tensor, tree_mask: torch.Tensor, *,
            req_to_token: Optional[torch.Tensor] = None,
            req_pool_indices: Optional[torch.Tensor] = None,
            seq_lens: Optional[torch.Tensor] = None,
            kv_indptr: Optional[torch.Tensor] = None,
            kv_indices: Optional[torch.Tensor] = None,
            k_scale: float = 1.0, v_scale: float = 1.0,
            out: Optional[torch.Tensor] = None, validate: bool = True,
            prefix_out: Optional[torch.Tensor] = None,
            prefix_lse: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tree-verify attention for one layer. CUDA-graph safe.

        Parameters
        ----------
        q : [bs * N, Hq, head_dim] bf16/fp16
            Queries, request-major in node order. Last dim contiguous.
        k_cache, v_cache : [num_slots, Hkv, head_dim] / [num_slots, Hkv, v_head_dim]
            The layer's KV cache (bf16/fp16, or fp8 e4m3/e5m2 with ``k_scale``/``v_scale``).
        out_cache_loc : [bs * N] int32/int64
            Cache slots holding the tree tokens' K/V (already written).
        tree_mask : [bs, N, N] bool/uint8
            Ancestor-or-self mask: row i may attend tree token j iff ``tree_mask[b, i, j]``.
            Unless the plan has ``ordered_mask=False``, no row may admit a later token
            (``j > i``): those keys are skipped, not read.
        req_to_token, req_pool_indices, seq_lens : optional
            Table mode: ``[pool, max_ctx]`` int32 slot table, ``[bs]`` rows, ``[bs]`` prefix
            lengths (tokens before the tree, as SGLang's TARGET_VERIFY ``seq_lens``).
        kv_indptr, kv_indices : optional
            Flat mode instead of the table: ``[bs + 1]`` offsets into ``[total]`` prefix slots.
        out : [bs * N, Hq, v_head_dim], optional
            Written in place (pass a preallocated buffer inside graphs).
        prefix_out, prefix_lse : optional, together
            The prefix part computed elsewhere: ``[bs * N, Hq, v_head_dim]`` attention of each
            row over its request's prefix alone (normalised, any float dtype) and ``[bs, Hq, N]``
            fp32 natural-log log-sum-exp of its scaled scores (any strides; -inf for an empty
            prefix). Then only the tree keys are read here, in one split, and the two parts are
            merged (exact up to rounding). No logit cap.

        Returns
        -------
        out : [bs * N, Hq, v_head_dim], dtype of ``q``.
        """
        if validate:
            self._validate(q, k_cache, v_cache, out_cache_loc, tree_mask, req_to_token,
                           req_pool_indices, seq_lens, kv_indptr, kv_indices, out)
            self._validate_prefix(q, prefix_out, prefix_lse)
        return self._launch(q, k_cache, v_cache, out_cache_loc, tree_mask, req_to_token,
                            req_pool_indices, seq_lens, kv_indptr, kv_indices, k_scale,
                            v_scale, out, prefix_out, prefix_lse)

    # ---- internals --------------------------------------------------------------------------

    def _validate(self, q, k_cache, v_cache, out_cache_loc, tree_mask, req_to_token,
                  req_pool_indices, seq_lens, kv_indptr, kv_indices, out, q_pe=None) -> None:
        n, hq = self.num_tree_tokens, self.num_q_heads
        dq = self.head_dim + self.rope_dim
        if q_pe is not None:  # the rope part apart: q holds the first head_dim dims only
            _check(self.rope_dim > 0, "q_pe", "None (this plan has no rope dims)", "a tensor")
            _check(q.dim() == 3 and q.shape[1:] == (hq, self.head_dim)
                   and q.shape[0] % n == 0, "q shape (with q_pe)",
                   f"[bs*{n}, {hq}, {self.head_dim}]", tuple(q.shape))
            _check(tuple(q_pe.shape) == (q.shape[0], hq, self.rope_dim), "q_pe shape",
                   (q.shape[0], hq, self.rope_dim), tuple(q_pe.shape))
            _check(q_pe.dtype == q.dtype, "q_pe dtype", q.dtype, q_pe.dtype)
            _check(q_pe.stride(-1) == 1, "q_pe last-dim stride", 1, q_pe.stride(-1))
        else:
            _check(q.dim() == 3 and q.shape[1:] == (hq, dq) and q.shape[0] % n == 0, "q shape",
                   f"[bs*{n}, {hq}, {dq}]", tuple(q.shape))
        bs = q.shape[0] // n
        _check(1 <= bs <= self.max_batch_size, "batch size", f"1..{self.max_batch_size}", bs)
        _check(q.dtype in (torch.bfloat16, torch.float16), "q dtype", "bf16/fp16", q.dtype)
        _check(q.stride(-1) == 1, "q last-dim stride", 1, q.stride(-1))
        _check(k_cache.dim() == 3 and k_cache.shape[1:] == (self.num_kv_heads, dq),
               "k_cache shape", f"[slots, {self.num_kv_heads}, {dq}]", tuple(k_cache.shape))
        _check(k_cache.stride(-1) == 1, "k_cache last-dim stride", 1, k_cache.stride(-1))
        if not self.shared_kv:
            _check(v_cache.dim() == 3 and v_cache.shape[1] == self.num_kv_heads
                   and v_cache.shape[2] == self.v_head_dim, "v_cache shape",
                   f"[slots, {self.num_kv_heads}, {self.v_head_dim}]", tuple(v_cache.shape))
            _check(v_cache.stride(-1) == 1, "v_cache last-dim stride", 1, v_cache.stride(-1))
        ok_kv = (q.dtype, torch.uint8) + _FP8_DTYPES
        _check(k_cache.dtype in ok_kv, "k_cache dtype", ok_kv, k_cache.dtype)
        _check(tuple(out_cache_loc.shape) == (bs * n,), "out_cache_loc shape", (bs * n,),
               tuple(out_cache_loc.shape))
        _check(tuple(tree_mask.shape) == (bs, n, n) and tree_mask.stride(-1) == 1,
               "tree_mask shape", f"({bs}, {n}, {n}) with last-dim stride 1",
               tuple(tree_mask.shape))
        _check(tree_mask.dtype in (torch.bool, torch.uint8), "tree_mask dtype", "bool/uint8",
               tree_mask.dtype)
        if kv_indptr is not None:
            _check(req_to_token is None, "kv index mode", "either kv_indptr or req_to_token",
                   "both")
            _check(tuple(kv_indptr.shape) == (bs + 1,), "kv_indptr shape", (bs + 1,),
                   tuple(kv_indptr.shape))
            _check(kv_indices is not None, "kv_indices", "a tensor with kv_indptr", None)
        else:
            _check(req_to_token is not None and req_pool_indices is not None
                   and seq_lens is not None, "kv index mode",
                   "req_to_token + req_pool_indices + seq_lens, or kv_indptr + kv_indices",
                   "neither complete")
            _check(tuple(req_pool_indices.shape) == (bs,), "req_pool_indices shape", (bs,),
                   tuple(req_pool_indices.shape))
            _check(tuple(seq_lens.shape) == (bs,), "seq_lens shape", (bs,),
                   tuple(seq_lens.shape))
            _check(req_to_token.stride(-1) == 1, "req_to_token last-dim stride", 1,
                   req_to_token.stride(-1))
        if out is not None:
            _check(tuple(out.shape) == (bs * n, hq, self.v_head_dim) and out.stride(-1) == 1,
                   "out shape", (bs * n, hq, self.v_head_dim), tuple(out.shape))
            _check(out.dtype == q.dtype, "out dtype", q.dtype, out.dtype)
        for name, t in (("q", q), ("k_cache", k_cache), ("out_cache_loc", out_cache_loc),
                        ("tree_mask", tree_mask)):
            _check(t.device == self.device or self.device.type == t.device.type,
                   f"{name} device", self.device, t.device)

    def _validate_prefix(self, q, prefix_out, prefix_lse) -> None:
        _check((prefix_out is None) == (prefix_lse is None), "prefix_out / prefix_lse",
               "both or neither", "one of them")
        if prefix_out is None:
            return
        n, hq = self.num_tree_tokens, self.num_q_heads
        bs = q.shape[0] // n
        _check(self.logit_cap == 0.0, "logit cap with a given prefix", 0.0, self.logit_cap)
        _check(tuple(prefix_out.shape) == (bs * n, hq, self.v_head_dim)
               and prefix_out.stride(-1) == 1, "prefix_out shape",
               f"[{bs * n}, {hq}, {self.v_head_dim}] with last-dim stride 1",
               tuple(prefix_out.shape))
        _check(tuple(prefix_lse.shape) == (bs, hq, n) and prefix_lse.dtype == torch.float32,
               "prefix_lse", f"[{bs}, {hq}, {n}] float32",
               f"{tuple(prefix_lse.shape)} {prefix_lse.dtype}")

    def _launch(self, q, k_cache, v_cache, out_cache_loc, tree_mask, req_to_token,
                req_pool_indices, seq_lens, kv_indptr, kv_indices, k_scale, v_scale, out,
                prefix_out=None, prefix_lse=None, q_pe=None):
        n = self.num_tree_tokens
        bs = q.shape[0] // n
        if q_pe is None:  # the rope dims follow the head dims in q (none for MHA: unread)
            q_pe = q[..., self.head_dim:] if self.rope_dim else q
        if out is None:
            out = torch.empty((q.shape[0], self.num_q_heads, self.v_head_dim), dtype=q.dtype,
                              device=q.device)
        if k_cache.dtype == torch.uint8:  # SGLang stores fp8 caches as uint8
            k_cache = k_cache.view(torch.float8_e4m3fn)
        if self.shared_kv:
            v_cache = k_cache
        elif v_cache.dtype == torch.uint8:
            v_cache = v_cache.view(torch.float8_e4m3fn)
        if tree_mask.dtype == torch.bool:
            tree_mask = tree_mask.view(torch.uint8)
        use_indptr = kv_indptr is not None
        if use_indptr:
            table, rows, lens, stride_table = kv_indices, kv_indptr, kv_indptr, 0
        else:
            table, rows, lens = req_to_token, req_pool_indices, seq_lens
            stride_table = req_to_token.stride(0)
        merge = prefix_out is not None
        splits = 1 if merge else self.num_splits(bs)  # the tree keys alone: one split
        cfg = self._launch_config(bs, merge)
        has_cap = self.logit_cap > 0.0
        if not merge:  # unread (MERGE_PREFIX off): any tensors, zero strides
            prefix_out, prefix_lse = out, self.part_lse
            po_strides, pl_strides = (0, 0), (0, 0, 0)
        else:
            po_strides = (prefix_out.stride(0), prefix_out.stride(1))
            pl_strides = (prefix_lse.stride(0), prefix_lse.stride(1), prefix_lse.stride(2))
        qk_scale = self.sm_scale * float(k_scale) * (1.0 if has_cap else _LOG2E)
        part_o, part_lse = self.part_o, self.part_lse
        grid = (self.num_blocks_m(bs, merge), self.num_kv_heads * splits * cfg.dv_split, bs)
        kernel = _tree_attn_verify_kernel if self.ordered_mask else _tree_attn_fwd_kernel
        kernel[grid](
            q, k_cache, v_cache, out, part_o, part_lse,
            table, rows, lens, out_cache_loc, tree_mask,
            n, splits, qk_scale, float(v_scale), self.logit_cap,
            q.stride(0), q.stride(1), q_pe, q_pe.stride(0), q_pe.stride(1),
            k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
            stride_table, tree_mask.stride(0), tree_mask.stride(1),
            prefix_out, prefix_lse, *po_strides, *pl_strides,
            G=self.group, DK=self.head_dim, BLOCK_DK=triton.next_power_of_2(self.head_dim),
            D_PE=self.rope_dim, DV=self.v_head_dim,
            BLOCK_DV=triton.next_power_of_2(self.v_head_dim) // cfg.dv_split,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=splits > 1,
            USE_INDPTR=use_indptr, SHARED_KV=self.shared_kv, HAS_CAP=has_cap,
            INTERPRET=_INTERPRET, DV_SPLIT=cfg.dv_split, DK_CHUNK=cfg.dk_chunk,
            MIN_CHUNK=cfg.min_split_keys, MERGE_PREFIX=merge, ORDERED_MASK=self.ordered_mask,
            TAIL_M=self.tail_rows(bs, merge), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
        if splits > 1:
            _tree_attn_reduce_kernel[(q.shape[0], self.num_q_heads)](
                part_o, part_lse, out, float(v_scale), out.stride(0), out.stride(1),
                self.num_q_heads, splits, BLOCK_S=triton.next_power_of_2(splits),
                DV=self.v_head_dim, BLOCK_DV=triton.next_power_of_2(self.v_head_dim),
                INTERPRET=_INTERPRET, CHUNK_S=_reduce_chunk(self.v_head_dim, splits),
                num_warps=4 if q.is_cuda else 1,
            )
        return out


def tree_attention(q, k_cache, v_cache, out_cache_loc, tree_mask, *, num_kv_splits=None,
                   sm_scale=None, logit_cap=0.0, config=None, ordered_mask=True,
                   **kv) -> torch.Tensor:
    """One-shot MHA/GQA tree attention (plans then runs; allocates, so NOT graph-safe).

    Shapes as :meth:`TreeAttention.run`; ``kv`` holds the KV index tensors and scales.
    """
    n = tree_mask.shape[-1]
    bs = q.shape[0] // n
    max_ctx = int(kv["kv_indptr"].diff().max()) if kv.get("kv_indptr") is not None else \
        int(kv["seq_lens"].max())
    attn = TreeAttention.plan(
        max_batch_size=bs, num_tree_tokens=n, num_q_heads=q.shape[1],
        num_kv_heads=k_cache.shape[1], head_dim=q.shape[2], v_head_dim=v_cache.shape[2],
        max_context_len=max(max_ctx, 1), device=q.device, sm_scale=sm_scale,
        logit_cap=logit_cap, num_kv_splits=num_kv_splits, config=config,
        ordered_mask=ordered_mask)
    return attn.run(q, k_cache, v_cache, out_cache_loc, tree_mask, **kv)
