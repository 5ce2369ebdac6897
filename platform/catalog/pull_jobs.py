"""Pulls as background jobs (the catalog's Celery tasks): a pull is planned
where it is asked for (the source read, its name checked, before a byte of
weights), kept as a ModelPull row with its plan, and run by a worker that
holds its lease: progress written every PROGRESS_EVERY_S while bytes come,
by a thread beside the download (bytes, rate, time left, and when they came:
a stall shows, as catalog.pull_progress reads it), a cancel seen at the next
write, a Hub that fails or stalls mid-file continued from what was fetched
(TRANSIENT_TRIES times), and a worker killed mid-pull resumed by the next
worker to start (or by beat, once its lease expired) from the partial file
it left. On a cluster a pull may name its node: it goes to that node's queue
(pull_queue_name), which the node's own worker takes; one that names none
goes where its caller's `node_default` says (the fleet's: where the model's
first replica is placed, fleet.pull_node), the reason kept on the row.
Leases are stamped and judged by the database's clock."""

import logging
import shutil
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

from celery import current_app
from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, transaction
from django.db.models.functions import Now

from .hub import HubError
from .leases import lease_claim, owner_gone, worker_identity
from .models import PULL_OPEN, ModelPull, PullStatus
from .pull import STAGING, Progress, PullPlan, model_folder, pull_files, pull_plan

log = logging.getLogger(__name__)

PULL_TASK = "catalog.pull"
# A worker's hold on a pull, renewed with each progress write.
LEASE_S = 30.0
# Progress is written (and a cancel looked for) this often, at most.
PROGRESS_EVERY_S = 0.5
# A pull whose runs died this often (killed workers) is failed, not resumed.
MAX_CRASHES = 5
# A queued pull not taken by a worker this long after it was sent is sent again.
REQUEUE_AFTER_S = 900.0
# A Hub that fails mid-download (a cut, a stall past the client's timeout) is
# tried again this often, each continuing the partial file, before the pull fails.
TRANSIENT_TRIES = 5
TRANSIENT_WAIT_S = 2.0

# Where a pull that names no node runs, from its plan: (node, why), node ""
# for the first worker to take it. The catalog knows nothing of nodes and
# engines: the fleet gives it (fleet.pull_node.pull_node_default).
NodeDefault = Callable[[PullPlan], tuple[str, str]]


class PullCancelled(Exception):
    """The pull was cancelled while it ran."""


class LeaseLost(Exception):
    """Another worker holds the pull now (this one stalled past its lease)."""


def pull_queue_name(node: str) -> str:
    """The Celery queue of pulls that must run on `node` (its worker takes it)."""
    return f"pulls.{node}"


def pull_start(
    *,
    source: str,
    name: str = "",
    revision: str = "main",
    sha256: str = "",
    node: str = "",
    node_default: NodeDefault | None = None,
    user=None,
) -> ModelPull:
    """Plan the pull (HubError: 400 a bad source, 404, 401, 409 a name taken,
    all before a byte of weights) and queue it: on `node`, else where
    `node_default` says from the plan (its reason kept: `node_reason`), else
    to the first worker that takes it. Blocking: reads the Hub."""
    plan = pull_plan(source, name=name, revision=revision, sha256=sha256)
    node_reason = ""
    if not node and node_default is not None:
        node, node_reason = node_default(plan)
    try:
        with transaction.atomic():
            pull = ModelPull.objects.create(
                source=source,
                name=plan.name,
                revision=revision,
                sha256=sha256,
                node=node,
                node_reason=node_reason[:300],
                plan=plan.model_dump(mode="json"),
                size_bytes=plan.size,
                queued_at=Now(),
                requested_by=user,
            )
            pull_queue(pull.pk, node=node)
    except IntegrityError:  # another pull of that name started meanwhile
        raise HubError(
            409, f"a pull of a model named {plan.name} is under way"
        ) from None
    pull.refresh_from_db()
    return pull


