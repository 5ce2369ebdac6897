"""Who holds a background job's lease: a run of a job in one process of one
host, named so that another worker on the same host can tell the process is
gone (a worker killed mid-job) while one on another host waits for the lease
to expire. Used by the Batch API's batches and the catalog's pulls."""

import os
import secrets
import socket

import psutil


def worker_identity() -> str:
    """A run of a job in this process, as a lease owner: host, pid, the
    process's start time (a pid reused by a later process is not taken for
    this one) and a token of the run (a worker runs tasks in threads: two
    runs of one job in one process are two owners)."""
    started = int(psutil.Process().create_time())
    return f"{socket.gethostname()}:{os.getpid()}:{started}:{secrets.token_hex(4)}"


def owner_gone(owner: str) -> bool:
    """Whether a lease owner is a process of this host that is no longer
    running (one on another host is judged by its lease's expiry alone)."""
    try:
        host, pid, started, _ = owner.split(":")
        pid_number, started_at = int(pid), int(started)
    except ValueError:
        return True
    if host != socket.gethostname():
        return False
    try:
        return int(psutil.Process(pid_number).create_time()) != started_at
    except psutil.NoSuchProcess:
        return True
