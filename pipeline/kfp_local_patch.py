"""The one place that reaches into kfp.local's private API: its task events, for the local run's step lines.

kfp.local reports when a task starts, ends or is answered by the cache only as log text (f-strings with ANSI
colours: no record args to read), so the events come from the two calls of kfp.local's that they are about,
wrapped while a pipeline runs:

- ``task_executor.execute_single_task(task_name=...)``, which both of kfp.local's DAG orchestrators call for
  every task (the exit handler's too) and which owns the cache lookup and the retries: it gives the task's
  name and returns its ``Status``; a task that succeeded without starting a step process was answered by the
  cache (the pipeline has no importer tasks);
- ``SubprocessTaskHandler.run``, the step's process itself: its start and end bracket the step's own output,
  and it returns the attempt's ``Status`` (one start per attempt when a step is retried).

Both are kfp internals, as the log wording is, but a renamed one fails the run at once, where a reworded log
line would silently show no progress. Events the steps wrote themselves would miss cache hits (no step runs)
and steps killed before they could write. Written for the kfp of ``WRITTEN_FOR`` (locks/flowgrpo.txt); another
version is said in one line when the patch is applied.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

from components.console import status_line
from components.errors import FlowGRPOError

WRITTEN_FOR = "2.17.3"


class KfpLocalChanged(FlowGRPOError):
    """The installed kfp.local lacks a call the patch wraps."""


class TaskEvents(Protocol):
    def task_started(self, task: str) -> None: ...
    def task_cached(self, task: str) -> None: ...
    def task_finished(self, task: str, succeeded: bool) -> None: ...


def version_note(installed: str) -> str | None:
    """The line that says the installed kfp is not the one this patch was written for; None when it is."""
    if installed == WRITTEN_FOR:
        return None
    return (f"kfp {installed} is installed; pipeline/kfp_local_patch.py follows kfp.local's internals as of "
            f"kfp {WRITTEN_FOR}: if the step lines look wrong, check that module against this kfp")


@contextlib.contextmanager
def following_tasks(events: TaskEvents, say: Callable[[str], None] = status_line) -> Iterator[None]:
    """While kfp.local runs a pipeline in this process: each of its tasks' start, end (and how) and cache hit
    told to ``events``; kfp.local is left as it was on exit. ``say`` hears the version note, if any."""
    import kfp
    from kfp.local import status, subprocess_task_handler
    from kfp.local.orchestrator import task_executor

    if note := version_note(kfp.__version__):
        say(note)
    handler = subprocess_task_handler.SubprocessTaskHandler
    execute, run = getattr(task_executor, "execute_single_task", None), getattr(handler, "run", None)
    if execute is None or run is None:
        raise KfpLocalChanged(f"kfp {kfp.__version__}: kfp.local has no task_executor.execute_single_task or "
                              "SubprocessTaskHandler.run, which pipeline/kfp_local_patch.py follows steps by "
                              f"(written for kfp {WRITTEN_FOR})")
    bind = inspect.signature(execute).bind
    current = threading.local()  # kfp.local runs a ParallelFor's iterations in threads

    def execute_single_task(*args, **kwargs):
        current.task, current.ran = bind(*args, **kwargs).arguments["task_name"], False
        outputs, task_status = execute(*args, **kwargs)
        if task_status == status.Status.SUCCESS and not current.ran:
            events.task_cached(current.task)
        return outputs, task_status

    def run_step(self):
        name, current.ran = getattr(current, "task", "step"), True
        events.task_started(name)
        task_status = run(self)  # an exception (Ctrl-C) ends no step: nothing is shown for it
        events.task_finished(name, task_status == status.Status.SUCCESS)
        return task_status

    task_executor.execute_single_task, handler.run = execute_single_task, run_step
    try:
        yield
    finally:
        task_executor.execute_single_task, handler.run = execute, run
