"""Progress bars that read well in a terminal and in a log file.

tqdm redraws its line with carriage returns: on a terminal that is a bar, but in a log file or CI output it is one
line holding hundreds of overwritten updates. When the stream is not a terminal, ``progress_bar`` writes one plain
line per update instead, at most every ``log_interval`` seconds, so a log stays readable and greppable. Without
tqdm installed (it is an extra) it returns a bar that does nothing.
"""
import contextlib
import sys


class _LinePerUpdate:
    """A text stream for tqdm that turns each redraw into a line of its own."""

    def __init__(self, stream):
        self.stream = stream
        self.last = None

    def write(self, text):
        text = text.replace("\r", "").rstrip()
        if text and text != self.last:  # closing redraws the last state: once is enough
            self.stream.write(text + "\n")
            self.last = text

    def flush(self):
        self.stream.flush()


class _NoBar(contextlib.nullcontext):
    """What ``progress_bar`` gives without tqdm: it iterates what it wraps and ignores updates."""

    def __init__(self, iterable=None):
        super().__init__(self)
        self.iterable = iterable

    def __iter__(self):
        return iter(self.iterable)

    def update(self, n=1):
        pass

    def set_postfix(self, *args, **kwargs):
        pass

    def close(self):
        pass


def progress_bar(iterable=None, *, disable=False, log_interval: float = 30.0, stream=None, **tqdm_kwargs):
    """``tqdm(iterable, **tqdm_kwargs)`` on stderr (or ``stream``): a live bar on a terminal, a line every
    ``log_interval`` seconds (and a last one at the end) anywhere else."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar(iterable)
    stream = sys.stderr if stream is None else stream
    if not (hasattr(stream, "isatty") and stream.isatty()):
        stream = _LinePerUpdate(stream)
        # maxinterval=inf: tqdm's monitor thread would otherwise redraw a slow bar between updates, which in a
        # log is a second line with the same count.
        tqdm_kwargs = {"mininterval": log_interval, "maxinterval": float("inf"),
                       "bar_format": "{desc}: {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]",
                       **tqdm_kwargs}
    return tqdm(iterable, file=stream, disable=disable, **tqdm_kwargs)
