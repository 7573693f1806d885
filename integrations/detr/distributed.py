"""torch.distributed helpers: torchrun initialisation (nccl on CUDA, gloo on CPU) and reductions."""
import os

import torch
import torch.distributed as dist


def is_dist_avail_and_initialized():
    return dist.is_available() and dist.is_initialized()


def get_world_size():
    return dist.get_world_size() if is_dist_avail_and_initialized() else 1


def get_rank():
    return dist.get_rank() if is_dist_avail_and_initialized() else 0


def is_main_process():
    return get_rank() == 0


def init_distributed_mode(device="cpu"):
    """Initialises the process group when launched by torchrun (RANK/WORLD_SIZE set); returns (rank, world, local)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, 0
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = str(device).startswith("cuda")
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo", init_method="env://",
                            world_size=world, rank=rank)
    dist.barrier()
    return rank, world, local


def all_reduce_mean_(tensor):
    """In-place mean over processes (no-op when not distributed)."""
    if is_dist_avail_and_initialized():
        dist.all_reduce(tensor)
        tensor /= get_world_size()
    return tensor


def reduce_dict(values, average=True):
    """Reduces a dict of scalar tensors over processes so every rank logs the same numbers."""
    if get_world_size() < 2:
        return {k: v.detach() for k, v in values.items()}
    with torch.no_grad():
        names = sorted(values.keys())
        stacked = torch.stack([values[k].detach().float() for k in names])
        dist.all_reduce(stacked)
        if average:
            stacked /= get_world_size()
        return dict(zip(names, stacked))


def all_gather_object(obj):
    """List of obj from every process (just [obj] when not distributed)."""
    if get_world_size() < 2:
        return [obj]
    out = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out
