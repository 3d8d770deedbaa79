"""Progress bars that behave in logs.

:func:`tqdm` is ``tqdm.auto.tqdm`` when stderr is a terminal. When it is not (a log file, a pipe,
CI), a bar would write one line per refresh; instead nothing is drawn and one summary line per
stage is printed when the stage ends (``prune armor: 2/2 block in 3.1 s``), plus, in a stage that
runs long, one line at the first step or status change (``set_postfix_str``) after every
:data:`LOG_EVERY_S` seconds, with the status (``prune armor: 12/30 block, 61 s (block 12: reconstruction)``).
:func:`quiet_third_party_progress` turns off transformers' and huggingface_hub's own bars
(``--no-progress``, or stderr not a terminal).

Example::

    >>> import io
    >>> stream = io.StringIO()
    >>> for _ in tqdm(range(3), desc="stage", unit="step", file=stream):
    ...     pass
    >>> stream.getvalue().startswith("stage: 3/3 step in ")
    True
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import time
import warnings
from typing import Any, Iterator, Optional

from tqdm.auto import tqdm as _tqdm

__all__ = ["tqdm", "is_interactive", "quiet_third_party_progress", "third_party_bars_off", "LOG_EVERY_S"]

#: seconds between the progress lines of a long stage when stderr is not a terminal (a stage that
#: reports a step or a status at least this often never stays silent in a log for more than ~20 s)
LOG_EVERY_S = 15.0


def is_interactive(stream: Any = None) -> bool:
    """Whether ``stream`` (default ``sys.stderr``) is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class _LogLine(_tqdm):
    """A disabled tqdm that writes one summary line when closed (if it was meant to show)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._stream = kwargs.get("file") or sys.stderr
        self._label = kwargs.get("desc") or "progress"
        self._unit = kwargs.get("unit") or "it"
        self._total: Optional[int] = kwargs.get("total")
        self._count = self._initial = kwargs.get("initial") or 0
        self._t0 = time.perf_counter()
        self._done = False
        self._last_line = self._t0
        self._status = ""
        iterable = args[0] if args else kwargs.get("iterable")
        if self._total is None and iterable is not None and hasattr(iterable, "__len__"):
            self._total = len(iterable)
        kwargs["disable"] = True
        super().__init__(*args, **kwargs)

    def update(self, n: float = 1) -> Optional[bool]:
        self._count += n
        self._maybe_line()
        return super().update(n)

    def __iter__(self):
        for item in super().__iter__():
            yield item
            self._count += 1
            self._maybe_line()
        self.close()

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        self._status = str(s)
        self._maybe_line()

    def _maybe_line(self) -> None:
        now = time.perf_counter()
        finished = self._total is not None and self._count >= self._total  # the summary line follows
        if now - self._last_line >= LOG_EVERY_S and not self._done and not finished:
            self._last_line = now
            total = f"/{self._total}" if self._total is not None else ""
            status = f" ({self._status})" if self._status else ""
            print(f"{self._label}: {int(self._count)}{total} {self._unit}, {now - self._t0:.0f} s{self._left(now)}"
                  f"{status}", file=self._stream, flush=True)

    def _left(self, now: float) -> str:
        """``", about N min left"``: the rest at the pace of what this run has done so far."""
        done = self._count - self._initial
        if self._total is None or done <= 0:
            return ""
        seconds = (now - self._t0) / done * (self._total - self._count)
        return f", about {seconds / 60:.0f} min left" if seconds >= 90 else f", about {seconds:.0f} s left"

    def close(self) -> None:
        if not self._done:
            self._done = True
            total = f"/{self._total}" if self._total is not None else ""
            seconds = time.perf_counter() - self._t0
            if self._total is not None and self._count < self._total:  # interrupted or failed
                print(f"{self._label}: stopped at {int(self._count)}{total} {self._unit} after {seconds:.1f} s",
                      file=self._stream, flush=True)
            else:
                print(f"{self._label}: {int(self._count)}{total} {self._unit} in {seconds:.1f} s",
                      file=self._stream, flush=True)
        super().close()


def tqdm(*args: Any, **kwargs: Any):
    """``tqdm.auto.tqdm`` on a terminal; one line per stage elsewhere; nothing if ``disable``."""
    if kwargs.get("disable") or is_interactive(kwargs.get("file")):
        return _tqdm(*args, **kwargs)
    return _LogLine(*args, **kwargs)


def quiet_third_party_progress() -> None:
    """Turn off the progress bars of transformers (``Loading weights``) and huggingface_hub."""
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    try:
        from transformers.utils import logging as hf_logging  # floor 0 stays free of transformers at import

        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - transformers is optional here
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars  # optional here, like transformers

        disable_progress_bars()
    except Exception:  # noqa: BLE001
        pass
    try:  # transformers' GGUF reader draws a plain tqdm.auto bar of its own (no switch for it)
        import transformers.modeling_gguf_pytorch_utils as gguf_utils  # optional: needs the gguf package

        gguf_utils.tqdm = functools.partial(_tqdm, disable=True)
    except Exception:  # noqa: BLE001
        pass


@contextlib.contextmanager
def third_party_bars_off() -> Iterator[None]:
    """transformers' own bars (``Loading weights``, ``Writing model shards``) and huggingface_hub's off
    inside the block, each restored to its previous state after it: the library's own loads print
    nothing unasked, and the caller's settings outlive the call.

        >>> from transformers.utils import logging as hf_logging
        >>> before = hf_logging.is_progress_bar_enabled()
        >>> with third_party_bars_off():
        ...     hf_logging.is_progress_bar_enabled()
        False
        >>> hf_logging.is_progress_bar_enabled() == before
        True
    """
    try:
        from transformers.utils import logging as hf_logging  # floor 0 stays free of transformers at import
        from huggingface_hub import utils as hub_utils  # transformers' dependency, as above
    except ImportError:  # pragma: no cover - transformers is a dependency
        yield
        return
    bars_on, hub_off = hf_logging.is_progress_bar_enabled(), hub_utils.are_progress_bars_disabled()
    # the hub warns when HF_HUB_DISABLE_PROGRESS_BARS, set either way, overrides a call: nothing to say here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf_logging.disable_progress_bar()  # transformers' and the hub's
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if bars_on:
                hf_logging.enable_progress_bar()  # transformers' and the hub's
            if hub_off:
                hub_utils.disable_progress_bars()
            elif not bars_on:
                hub_utils.enable_progress_bars()
