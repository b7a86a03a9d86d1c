"""Rendering engine progress: a rich bar on a terminal, JSON lines otherwise."""

from __future__ import annotations

import json
import sys
import time

from converters.progress import ProgressEvent


class JsonProgress:
    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self._t0 = time.monotonic()

    def __call__(self, ev: ProgressEvent) -> None:
        rec = {"event": "progress", "stage": ev.stage, "bytes_done": ev.done, "bytes_total": ev.total}
        if ev.total and ev.done:
            elapsed = time.monotonic() - self._t0
            rec["percent"] = round(100 * ev.done / ev.total, 1)
            rec["eta_seconds"] = round(elapsed * (ev.total - ev.done) / ev.done, 1)
        if ev.message:
            rec["message"] = ev.message
        self.stream.write(json.dumps(rec) + "\n")
        self.stream.flush()

    def close(self) -> None:
        pass


class BarProgress:
    def __init__(self):
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

        self.console = Console(stderr=True)
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(), console=self.console, transient=False)
        self.task = None
        self._stage = None

    def __call__(self, ev: ProgressEvent) -> None:
        if ev.stage == "writing":
            if self.task is None:
                self.bar.start()
                self.task = self.bar.add_task("writing", total=ev.total)
            self.bar.update(self.task, completed=ev.done)
            return
        if self.task is not None and ev.stage != self._stage:
            self.bar.stop()
        if ev.stage != self._stage or ev.message:
            if ev.stage != "done":
                self.console.print(f"[dim]{ev.stage}[/dim] {ev.message}".rstrip())
        self._stage = ev.stage

    def close(self) -> None:
        if self.task is not None:
            self.bar.stop()


class NoProgress:
    def __call__(self, ev: ProgressEvent) -> None:
        pass

    def close(self) -> None:
        pass


def make(mode: str):
    if mode == "auto":
        mode = "bar" if sys.stderr.isatty() else "json"
    return {"bar": BarProgress, "json": JsonProgress, "none": NoProgress}[mode]()
