"""Spawned processes for the build's side jobs: each job gets a fresh process, which exits as soon
as the job returns, so what it loaded (a model, an engine) is not held while the build goes on."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor

from streamfuse.runtime.commands import errors


def start(function, *args) -> Future:
    """function(*args) in a spawned process; its result (or error) comes back through the future.
    Found needed: a Core ML worker beside the ExecuTorch export sat idle on 5 GB for 10 minutes of
    lowering until the export ended."""
    pool = ProcessPoolExecutor(
        1, mp_context=multiprocessing.get_context("spawn"), initializer=errors.quiet_unless_debugging
    )
    future = pool.submit(function, *args)
    future.add_done_callback(lambda _: pool.shutdown(wait=False))
    return future


def run(function, *args):
    """function(*args) in a spawned process, waited for: a measurement there sees the runtime alone,
    not this process's training memory or its threads."""
    return start(function, *args).result()
