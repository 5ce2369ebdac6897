"""The admin's Catalog -> Models -> Add from Hugging Face page: a repository's
files at a pinned commit, its GGUF quantizations side by side with what each
needs (read from its header over range requests, before a byte of weights)
and whether it fits on each engine (fit.py), and a Pull button per
quantization that starts the pull's background job and opens its page. On
a cluster the pull runs on the node chosen, by default where the model's
first replica would be placed (pull_node), which the message after says.

It lives in the fleet app because the fit reads engines and nodes, which the
catalog may not import; PlacedModelConfigAdmin serves its URL (`hub_urls`).
Hub reads block: this is a plain sync admin view. A Hub that refuses (an
unknown repository, a gated one, a name taken) is an admin message, never a
server error."""

from dataclasses import dataclass, field
from urllib.parse import urlencode

from django import forms
from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse

from catalog.hub import (
    GgufFacts,
    HubError,
    HubFile,
    HubRepo,
    gguf_facts,
    hub_repo,
    hub_search,
)
from catalog.hub_folders import FolderFacts, folder_facts, is_folder_model
from catalog.models import MODEL_NAME_VALIDATOR, ModelFormat
from catalog.pull import default_name
from catalog.pull_jobs import pull_start
from catalog.pull_progress import bytes_text
from cluster.models import Node

from .fit import Place, fit_lines, fit_places, size_text
from .pull_node import pull_node_default

TEMPLATE = "admin/catalog/modelconfig/add_from_hub.html"
REPO_ID = r"^[A-Za-z0-9][\w.-]*/[\w.-]+$"
# A search shows this many repositories, the most downloaded first.
SEARCH_LIMIT = 20


class HubSearchForm(forms.Form):
    """Repositories by name, GGUF ones only unless unticked."""

    q = forms.CharField(
        label="Search the Hub",
        max_length=200,
        widget=forms.TextInput(attrs={"placeholder": "smollm2", "size": 48}),
    )
    gguf = forms.BooleanField(label="GGUF only", required=False, initial=True)


class HubRepoForm(forms.Form):
    """Which repository, at which revision."""

    repo = forms.RegexField(
        label="Repository",
        regex=REPO_ID,
        max_length=200,
        error_messages={"invalid": "Give it as ORG/REPO, e.g. bartowski/SmolLM2-GGUF."},
        widget=forms.TextInput(attrs={"placeholder": "ORG/REPO", "size": 48}),
    )
    revision = forms.CharField(
        max_length=200,
        required=False,
        initial="main",
        help_text="A branch, tag or commit (empty: main); pinned to its commit now.",
    )


