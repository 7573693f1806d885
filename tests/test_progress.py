"""Progress in a log file or CI is one readable line per update, not hundreds of carriage-return redraws packed
into one line; on a terminal it stays a live bar."""
import io
import sys

import pytest
import torch

import linear_mha
from linear_mha.progress import progress_bar

pytest.importorskip("tqdm")


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_log_gets_lines_and_a_terminal_gets_a_redrawn_bar():
    log, terminal = io.StringIO(), Terminal()
    for stream in (log, terminal):
        bar = progress_bar(range(5), desc="steps", stream=stream, log_interval=0, mininterval=0)
        for _ in bar:
            bar.set_postfix(loss=0.5)
    assert "\r" not in log.getvalue()
    lines = log.getvalue().splitlines()
    assert lines[-1].startswith("steps: 5/5") and "loss=0.5" in lines[-1]
    assert len(lines) == len(set(lines)), "a line is repeated (the closing redraw)"
    assert "\r" in terminal.getvalue()


def test_calibrate_writes_readable_lines_into_a_log(capsys):
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    linear_mha.patch(model, "hedgehog")
    batches = [torch.randn(2, 12, 16) for _ in range(2)]
    linear_mha.calibrate(model, batches, steps=3, eval_batches=0, progress=True)
    err = capsys.readouterr().err  # pytest's capture is not a terminal, like a log file
    assert "\r" not in err and "calibrate (attention transfer)" in err


def test_without_tqdm_the_bar_does_nothing_but_still_iterates(monkeypatch):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # tqdm is an extra: importing it fails
    with progress_bar(total=3) as bar:
        bar.update(1)
        bar.set_postfix(loss=1.0)
    assert list(progress_bar(range(3))) == [0, 1, 2]
