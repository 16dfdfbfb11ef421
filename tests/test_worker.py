"""export/worker.py: a side job runs in a spawned process, which is gone as soon as the job returns."""

import os
import time

import psutil
import pytest

from streamfuse.export import worker


def test_the_process_exits_when_its_job_returns_while_this_one_goes_on():
    job = worker.start(os.getpid)
    pid = job.result(timeout=120)
    assert pid != os.getpid()
    deadline = time.monotonic() + 30
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(pid)


def test_the_jobs_error_comes_back_here():
    with pytest.raises(ValueError, match="invalid literal"):
        worker.run(int, "not a number")