def pull_queue(pull_id: int, *, node: str = "") -> None:
    """Send the pull to a worker (its node's queue when it names one) once
    the current transaction commits. A broker that is down leaves it queued
    for pulls_resume, and says so on the row."""

    def send() -> None:
        options = {"queue": pull_queue_name(node)} if node else {}
        try:
            current_app.send_task(PULL_TASK, args=[pull_id], **options)
        except Exception as error:  # the broker is down
            log.exception("could not queue pull %s", pull_id)
            ModelPull.objects.filter(pk=pull_id).update(
                message=f"waiting for the broker: {error}"[:500], queued_at=None
            )

    transaction.on_commit(send)


def pull_cancel(*, pull: ModelPull) -> ModelPull:
    """Cancel a pull: one no worker holds ends now; a running one stops at
    its next progress write (its partial file removed). A finished pull is
    left as it is."""
    ModelPull.objects.filter(
        pk=pull.pk, status=PullStatus.QUEUED, lease_owner=""
    ).update(status=PullStatus.CANCELLED, finished_at=Now(), message="cancelled")
    ModelPull.objects.filter(pk=pull.pk, status__in=PULL_OPEN).update(
        cancel_requested=True
    )
    pull.refresh_from_db()
    return pull


def pull_claim(*, pull_id: int, owner: str) -> bool:
    """Take the pull for this run (True) unless another live run holds it
    (leases.lease_claim)."""
    open_pull = ModelPull.objects.filter(pk=pull_id, status__in=PULL_OPEN)
    return lease_claim(open_pull, owner=owner, lease_s=LEASE_S)


def pull_run(pull_id: int) -> str:
    """Run the pull to its end, unless another run holds it; its status after."""
    owner = worker_identity()
    if not pull_claim(pull_id=pull_id, owner=owner):
        return "held elsewhere"
    pull = ModelPull.objects.get(pk=pull_id)
    held = ModelPull.objects.filter(pk=pull_id, lease_owner=owner)
    # Its stall clock starts with the run: a Hub that sends nothing at all
    # shows as stalled too.
    held.update(status=PullStatus.RUNNING, message="", progress_at=Now())
    ModelPull.objects.filter(pk=pull_id, started_at__isnull=True).update(
        started_at=Now()
    )
    plan = PullPlan.model_validate(pull.plan)
    try:
        with _Reporter(pull_id, owner) as report:
            path = _fetch(plan, report)
            report.check()
        from .pull import pull_record

        model = pull_record(plan, path)
    except LeaseLost:
        log.warning("pull %s: another worker holds it now; this run stops", pull_id)
        return "held elsewhere"
    except PullCancelled:
        _discard_partials(plan)
        return _end(held, PullStatus.CANCELLED, "cancelled")
    except HubError as error:
        return _end(held, PullStatus.FAILED, error.message)
    except ValidationError as error:
        return _end(held, PullStatus.FAILED, f"the catalog refused the model: {error}")
    except Exception as error:  # a pull fails alone, with the reason
        log.exception("pull %s failed", pull_id)
        return _end(held, PullStatus.FAILED, f"internal error: {error}")
    return _end(
        held,
        PullStatus.DONE,
        "",
        model=model,
        done_bytes=plan.size,
        rate_bps=report.rate,
        left_s=0.0,
    )


def _fetch(plan: PullPlan, report: "_Reporter") -> Path:
    """pull_files, continued after a Hub that failed mid-file (a cut, a
    stall): every try keeps what the last one fetched."""
    models_dir = Path(settings.MODELS_DIR)
    for attempt in range(1, TRANSIENT_TRIES + 1):
        try:
            return pull_files(plan, models_dir, progress=report)
        except HubError as error:
            if error.status != 502 or attempt == TRANSIENT_TRIES:
                raise
            report.note(
                f"the Hub failed ({error.message}); continuing (try {attempt + 1})"
            )
            time.sleep(TRANSIENT_WAIT_S)
            report.check()
    raise AssertionError("unreachable")


def _end(held, status: str, message: str, **fields) -> str:
    held.update(
        status=status,
        message=message[:2000],
        finished_at=Now(),
        lease_owner="",
        lease_until=None,
        cancel_requested=False,
        **fields,
    )
    return status


def _discard_partials(plan: PullPlan) -> None:
    """A cancelled pull's partial files: removed (a finished file stays)."""
    staging = model_folder(Path(settings.MODELS_DIR) / STAGING, plan.repo_id)
    shutil.rmtree(staging, ignore_errors=True)


