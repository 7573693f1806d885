"""What a training run says on the console and what it refuses to clobber, shared by the DETR and LM trainers:
a start banner, the thread count (with a warning when other processes keep the cores busy), epoch progress with
an ETA, the peak memory, and a refusal to write a new run over an old one."""
import argparse
import copy
import os
import resource
import sys
import time
from pathlib import Path

import torch


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help for our command lines: the description as written, and each option's default where it has a value and
    its help does not already say it."""

    @staticmethod
    def _has_default(action):
        return action.default not in (None, False, argparse.SUPPRESS) and action.option_strings and \
            not isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction))

    def _format_action(self, action):
        if not action.help and self._has_default(action):  # argparse prints no help line for an option without help
            action = copy.copy(action)
            action.help = f"default: {self._shown(action)}".replace("%", "%%")
        return super()._format_action(action)

    @staticmethod
    def _shown(action):
        return " ".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) else action.default

    def _get_help_string(self, action):
        text = action.help or ""
        if not self._has_default(action) or "default" in text:
            return text
        return f"{text} (default: {self._shown(action)})".replace("%", "%%") if text else text


def choose_threads(requested=None, busy=None) -> str:
    """Set torch's thread count to ``requested`` (a --threads value) if given; say what the run uses, with a warning
    when the 1-minute load average shows other processes on the cores: torch's threads then wait on each other at
    every op (measured 5-40x slower with 2 threads on 2 shared cores), and --threads with the free cores helps."""
    cores = os.cpu_count() or 1
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be >= 1, got {requested}")
        torch.set_num_threads(requested)
        return f"{requested} (--threads), {cores} core(s)"
    threads = torch.get_num_threads()
    busy = other_runnable_tasks() if busy is None else busy
    if busy is None:
        return f"{threads}, {cores} core(s)"
    free = max(1, cores - busy)
    if free < threads:
        return (f"{threads}, {cores} core(s) -- WARNING: other processes keep {busy} core(s) busy; with --threads "
                f"{free} this run will likely be several times faster")
    return f"{threads}, {cores} core(s)"


def other_runnable_tasks(samples: int = 5, interval: float = 0.02, path: str = "/proc/loadavg"):
    """How many other tasks want a CPU right now: the kernel's count of runnable tasks (/proc/loadavg's fourth
    field), least of a few samples, less this process's one. Not the load average: that trails the last minute,
    so a run that just finished (or this process's own start-up) would read as a busy machine. None off Linux."""
    counts = []
    for i in range(samples):
        try:
            with open(path) as f:
                counts.append(int(f.read().split()[3].split("/")[0]))
        except (OSError, ValueError, IndexError):
            return None
        if i + 1 < samples:
            time.sleep(interval)
    return max(0, min(counts) - 1)


def refuse_overwrite(out_dir, files, *, resume_hint: str, out_flag: str) -> None:
    """A new run into a directory that holds an earlier run's ``files`` would replace its checkpoint and log: raise,
    naming the ways on (resume it, another directory, or --overwrite). Empty files do not count: a run stopped
    before its first checkpoint leaves an empty log and nothing to resume, and the same command must start it
    again rather than point at a checkpoint that does not exist."""
    found = [name for name in files if (Path(out_dir) / name).is_file() and (Path(out_dir) / name).stat().st_size]
    if found:
        raise FileExistsError(f"{out_dir} already holds a run ({', '.join(found)}): continue it with {resume_hint}, "
                              f"start a new one with another {out_flag}, or pass --overwrite to replace it")


def banner(title: str, rows: dict, stream=None) -> None:
    """Print what a run is about to do, one ``name: value`` per line under a title."""
    stream = stream or sys.stdout
    width = max(len(name) for name in rows)
    print(title, file=stream)
    for name, value in rows.items():
        print(f"  {name:<{width}}  {value}", file=stream)
    stream.flush()


def duration(seconds: float) -> str:
    """1h02m, 3m05s or 12s."""
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def eta(done: int, total: int, seconds: float) -> str:
    """Time left for ``total - done`` units at the mean pace of the ``done`` ones that took ``seconds``."""
    if done <= 0:
        return "?"
    return duration(seconds / done * max(total - done, 0))


def peak_memory_mib(device) -> tuple:
    """(MiB, what was measured): the CUDA allocator's peak on a GPU, else the process's peak resident set size
    (which includes Python, torch and the data, not only the tensors)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 20, "CUDA max allocated"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2 ** 20 if sys.platform == "darwin" else 2 ** 10), "peak RSS of the process"
