"""DraftTopKHead under tensor parallelism: two CPU processes (gloo), vocab-sharded lm_head.

Every rank must produce exactly the single-process top-K (same ids, log-probs within fp32
rounding of the logsumexp merge), hence build the same tree.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sglang_ddtree.draft_topk import DraftTopKHead
from sglang_ddtree.tree import build_tree

V, H, BLOCK, K, BS = 103, 16, 5, 8, 3  # odd vocab: uneven shards


class GlooGroup:
    """The two methods DraftTopKHead uses from SGLang's GroupCoordinator."""

    def __init__(self):
        self.world_size = dist.get_world_size()

    def all_gather_into_tensor(self, out, inp):
        parts = [torch.empty_like(inp) for _ in range(self.world_size)]
        dist.all_gather(parts, inp)
        out.copy_(torch.cat(parts, 0))


def _inputs():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g)
    weight[7] = weight[3]  # exact logit ties across the shard boundary and within a shard
    weight[90] = weight[3]
    hidden = torch.randn(BS * BLOCK, H, generator=g)
    return weight, hidden


def _worker(rank, world, port, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        weight, hidden = _inputs()
        per = -(-V // world)
        start, stop = rank * per, min(V, (rank + 1) * per)
        head = DraftTopKHead(weight=weight[start:stop].contiguous(), block_size=BLOCK, topk=K,
                             num_org=stop - start, org_vocab_start=start, max_bs=BS,
                             tp_group=GlooGroup())
        head(hidden)
        logp, ids = head.read(BS)
        tree = build_tree(torch.arange(BS), logp.clone(), ids.clone(), 12)
        # plain lists: tensors would travel as shared-memory handles that die with this process
        queue.put((rank, logp.tolist(), ids.tolist(), tree.tokens.tolist(), tree.parents.tolist()))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 3])
def test_sharded_head_matches_single_process(world):
    weight, hidden = _inputs()
    ref = DraftTopKHead(weight=weight, block_size=BLOCK, topk=K, num_org=V, org_vocab_start=0,
                        max_bs=BS)
    ref(hidden)
    ref_logp, ref_ids = ref.read(BS)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=240) for _ in range(world))
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    for rank, logp, ids, tokens, parents in results:
        assert ids == ref_ids.tolist(), rank
        assert torch.allclose(torch.tensor(logp), ref_logp, atol=1e-5, rtol=0), rank
        assert tokens == results[0][3] and parents == results[0][4], rank