class _Reporter:
    """The download's progress onto the pull's row, written by a thread of its
    own every PROGRESS_EVERY_S while bytes come: the download never waits on
    the database, and the bytes that came last before a stall are on the row
    within PROGRESS_EVERY_S (`progress_at`: when, by the database's clock; a
    stall writes nothing more, which is how it shows). Each write renews the
    lease; once a write saw a cancel asked for (PullCancelled) or the pull
    taken by another run (LeaseLost), the download raises it with its next
    bytes. A context manager: its thread ends with it."""

    def __init__(self, pull_id: int, owner: str) -> None:
        self.pull_id = pull_id
        self.held = ModelPull.objects.filter(pk=pull_id, lease_owner=owner)
        self._latest: Progress | None = None
        self._written = -1  # the bytes last written
        self._ended: LeaseLost | PullCancelled | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._writes, name=f"pull-{pull_id}-progress", daemon=True
        )

    def __enter__(self) -> "_Reporter":
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def rate(self) -> float:
        """The download's rate as last reported (0 before any bytes)."""
        return self._latest.rate if self._latest is not None else 0.0

    def __call__(self, progress: Progress) -> None:
        """The client's bytes so far (its download thread): kept for the next
        write; what a write found raised here."""
        self._latest = progress
        if self._ended is not None:
            raise self._ended

    def note(self, message: str) -> None:
        self._write(message=message[:2000])

    def check(self) -> None:
        self._write()

    def _writes(self) -> None:
        """The writer's loop: a write that fails is said once and tried
        again at the next pass; the loop ends with the pull's run."""
        failing = False
        try:
            while not self._stop.wait(PROGRESS_EVERY_S):
                try:
                    self._progress_write()
                except (LeaseLost, PullCancelled) as ended:
                    self._ended = ended
                    return
                except Exception:
                    if not failing:
                        log.exception(
                            "pull %s: writing its progress failed; trying again "
                            "every %s s",
                            self.pull_id,
                            PROGRESS_EVERY_S,
                        )
                    failing = True
                else:
                    failing = False
        finally:
            connection.close()

    def _progress_write(self) -> None:
        """The latest bytes onto the row, when some came since the last write."""
        progress = self._latest
        if progress is None or progress.done == self._written:
            return
        self._write(
            done_bytes=progress.done,
            size_bytes=progress.size,
            rate_bps=progress.rate,
            left_s=progress.left_s,
            progress_at=Now(),
        )
        self._written = progress.done

    def _write(self, **fields) -> None:
        lease = Now() + timedelta(seconds=LEASE_S)
        if not self.held.update(lease_until=lease, **fields):
            raise LeaseLost
        if self.held.filter(cancel_requested=True).exists():
            raise PullCancelled


def pulls_resume() -> list[int]:
    """Queue every open pull no live run holds and not waiting in the broker
    already: its holder died (a process of this host that is gone, or a
    lease expired: a crash, counted; MAX_CRASHES fails it), or it was never
    sent, or sent REQUEUE_AFTER_S ago and not taken. The ids queued."""
    queued = []
    rows = (
        ModelPull.objects.filter(status__in=PULL_OPEN)
        .annotate(db_now=Now())
        .values_list(
            "id", "node", "lease_owner", "lease_until", "queued_at", "crashes", "db_now"
        )
    )
    for pull_id, node, owner, until, queued_at, crashes, now in rows:
        if owner:
            if until is not None and until >= now and not owner_gone(owner):
                continue  # a live run holds it
            crashes += 1
            mine = ModelPull.objects.filter(pk=pull_id, lease_owner=owner)
            if crashes >= MAX_CRASHES:
                _end(
                    mine,
                    PullStatus.FAILED,
                    f"its runs died {crashes} times; pull it again",
                    crashes=crashes,
                )
                continue
            mine.update(lease_owner="", lease_until=None, crashes=crashes)
        elif queued_at is not None and now - queued_at < timedelta(
            seconds=REQUEUE_AFTER_S
        ):
            continue  # waiting for a worker in the broker
        ModelPull.objects.filter(pk=pull_id).update(queued_at=Now())
        pull_queue(pull_id, node=node)
        queued.append(pull_id)
    return queued
