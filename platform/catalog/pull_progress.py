"""A pull's progress as people read it: bytes done of its size, rate, time
left, and its plan in one line; the same figures for the admin's list, its
change page and the JSON its page polls (pull_progress).

The rate is the download's average since it started, written with the bytes
(catalog.pull_jobs). A Hub that stalls sends nothing, so nothing is written:
a running pull whose bytes last came STALLED_AFTER_S ago or more (its
`progress_at`, judged by the database's clock: read its rows with
`pulls_with_db_now`) reads as stalled, "no bytes for 7 s", its rate now
nothing and its time left unknown, until bytes come again."""

from datetime import datetime

from django.db.models import QuerySet
from django.db.models.functions import Now

from .models import PULL_OPEN, ModelPull, PullStatus

MIB = 1 << 20
GIB = 1 << 30
# A running pull with no bytes for this long reads as stalled: past a few
# progress writes (PROGRESS_EVERY_S), well before the client gives up on a
# read (10 s) and tries again.
STALLED_AFTER_S = 3.0


def pulls_with_db_now(rows: QuerySet[ModelPull] | None = None) -> QuerySet[ModelPull]:
    """`rows` (default: every pull) with the database's clock read with them
    (`db_now`), which a stall is judged by."""
    rows = ModelPull.objects.all() if rows is None else rows
    return rows.annotate(db_now=Now())


def _db_now(pull: ModelPull) -> datetime | None:
    """The database's clock as the row was read (`db_now`); for a row read
    without it, read now and kept on the row (one read per row)."""
    if getattr(pull, "db_now", None) is None:
        pull.db_now = (
            pulls_with_db_now(ModelPull.objects.filter(pk=pull.pk))
            .values_list("db_now", flat=True)
            .first()
        )
    return pull.db_now


def stalled_s(pull: ModelPull) -> float | None:
    """For how long a running pull has had no bytes, once that is
    STALLED_AFTER_S or more; None while bytes come (or it is not running)."""
    if pull.status != PullStatus.RUNNING or pull.progress_at is None:
        return None
    now = _db_now(pull)
    if now is None:
        return None
    quiet = (now - pull.progress_at).total_seconds()
    return quiet if quiet >= STALLED_AFTER_S else None


def rate_now(pull: ModelPull) -> tuple[float, float | None]:
    """Its rate (bytes/s) and seconds left as they are now: nothing and
    unknown while it has stalled, else what was last written."""
    if stalled_s(pull) is not None:
        return 0.0, None
    return pull.rate_bps, pull.left_s


def stalled_text(seconds: float) -> str:
    """`no bytes for 7 s` (or `2 min 5 s`)."""
    return f"no bytes for {left_text(seconds)}"


def bytes_text(size: float) -> str:
    """`1.2 GiB`, `41.3 MiB` or `512 B`."""
    if size >= GIB:
        return f"{size / GIB:.1f} GiB"
    if size >= MIB:
        return f"{size / MIB:.1f} MiB"
    return f"{size:.0f} B"


def rate_text(rate_bps: float) -> str:
    """`12.3 MiB/s`, or `—` before there is a rate."""
    return f"{bytes_text(rate_bps)}/s" if rate_bps > 0 else "—"


def left_text(left_s: float | None) -> str:
    """`1 h 2 min`, `3 min 5 s`, `40 s`, or `—` when unknown."""
    if left_s is None:
        return "—"
    seconds = round(left_s)
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds} s"


def percent_text(pull: ModelPull) -> str:
    """`40.0%`, or `—` before its size is known."""
    return f"{pull.fraction:.1%}" if pull.size_bytes else "—"


def progress_text(pull: ModelPull) -> str:
    """`40.0%: 41.2 MiB of 103.0 MiB, 12.3 MiB/s, 5 s left` while it runs
    (`40.0%: 41.2 MiB of 103.0 MiB, no bytes for 7 s` while it has stalled);
    its status and size after."""
    done = f"{bytes_text(pull.done_bytes)} of {bytes_text(pull.size_bytes)}"
    if pull.status not in PULL_OPEN:
        return f"{pull.status}: {done}"
    quiet = stalled_s(pull)
    if quiet is not None:
        return f"{percent_text(pull)}: {done}, {stalled_text(quiet)}"
    return (
        f"{percent_text(pull)}: {done}, {rate_text(pull.rate_bps)}, "
        f"{left_text(pull.left_s)} left"
    )


def plan_text(plan: dict) -> str:
    """What the pull resolved to before the download, in one line: the
    repository at its commit, its files with their sizes, what the model is
    and needs."""
    if not plan:
        return "—"
    files = ", ".join(
        f"{file['name']} ({bytes_text(file['size'])})" for file in plan.get("files", ())
    )
    facts = [plan.get("format", ""), plan.get("task", "")]
    if plan.get("architecture"):
        facts.append(plan["architecture"])
    if plan.get("context_length"):
        facts.append(f"trained context {plan['context_length']:,}")
    if plan.get("needs_mib"):
        facts.append(f"needs {plan['needs_mib']:,.0f} MiB served")
    text = (
        f"{plan.get('repo_id', '?')} at commit {str(plan.get('commit', ''))[:12]}: "
        f"{files}; {', '.join(fact for fact in facts if fact)}"
    )
    if plan.get("projector"):
        text += f"; vision projector {plan['projector']}"
    return text


def pull_progress(pull: ModelPull) -> dict:
    """The pull's progress for its page's script: figures and their text
    (`stalled_s`: for how long it has had no bytes, None while they come)."""
    quiet = stalled_s(pull)
    rate, left = rate_now(pull)
    return {
        "id": pull.pk,
        "status": pull.status,
        "open": pull.status in PULL_OPEN,
        "done_bytes": pull.done_bytes,
        "size_bytes": pull.size_bytes,
        "percent": percent_text(pull),
        "rate": rate_text(rate),
        "left": left_text(left),
        "stalled_s": None if quiet is None else round(quiet),
        "text": progress_text(pull),
        "message": pull.message,
        "model": pull.model.name if pull.model else "",
    }
