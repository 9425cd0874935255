"""Kernel-level profiles of engine steps (opt-in): ``torch.profiler`` over a window of steps,
exported as a Chrome trace (``chrome://tracing``, Perfetto), each step a range named
``pyspec.step N (requests ...)`` (the step's request ids, the first 16) with its phases (``pyspec.draft``,
``pyspec.verify``, ``pyspec.accept``) and the target model's parts (``pyspec.layers``: the
decoder layers, one core call on the CPU; ``pyspec.lm_head``) inside, and under them the torch
ops and, on a GPU, the CUDA kernels with their device times.

A window is armed on one engine (:meth:`pyspec.engine.Engine.profile`) and records its next steps that
run a forward; the steps' trace records (:class:`~pyspec.engine.stats.StepTrace`) carry the file
and the step number, so a served request's OpenTelemetry spans point at the profile of their step
(``pyspec.profile.file``, ``pyspec.profile.step``). ``torch.profiler`` is one per process: while
a window records, the process's other torch work (another engine's steps) shows in it too, and a
second window, from any engine, waits for the first to end.

Outside a window the ranges cost one check of torch's profiler state (:func:`profile_range`).
While a window records, the process runs with torch's profiler on: a window that will not reach
its step count (its engine went idle) is ended with :meth:`pyspec.engine.Engine.stop_profile`.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from typing import List, Optional

import torch

__all__ = ["StepProfiler", "profile_range", "MAX_PROFILE_STEPS"]

MAX_PROFILE_STEPS = 1000
# Kernels listed in a window's summary (by their total self time).
SUMMARY_TOP = 15

_profiler_enabled = torch._C._autograd._profiler_enabled
_nothing = contextlib.nullcontext()
# torch.profiler is one per process: at most one window records at a time.
_active_lock = threading.Lock()


def profile_range(name: str):
    """A ``torch.profiler.record_function`` range while a profiler records, else a no-op (a
    range costs microseconds even with no profiler on)."""
    if not _profiler_enabled():
        return _nothing
    return torch.profiler.record_function(name)


class StepProfiler:
    """One armed window: the next ``steps`` engine steps that run a forward, written to
    ``path`` (a Chrome trace JSON) when the last of them ends, with a summary beside it
    (``path`` with ``.summary.json``: the window's top kernels by self time).

    Args:
        out_dir: the folder (created if missing) the trace is written to.
        steps: how many steps, 1 to :data:`MAX_PROFILE_STEPS`.
        cuda: also record CUDA activity (the model runs on a GPU).
    """

    def __init__(self, out_dir: str, steps: int, cuda: bool = False):
        if isinstance(steps, bool) or not isinstance(steps, int) or \
                not 1 <= steps <= MAX_PROFILE_STEPS:
            raise ValueError(f"steps must be an int in [1, {MAX_PROFILE_STEPS}]; got {steps!r}")
        if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir):
            raise ValueError(f"the profile folder must be a path; got {out_dir!r}")
        try:
            os.makedirs(out_dir, exist_ok=True)
        except OSError as e:
            raise ValueError(f"cannot create the profile folder {str(out_dir)!r}: {e}") from None
        if not os.access(out_dir, os.W_OK):
            raise ValueError(f"the profile folder {str(out_dir)!r} is not writable")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        base = os.path.join(str(out_dir), f"pyspec-steps-{stamp}-{os.getpid()}")
        self.path, n = base + ".json", 0
        while os.path.exists(self.path):
            n += 1
            self.path = f"{base}-{n}.json"
        self.summary_path = self.path[:-len(".json")] + ".summary.json"
        self.steps = int(steps)
        self.recorded = 0
        self.cuda = bool(cuda)
        self.done = False
        self.error: Optional[str] = None
        self._prof = None
        self._owns_lock = False

    def status(self) -> dict:
        return {"path": self.path, "steps": self.steps, "recorded": self.recorded,
                "done": self.done, "error": self.error,
                "summary": self.summary_path if self.done and self.error is None else None}

    def _start(self) -> bool:
        """Start recording; False while another window in the process records (this one then
        waits for a later step)."""
        if not _active_lock.acquire(blocking=False):
            return False
        self._owns_lock = True
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            self._prof = torch.profiler.profile(activities=acts, record_shapes=False)
            self._prof.start()
        except Exception as e:  # noqa: BLE001 - a profiler torch could not start: said, not raised
            self._finish(f"torch.profiler could not start: {type(e).__name__}: {e}")
            return False
        return True

    @contextlib.contextmanager
    def step(self, request_ids: List[int]):
        """The range of one engine step (starts the window at its first step); yields the step's
        number in the window, or None when this step is not recorded."""
        if self.done or (self._prof is None and not self._start()):
            yield None
            return
        k = self.recorded
        ids = list(request_ids)
        more = f", +{len(ids) - 16}" if len(ids) > 16 else ""
        try:
            with torch.profiler.record_function(
                    f"pyspec.step {k} (requests {', '.join(map(str, ids[:16]))}{more})"):
                yield k
        finally:
            self.recorded += 1
            if self.recorded >= self.steps:
                self._stop()

    def _stop(self) -> None:
        prof, err = self._prof, None
        try:
            prof.stop()
            prof.export_chrome_trace(self.path)
            with open(self.summary_path, "w", encoding="utf-8") as f:
                json.dump(self._summary(prof), f, indent=1)
        except Exception as e:  # noqa: BLE001 - the engine goes on; the status says what failed
            err = f"writing the profile failed: {type(e).__name__}: {e}"
        self._finish(err)

    def _finish(self, err: Optional[str]) -> None:
        self.error = err
        self.done = True
        self._prof = None
        if self._owns_lock:
            self._owns_lock = False
            _active_lock.release()

    def _summary(self, prof) -> dict:
        """The window's ops and kernels by total self time (CPU, and device time on a GPU)."""
        rows = []
        for e in prof.key_averages():
            dev = getattr(e, "self_device_time_total", 0.0) or 0.0
            rows.append({"name": e.key, "calls": int(e.count),
                         "self_cpu_us": round(float(e.self_cpu_time_total), 1),
                         "self_device_us": round(float(dev), 1)})
        rows.sort(key=lambda r: (r["self_device_us"], r["self_cpu_us"]), reverse=True)
        return {"trace": os.path.basename(self.path), "steps": self.recorded,
                "cuda": self.cuda, "top": rows[:SUMMARY_TOP]}

    def stop(self) -> None:
        """End the window now: what it recorded is written (call it from the thread that runs
        the engine's steps); a window that recorded nothing ends without a file."""
        if self.done:
            return
        if self._prof is not None:
            self._stop()
        else:
            self._finish("stopped before any step was recorded")
