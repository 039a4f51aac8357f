"""The test-only oracle draft: lazy file read, planted continuation at the chosen depths/ranks."""

import json
from types import SimpleNamespace

import torch

from sglang_ddtree.config import ENV_ORACLE
from sglang_ddtree.oracle import OracleDraft


def test_file_is_read_at_first_plant_and_continuation_is_planted(tmp_path, monkeypatch):
    path = tmp_path / "oracle.json"
    monkeypatch.setenv(ENV_ORACLE, str(path))
    oracle = OracleDraft.from_env()  # the file does not exist yet: a server may start first
    prompt, output = [5, 6, 7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109]
    batch = SimpleNamespace(seq_lens=torch.tensor([3]),
                            reqs=[SimpleNamespace(origin_input_ids=prompt)])
    ids, logp = torch.arange(8).view(1, 2, 4), torch.zeros(1, 2, 4)
    oracle.plant(batch, logp, ids)  # no file yet (a health check): nothing planted, no error
    assert torch.equal(ids, torch.arange(8).view(1, 2, 4))
    path.write_text(json.dumps({"seed": 3, "items": [{"prompt": prompt, "output": output}]}))
    bs, depth, k = 2, 6, 4
    planted_any = False
    for step in range(20):
        done = step % 5  # tokens of the output already emitted before this step's root
        seq = len(prompt) + done
        batch = SimpleNamespace(seq_lens=torch.tensor([seq, 9]),
                                reqs=[SimpleNamespace(origin_input_ids=prompt),
                                      SimpleNamespace(origin_input_ids=[1, 2])])
        ids = torch.arange(bs * depth * k).view(bs, depth, k) + 1000
        logp = torch.full((bs, depth, k), -1.0)
        before_other = ids[1].clone()
        oracle.plant(batch, logp, ids)
        assert torch.equal(ids[1], before_other)  # unknown prompt: untouched
        for d in range(1, depth + 1):
            row = ids[0, d - 1].tolist()
            assert len(set(row)) == k  # ids stay distinct
            i = done + d
            if i < len(output) and output[i] in row:
                planted_any = True
                assert torch.all(logp[0, d - 1][:-1] >= logp[0, d - 1][1:])  # sorted
    assert planted_any


def test_same_request_gets_the_same_plant_whatever_its_batch(tmp_path, monkeypatch):
    path = tmp_path / "oracle.json"
    prompt, output = [9, 8], list(range(200, 230))
    path.write_text(json.dumps({"seed": 1, "items": [{"prompt": prompt, "output": output}]}))
    monkeypatch.setenv(ENV_ORACLE, str(path))

    def plant(oracle, row, bs, seq):
        reqs = [SimpleNamespace(origin_input_ids=[1])] * bs
        reqs[row] = SimpleNamespace(origin_input_ids=prompt)
        lens = torch.full((bs,), 5)
        lens[row] = seq
        ids = torch.arange(bs * 6 * 4).view(bs, 6, 4) + 1000
        logp = torch.full((bs, 6, 4), -1.0)
        oracle.plant(SimpleNamespace(seq_lens=lens, reqs=reqs), logp, ids)
        return ids[row], logp[row]

    a, b = OracleDraft.from_env(), OracleDraft.from_env()
    for _ in range(3):  # b has taken other steps before
        plant(b, 0, 1, 4)
    planted = False
    for seq in (3, 5, 9, 11, 14, 17):
        ids_a, lp_a = plant(a, 0, 1, seq)
        ids_b, lp_b = plant(b, 2, 4, seq)
        assert torch.equal(lp_a, lp_b)
        assert torch.equal(ids_a < 1000, ids_b < 1000)  # planted ids at the same places
        assert torch.equal(ids_a[ids_a < 1000], ids_b[ids_b < 1000])  # ... and the same tokens
        planted = planted or bool((ids_a < 1000).any())
    assert planted
