"""One results file that runs add up in, run by run, across processes and across machines' sessions.

A grid of training runs (MQAR's methods x tasks x rates x seeds, the ViT's variants x seeds) takes longer than one
session of a machine whose disk does not outlive it, so ``--records FILE`` keeps the table in a file that is
committed with the code: a run whose record the file holds (with the same settings) is not trained again, and each
run that finishes is added to the file at once, the summary and the figure beside it redrawn. Several processes (one
per core, each with its own variants) may add to one file: the read-add-write is done under a lock on the file's
folder. A run is named by the values of its ``key`` fields (e.g. method, task, rate and seed)."""
import fcntl
import json
import os
from contextlib import contextmanager
from pathlib import Path

from linear_mha.integrations.checkpoint_io import check_same_args, write_text_atomic


@contextmanager
def folder_lock(path: Path):
    """An exclusive lock on the folder holding ``path``: the file itself is replaced by a rename, so a lock on it
    would lock the old file. The lock goes with the process if it dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def read_results(path: Path, setup: dict) -> dict:
    """The results file at ``path`` ({} if there is none yet). ``setup`` (machine, torch, device) must be the
    file's: a table comes from one setup."""
    if not path.exists():
        return {}
    results = json.loads(path.read_text())
    there = {key: results.get(key) for key in setup}
    if there != setup:
        raise ValueError(f"--records {path} holds runs of {there}, this is {setup}: a table comes from one machine "
                         f"and torch version; give another --records file")
    return results


def find_record(records: list, wanted: dict, key, settings: dict, setting_names, path):
    """The record of the run ``wanted`` (its ``key`` values) in ``records``, or None. One of that run written with
    other settings (steps, width, ...) is refused, naming the option: one file is one table."""
    for record in records:
        if all(record.get(name) == wanted[name] for name in key):
            check_same_args(record, settings, setting_names, "--records", path)
            return record
    return None


def add_record(path: Path, record: dict, key, setup: dict, command: str, summary_of, draw=None) -> dict:
    """Add ``record`` to the file at ``path`` (replacing one of the same run), with ``command`` among the file's
    commands and ``summary_of(records)`` as its summary, then ``draw(results)`` (the figure) while the file is still
    locked; returns the file's new contents. Runs that other processes added meanwhile stay."""
    other = {name: record[name] for name in setup if name in record and record[name] != setup[name]}
    if other:
        raise ValueError(f"--records {path}: the run {[record.get(k) for k in key]} was made with {other}, this "
                         f"file's table is of {setup}; a table comes from one machine and torch version")
    with folder_lock(path):
        earlier = read_results(path, setup)
        records = [r for r in earlier.get("records", []) if any(r.get(k) != record[k] for k in key)] + [record]
        commands = [c for c in earlier.get("commands", []) if c != command] + [command]
        results = {**setup, "commands": commands, "records": records, "summary": summary_of(records)}
        write_text_atomic(path, json.dumps(results, indent=1))
        if draw is not None:
            draw(results)
    return results
