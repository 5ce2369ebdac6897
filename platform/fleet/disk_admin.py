"""The model admin's part about the models' disks (mixed into the ModelConfig
admin that fleet/admin.py registers): a column with what each model's files
take here; the action "Delete files from this host", which first shows what
it would delete and its size (as Django's delete confirmation does) and
refuses a model loaded or placed here with the reason; and, while the
cluster has nodes, "Delete files from a node…", which asks a node's
supervisor to delete them there (file_removals.py) after a confirmation
naming the node, refusing a model loaded or placed on it."""

from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.options import IS_POPUP_VAR
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html

from catalog.models import ModelConfig
from cluster.models import Node
from cluster.selectors import nodes_now

from .disk import (
    ModelInUse,
    disk_report,
    model_files_delete,
    model_files_plan,
    model_in_use_here,
)
from .file_removals import RemovalRefused, files_removal_request

MIB = 2**20


def size_text(size_bytes: float) -> str:
    """`812 KiB`, `812 MiB`, `1.2 GiB`."""
    if size_bytes < MIB:
        return f"{size_bytes / 1024:.0f} KiB"
    if size_bytes < 1024 * MIB:
        return f"{size_bytes / MIB:.0f} MiB"
    return f"{size_bytes / 1024 / MIB:.1f} GiB"


