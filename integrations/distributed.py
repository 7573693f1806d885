"""torch.distributed helpers shared by the trainers launched with torchrun (DETR's integrations/detr/train.py and
the LM's tools/train_lm.py): initialisation (nccl on CUDA, gloo on CPU), reductions, and a gather of plain Python
values that goes through JSON, never pickle: what one process sends another cannot make it run code (torch's
all_gather_object unpickles)."""
import gc
import json
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


def launched_world_size():
    """Processes torchrun started (its RANK / WORLD_SIZE environment), 1 without torchrun; known before the process
    group exists, so settings that cannot split over the processes are refused before any rendezvous."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 1
    return int(os.environ["WORLD_SIZE"])


def _check_backend(use_cuda, world, local):
    """A clear error instead of one from deep inside init_process_group (or a hang) when the backend is missing."""
    launched = f"launched by torchrun with {world} process(es)"
    if not dist.is_available():
        raise RuntimeError(f"{launched}, but this torch build has no torch.distributed; run without torchrun")
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(f"{launched} on --device cuda, but CUDA is not available here; pass --device cpu to "
                               "train on the CPU (gloo)")
        if not dist.is_nccl_available():
            raise RuntimeError(f"{launched} on --device cuda, but this torch build has no NCCL backend; pass "
                               "--device cpu to train on the CPU (gloo)")
        if local >= torch.cuda.device_count():
            raise RuntimeError(f"{launched}: LOCAL_RANK {local} has no GPU, {torch.cuda.device_count()} visible; "
                               f"start at most {torch.cuda.device_count()} process(es) per node (--nproc_per_node)")
    elif not dist.is_gloo_available():
        raise RuntimeError(f"{launched} on the CPU, but this torch build has no gloo backend; run without torchrun")


def init_distributed_mode(device="cpu"):
    """Initialises the process group when launched by torchrun (RANK/WORLD_SIZE set): nccl with this process on
    cuda:LOCAL_RANK for a CUDA device, gloo on the CPU. Returns (rank, world, local); (0, 1, 0) without torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, 0
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = str(device).startswith("cuda")
    _check_backend(use_cuda, world, local)
    if use_cuda:
        torch.cuda.set_device(local)
    dist.init_process_group(backend="nccl" if use_cuda else "gloo", init_method="env://",
                            world_size=world, rank=rank)
    dist.barrier()
    return rank, world, local


def leave_process_group():
    """Every process waits for the others (so the first one finishes writing its files before any exits: torchrun
    stops the rest when one exits with an error status), then the group is destroyed. No-op when not distributed."""
    if is_dist_avail_and_initialized():
        dist.barrier()
        gc.collect()  # a DDP wrapper the caller dropped may sit in a reference cycle, holding the group
        dist.destroy_process_group()


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


def _encode(obj):
    """Plain values -> JSON-ready values, keeping what JSON would lose: tuples, tensors, non-string dict keys."""
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": obj.detach().cpu().tolist(), "dtype": str(obj.dtype).removeprefix("torch.")}
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v) for v in obj]}
    if isinstance(obj, list):
        return [_encode(v) for v in obj]
    if isinstance(obj, dict):
        return {"__dict__": [[_encode(k), _encode(v)] for k, v in obj.items()]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"all_gather_json sends plain values and tensors only, got {type(obj).__name__}")


def _decode(obj):
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return torch.tensor(obj["__tensor__"], dtype=getattr(torch, obj["dtype"]))
        if "__tuple__" in obj:
            return tuple(_decode(v) for v in obj["__tuple__"])
        return {_decode(k): _decode(v) for k, v in obj["__dict__"]}
    return obj


def all_gather_json(obj):
    """List of obj (plain values and tensors) from every process, through JSON (just [obj] when not
    distributed)."""
    if get_world_size() < 2:
        return [obj]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    data = torch.tensor(list(json.dumps(_encode(obj)).encode()), dtype=torch.uint8, device=device)
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(get_world_size())]
    dist.all_gather(sizes, torch.tensor([data.numel()], device=device))
    longest = max(int(s) for s in sizes)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in sizes]
    dist.all_gather(parts, torch.nn.functional.pad(data, (0, longest - data.numel())))
    return [_decode(json.loads(bytes(part[:int(size)].cpu().tolist()).decode())) for part, size in zip(parts, sizes)]
