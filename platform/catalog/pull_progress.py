"""A pull's progress as people read it: bytes done of its size, rate, time
left, and its plan in one line; the same figures for the admin's list, its
change page and the JSON its page polls (pull_progress)."""

from .models import PULL_OPEN, ModelPull

MIB = 1 << 20
GIB = 1 << 30


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
    """`40.0%: 41.2 MiB of 103.0 MiB, 12.3 MiB/s, 5 s left` while it runs;
    its status and size after."""
    done = f"{bytes_text(pull.done_bytes)} of {bytes_text(pull.size_bytes)}"
    if pull.status in PULL_OPEN:
        return (
            f"{percent_text(pull)}: {done}, {rate_text(pull.rate_bps)}, "
            f"{left_text(pull.left_s)} left"
        )
    return f"{pull.status}: {done}"


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
    """The pull's progress for its page's script: figures and their text."""
    return {
        "id": pull.pk,
        "status": pull.status,
        "open": pull.status in PULL_OPEN,
        "done_bytes": pull.done_bytes,
        "size_bytes": pull.size_bytes,
        "percent": percent_text(pull),
        "rate": rate_text(pull.rate_bps),
        "left": left_text(pull.left_s),
        "text": progress_text(pull),
        "message": pull.message,
        "model": pull.model.name if pull.model else "",
    }
