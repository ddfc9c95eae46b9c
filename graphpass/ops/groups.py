"""Process groups as the custom ops see them: by name, so that a group can be a graph constant."""

from __future__ import annotations

import torch
import torch.distributed

from graphpass import _torch_api


def group_name(group) -> str:
    """The name an op carries for `group`; None is the default group, or "" for a single process
    without torch.distributed."""
    if group is None:
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return ""
        group = torch.distributed.group.WORLD
    if not isinstance(group, torch.distributed.ProcessGroup):
        raise ValueError(f"graphpass: group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    return group.group_name


def rank_and_size(name: str):
    """(group, this rank in it, its size); (None, 0, 1) for the single-process name ""."""
    if not name:
        return None, 0, 1
    group = _torch_api.resolve_process_group(name)
    return group, group.rank(), group.size()


#: The name of the collective `all_gather` issues on this torch (what a log of the eager calls shows).
ALL_GATHER = _torch_api.all_gather_into_tensor().__name__


def all_gather(output, tensor, group) -> None:
    """Gather every rank's `tensor` into `output` ([size * n, ...])."""
    _torch_api.all_gather_into_tensor()(output, tensor, group=group)
