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