class ModelFilesAdmin:
    """For a ModelConfig admin: `files_here` (a column), the action
    `files_delete_here` (listed in the admin's `actions`) and, while the
    cluster has nodes, `files_delete_on_node` (added by get_actions)."""

    def get_actions(self, request):
        """The admin's actions, and "Delete files from a node…" while the
        cluster has a node that is not revoked (for users who may delete)."""
        actions = super().get_actions(request)
        if self.actions is None or IS_POPUP_VAR in request.GET:
            return actions
        if (
            self.has_delete_permission(request)
            and Node.objects.filter(revoked_at__isnull=True).exists()
        ):
            func, name, description = self.get_action("files_delete_on_node")
            actions[name] = (func, name, description)
        return actions

    @admin.display(description="files here")
    def files_here(self, model: ModelConfig) -> str:
        """What the model's files take on this host's disk (its last report,
        measured at most every 30 s), or "—" when they are not here."""
        mib = disk_report().get("models", {}).get(model.name)
        return "—" if mib is None else size_text(mib * MIB)

    @admin.action(description="Delete files from this host", permissions=["delete"])
    def files_delete_here(self, request, queryset):
        """The confirmation page (what would be deleted, its size); once
        confirmed, each model's files deleted. A model loaded or placed on
        this host is refused with the reason, as a message."""
        models = list(queryset)
        plans = {model.pk: model_files_plan(model=model) for model in models}
        refused = [model for model in models if plans[model.pk].in_use]
        for model in refused:
            self.message_user(
                request,
                f"Not deleted: {model.name} is {plans[model.pk].in_use}.",
                messages.ERROR,
            )
        if refused:
            return None
        if request.POST.get("post") != "yes":
            return self._files_confirmation(request, models, plans)
        for model in models:
            self._files_delete(request, model)
        return None

    def _files_confirmation(self, request, models, plans) -> TemplateResponse:
        rows = []
        for model in models:
            plan = plans[model.pk]
            rows.append(
                {
                    "model": model,
                    "removed": [(path, size_text(size)) for path, size in plan.removed],
                    "kept": plan.kept,
                    "size": size_text(plan.bytes),
                }
            )
        total = sum(plan.bytes for plan in plans.values())
        context = {
            **self.admin_site.each_context(request),
            "title": "Delete model files from this host?",
            "opts": self.model._meta,
            "rows": rows,
            "total": size_text(total),
            "nothing": not any(plan.removed for plan in plans.values()),
            "disk": disk_report(),
            "models": models,
            "action": "files_delete_here",
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(
            request, "admin/catalog/modelconfig/delete_files.html", context
        )

    def _files_delete(self, request, model: ModelConfig) -> None:
        try:
            freed = model_files_delete(model=model)
        except ModelInUse as refused:
            self.message_user(request, f"Not deleted: {refused}.", messages.ERROR)
            return
        except OSError as error:
            self.message_user(
                request,
                f"Could not delete all of {model.name}'s files: {error}",
                messages.ERROR,
            )
            return
        message = f"Deleted its files from this host ({size_text(freed)} freed)."
        self.log_change(request, model, message)
        self.message_user(
            request,
            f"{model.name}: files deleted from this host, {size_text(freed)} freed. "
            "Its row stays: pull or copy its files again to serve it here.",
            messages.SUCCESS,
        )

    # -- on another node ---------------------------------------------------------------

    @admin.action(description="Delete files from a node…", permissions=["delete"])
    def files_delete_on_node(self, request, queryset):
        """Which node (asked when the cluster has several), then the
        confirmation page naming it (what its last heartbeat says the models'
        files take there); once confirmed, each model's removal is recorded
        for that node's supervisor to carry out. A model loaded or placed on
        the node is refused with the reason, as a message."""
        models = list(queryset)
        nodes = list(Node.objects.filter(revoked_at__isnull=True).order_by("name"))
        if not nodes:
            self.message_user(
                request,
                "This cluster has no node to delete files from.",
                messages.ERROR,
            )
            return None
        chosen = request.POST.get("node", "")
        node = next((node for node in nodes if node.name == chosen), None)
        if node is None and len(nodes) == 1:
            node = nodes[0]
        if node is None:
            return self._node_files_page(request, models, nodes=nodes)
        refused = [
            (model, why)
            for model in models
            if (why := model_in_use_here(model=model, node=node.name))
        ]
        for model, why in refused:
            self.message_user(
                request,
                f"Not deleted from node {node.name}: {model.name} is {why}.",
                messages.ERROR,
            )
        if refused:
            return None
        if request.POST.get("post") != "yes":
            return self._node_files_page(request, models, node=node)
        self._files_delete_on_node(request, models, node)
        return None

    def _node_files_page(
        self, request, models, *, node: Node | None = None, nodes=()
    ) -> TemplateResponse:
        """The choice of a node (`nodes`), or the confirmation naming `node`."""
        statuses = {name: view.status.label for name, view in nodes_now().items()}
        choices = [
            {
                "node": choice,
                "status": statuses.get(choice.name, "—"),
                "sizes": list(
                    zip(
                        (model.name for model in models),
                        self._sizes_on(choice, models),
                        strict=True,
                    )
                ),
            }
            for choice in nodes
        ]
        rows = []
        if node is not None:
            removals = {
                removal.model: removal for removal in node.file_removal_states()
            }
            sizes = self._sizes_on(node, models)
            rows = [
                {
                    "model": model,
                    "size": size,
                    "earlier": _removal_text(removals.get(model.name)),
                }
                for model, size in zip(models, sizes, strict=True)
            ]
        title = (
            f"Delete model files from node {node.name}?"
            if node is not None
            else "Delete model files from which node?"
        )
        context = {
            **self.admin_site.each_context(request),
            "title": title,
            "opts": self.model._meta,
            "node": node,
            "node_status": statuses.get(node.name, "—") if node is not None else "",
            "choices": choices,
            "rows": rows,
            "models": models,
            "action": "files_delete_on_node",
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(
            request, "admin/catalog/modelconfig/delete_files_on_node.html", context
        )

    @staticmethod
    def _sizes_on(node: Node, models) -> list[str]:
        """What each model's files take on the node, as its last heartbeat
        reported (measured there at most every 30 s)."""
        disk = (node.hardware or {}).get("disk") or {}
        reported = disk.get("models") if isinstance(disk.get("models"), dict) else {}
        sizes = []
        for model in models:
            mib = reported.get(model.name)
            if mib is not None:
                sizes.append(size_text(mib * MIB))
            elif "models" in disk:
                sizes.append("none there")
            else:
                sizes.append("not reported yet")
        return sizes

    def _files_delete_on_node(self, request, models, node: Node) -> None:
        asked = []
        for model in models:
            try:
                files_removal_request(node=node, model=model)
            except (ModelInUse, RemovalRefused) as refused:
                self.message_user(
                    request,
                    f"Not deleted from node {node.name}: {refused}.",
                    messages.ERROR,
                )
                continue
            self.log_change(
                request, model, f"Asked node {node.name} to delete its files."
            )
            asked.append(model.name)
        if not asked:
            return
        self.message_user(
            request,
            format_html(
                "Asked node {} to delete the files of {}: its supervisor does it "
                "within seconds (at its next heartbeat; a node that is not "
                "beating does it once it is back). The outcome, the room freed "
                'or why it refused, shows on <a href="{}">the node\'s page</a> '
                "(Fleet → Nodes → {}, <i>file removals</i>). The models' rows "
                "stay.",
                node.name,
                ", ".join(asked),
                reverse("admin:cluster_node_change", args=[node.pk]),
                node.name,
            ),
            messages.SUCCESS,
        )


def _removal_text(removal) -> str:
    """An earlier removal of the model on the node, in words ("" for none)."""
    if removal is None:
        return ""
    if removal.state == "pending":
        return f"asked already at {removal.requested_at}, not carried out yet"
    if removal.state == "refused":
        return f"refused at {removal.at}: {removal.refused}"
    return f"deleted at {removal.at}, {size_text(removal.freed)} freed"
