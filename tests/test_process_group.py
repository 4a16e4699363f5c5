"""qpalette/distributed.py: a user error on any rank is raised as itself in the caller; the
device lists several-device runs accept."""

from __future__ import annotations

import pytest
import torch

from qpalette.distributed import Group, check_devices, spawn
from qpalette.errors import CompressError

CPU = torch.device("cpu")


def _fails_on_rank_1(group: Group) -> None:
    if group.rank == 1:
        raise CompressError("rank one refuses")
    group.broadcast(None)  # rank 0 waits for a peer that is gone: its own failure must not hide the cause


@pytest.mark.parametrize("attempt", range(2))
def test_a_user_error_on_another_rank_is_raised_as_itself(attempt):
    with pytest.raises(CompressError, match="rank one refuses"):
        spawn(_fails_on_rank_1, [CPU, CPU])


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cuda:0", "cuda:1"], ["cuda:1"], ["cuda"]])
def test_device_lists_accepted(devices):
    check_devices([torch.device(d) for d in devices], CompressError)


@pytest.mark.parametrize("devices,says", [(["cpu", "cuda:0"], "of one kind"), (["cuda:0", "cuda:0"], "each GPU once"),
                                          (["cuda", "cuda"], "each GPU once")])
def test_device_lists_refused(devices, says):
    with pytest.raises(CompressError, match=says):
        check_devices([torch.device(d) for d in devices], CompressError)
