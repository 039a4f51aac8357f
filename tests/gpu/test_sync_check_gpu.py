"""SyncCheck on CUDA: a synchronizing op inside a step is caught at its line; none is not."""

import pytest
import torch

from sglang_ddtree.sync_check import SyncCheck

pytestmark = pytest.mark.gpu


def test_an_item_call_is_caught_where_it_happens():
    check = SyncCheck(enabled=True)
    x = torch.ones(4, device="cuda")
    with check.step():
        y = (x * 2).sum()  # no sync
    assert check.syncs == 0 and check.steps == 1
    with check.step():
        y.item()  # sync
    assert check.syncs == 1 and check.steps == 2
    (site,) = check.sites
    assert site[0].startswith("gpu/test_sync_check_gpu.py:") or "test_sync_check_gpu.py" in \
        " ".join(site), site
    assert torch.cuda.get_sync_debug_mode() == 0  # restored
