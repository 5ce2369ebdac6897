"""Who holds a background job's lease: a run of a job in one process of one
host, named so that another worker on the same host can tell the process is
gone (a worker killed mid-job) while one on another host waits for the lease
to expire; and how a run takes a job's row. Used by the Batch API's batches
and the catalog's pulls (rows with lease_owner, lease_until, crashes and
queued_at)."""

import os
import secrets
import socket
from datetime import timedelta

import psutil
from django.db.models import F, Q, QuerySet
from django.db.models.functions import Now


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


def lease_claim(open_job: QuerySet, *, owner: str, lease_s: float) -> bool:
    """Take the job (`open_job`: its row, while it may still run) for this
    run (True), unless another live run holds it. Atomic: of two runs that
    try at once, one gets it. Taking it from another owner whose lease
    expired counts a crash (that run died holding it, or stopped for longer
    than its lease). Leases are stamped and judged by the database's clock:
    runs on hosts whose clocks differ agree on when one expires."""
    lease = {
        "lease_owner": owner,
        "lease_until": Now() + timedelta(seconds=lease_s),
        "queued_at": None,
    }
    taken_over = (
        open_job.exclude(lease_owner="")
        .exclude(lease_owner=owner)
        .filter(lease_until__lt=Now())
        .update(crashes=F("crashes") + 1, **lease)
    )
    return bool(
        taken_over
        or open_job.filter(
            Q(lease_owner="") | Q(lease_until__isnull=True) | Q(lease_owner=owner)
        ).update(**lease)
    )