class PullForm(forms.Form):
    """One GGUF file of a repository at its commit, pulled under a name, on a
    node (empty: where its first replica would be placed, pull_node)."""

    repo = forms.RegexField(regex=REPO_ID, max_length=200, widget=forms.HiddenInput)
    # Its GGUF file; empty: the repository is a transformers model's folder.
    file = forms.CharField(max_length=1000, required=False, widget=forms.HiddenInput)
    commit = forms.CharField(max_length=200, widget=forms.HiddenInput)
    name = forms.CharField(
        max_length=128, label="Model name", validators=[MODEL_NAME_VALIDATOR]
    )
    node = forms.ChoiceField(required=False, label="Pull on")

    def __init__(self, *args, nodes: list[str], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if nodes:
            self.fields["node"].choices = [
                ("", "where its first replica is placed"),
                *((name, f"node {name}") for name in nodes),
            ]
        else:
            del self.fields["node"]


@dataclass
class Candidate:
    """A GGUF file of the repository: what its header says and needs, where it
    fits, and its pull form; `problem` when its header could not be read."""

    file: HubFile
    size: str = ""
    facts: GgufFacts | None = None
    needs: str = ""
    fit: list[str] = field(default_factory=list)
    problem: str = ""
    form: PullForm | None = None


def hub_urls(model_admin) -> list[URLPattern]:
    """The page's URL, under the model admin's (admin:catalog_modelconfig_hub)."""

    def view(request: HttpRequest) -> HttpResponse:
        return model_add_from_hub(request, model_admin=model_admin)

    return [
        path(
            "add-from-hub/",
            model_admin.admin_site.admin_view(view),
            name="catalog_modelconfig_hub",
        )
    ]


def model_add_from_hub(request: HttpRequest, *, model_admin) -> HttpResponse:
    """GET: the form, and with a repository its files, quantizations and
    fit. POST: start the pull of one and open its page. PermissionDenied
    without the permission to add models."""
    if not model_admin.has_add_permission(request):
        raise PermissionDenied
    nodes = list(
        Node.objects.filter(revoked_at__isnull=True)
        .order_by("name")
        .values_list("name", flat=True)
    )
    if request.method == "POST":
        return _pull(request, nodes)
    asked = request.GET.copy()
    asked.setdefault("revision", "main")  # a link with the repository alone
    form = HubRepoForm(asked if "repo" in asked else None)
    search = HubSearchForm(request.GET if "q" in request.GET else None)
    context = {
        **model_admin.admin_site.each_context(request),
        "title": "Add a model from Hugging Face",
        "opts": model_admin.model._meta,
        "form": form,
        "search": search,
        "found": None,
        "repo": None,
    }
    if search.is_valid():
        try:
            context["found"] = hub_search(
                search.cleaned_data["q"],
                gguf=search.cleaned_data["gguf"],
                limit=SEARCH_LIMIT,
            )
        except HubError as error:
            messages.error(request, error.message)
    if form.is_valid():
        try:
            repo = hub_repo(
                form.cleaned_data["repo"], form.cleaned_data["revision"] or "main"
            )
        except HubError as error:
            messages.error(request, error.message)
        else:
            context.update(_repo_context(repo, nodes))
    return TemplateResponse(request, TEMPLATE, context)


@dataclass
class Folder:
    """A transformers or sentence-transformers repository, pulled as a folder:
    the files that make it, what it is and needs, where it fits, and its pull
    form; `problem` when its files could not be read."""

    facts: FolderFacts | None = None
    size: str = ""
    parameters: str = ""
    needs: str = ""
    fit: list[str] = field(default_factory=list)
    problem: str = ""
    form: PullForm | None = None


def _repo_context(repo: HubRepo, nodes: list[str]) -> dict:
    """The repository's files with sizes, and each GGUF file as a candidate
    (or, without GGUF files, the transformers model it is)."""
    where = fit_places(model_format=ModelFormat.GGUF)
    candidates = [
        _candidate(repo, file, where, nodes, index)
        for index, file in enumerate(repo.gguf_files())
    ]
    folder = _folder(repo, nodes) if not candidates and is_folder_model(repo) else None
    projector = repo.projector()
    return {
        "repo": repo,
        "folder": folder,
        "files": [(file, bytes_text(file.size)) for file in repo.files],
        "candidates": candidates,
        "projector": projector,
        "projector_size": bytes_text(projector.size) if projector else "",
    }


def _candidate(
    repo: HubRepo, file: HubFile, where: list[Place], nodes: list[str], index: int
) -> Candidate:
    """One GGUF file: its header read (a few MiB), its need and fit."""
    candidate = Candidate(file=file, size=bytes_text(file.size))
    try:
        candidate.facts = gguf_facts(repo, file)
    except HubError as error:
        candidate.problem = error.message
        return candidate
    need = candidate.facts.needs_mib()
    candidate.needs = size_text(need)
    candidate.fit = fit_lines(need, where)
    candidate.form = PullForm(
        initial={
            "repo": repo.repo_id,
            "file": file.name,
            "commit": repo.commit,
            "name": default_name(repo.repo_id, file),
        },
        nodes=nodes,
        auto_id=f"id_pull{index}_%s",  # one form per file on the page
    )
    return candidate


def _folder(repo: HubRepo, nodes: list[str]) -> Folder:
    """The repository as a transformers model: its small files and weight
    headers read (kB), its need and fit on the engines serving its format."""
    folder = Folder()
    try:
        folder.facts = facts = folder_facts(repo)
    except HubError as error:
        folder.problem = error.message
        return folder
    folder.size = bytes_text(sum(file.size for file in facts.files))
    folder.parameters = ", ".join(
        f"{count / 1e6:,.1f}M {dtype}" for dtype, count in facts.parameters.items()
    )
    folder.needs = size_text(facts.needs_mib)
    folder.fit = fit_lines(facts.needs_mib, fit_places(model_format=facts.format))
    folder.form = PullForm(
        initial={
            "repo": repo.repo_id,
            "file": "",
            "commit": repo.commit,
            "name": repo.repo_id.rsplit("/", 1)[-1].lower(),
        },
        nodes=nodes,
        auto_id="id_folder_%s",
    )
    return folder


def _pull(request: HttpRequest, nodes: list[str]) -> HttpResponse:
    """Start the pull the form names (pull_start: the plan read again at the
    commit shown), then its page; back to the repository with the reason
    when it is refused."""
    form = PullForm(request.POST, nodes=nodes)
    if not form.is_valid():
        messages.error(request, f"The pull was not started: {_errors(form)}")
        return HttpResponseRedirect(request.path)
    data = form.cleaned_data
    try:
        pull = pull_start(
            source=f"hf:{data['repo']}/{data['file']}"
            if data["file"]
            else f"hf:{data['repo']}",
            name=data["name"],
            revision=data["commit"],
            node=data.get("node") or "",
            node_default=pull_node_default,
            user=request.user,
        )
    except HubError as error:
        messages.error(request, f"The pull was not started: {error.message}")
        query = urlencode({"repo": data["repo"], "revision": data["commit"]})
        return HttpResponseRedirect(f"{request.path}?{query}")
    where = pull.node_reason or (f"node {pull.node}" if pull.node else "")
    messages.success(
        request,
        f"Pulling {pull.name}: {bytes_text(pull.size_bytes)} to download"
        + (f", on {where}." if where else "."),
    )
    return HttpResponseRedirect(
        reverse("admin:catalog_modelpull_change", args=[pull.pk])
    )


def _errors(form: forms.Form) -> str:
    return "; ".join(
        f"{name}: {' '.join(errors)}" for name, errors in form.errors.items()
    )
