"""Ctrl-C / SIGTERM during training: every process finishes its current step, then the run checkpoints and stops.
Used by DETR's trainer (integrations/detr/train.py) and the LM trainer (tools/train_lm.py).

torchrun passes a Ctrl-C on to its workers as SIGTERM; a signal may also reach only some processes (a job
scheduler, a user's kill). Each step ends with the processes agreeing, through one small all-reduce, whether any
of them was asked to stop, so all of them stop after the same step and the checkpoint holds one consistent state.
"""
import signal
import sys
import threading

import torch
import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


class StopRequest:
    """Context manager; ``agreed(device)`` after a step says whether the run should stop there. A second signal
    stops at once (KeyboardInterrupt)."""

    def __init__(self):
        self.local = False
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # Python delivers signals to the main thread only
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False

    def _handle(self, signum, frame):
        if self.local:
            raise KeyboardInterrupt
        self.local = True
        if not _distributed() or dist.get_rank() == 0:
            print(f"\n{signal.Signals(signum).name}: stopping after this step and saving a checkpoint (send it again "
                  "to stop at once)", file=sys.stderr, flush=True)

    def agreed(self, device="cpu") -> bool:
        if not _distributed():
            return self.local
        flag = torch.tensor([1.0 if self.local else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
