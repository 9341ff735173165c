"""Operators' adapter registry in the admin (staff only, as all of the admin): add (upload a .safetensors
file, validated and copied into the adapter store by the engine's registry) and remove; the changelist shows
the registry as it is. A malformed file is a form error; one the registry refuses (targets, rank, name) is a
row marked refused, with the reason."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.http import HttpRequest

from engine import envs
from engine.adapters.formats import NotSafetensors, parse_header
from engine.adapters.registry import ADAPTABLE, AdapterError, store
from onepiece_platform.accounts.models import audit
from onepiece_platform.adapters.models import AdapterAction


class AdapterActionForm(forms.ModelForm):
    file = forms.FileField(required=False, help_text="add: the LoRA's .safetensors file (diffusers/PEFT format)")
    model_dir = forms.CharField(required=False, help_text="add: the workflow's model folder to check the targets "
                                "against (default: <state dir>/models/<workflow>)")

    class Meta:
        model = AdapterAction
        fields = ["action", "name", "workflow", "scale_default"]
        widgets = {"workflow": forms.Select(choices=[("", "-")] + [(w, w) for w in sorted(ADAPTABLE)])}

    def clean_file(self) -> Any:
        """A malformed file is a form error on ``file`` (its safetensors header read and checked entry by
        entry, bounded); whether it fits the workflow's model is the registry's verdict, recorded on the row."""
        upload = self.cleaned_data.get("file")
        if not upload:
            return upload
        name = Path(upload.name or "adapter").name
        if not name.endswith(".safetensors"):
            raise forms.ValidationError(f"adapters are .safetensors files only (no pickles), got {name!r}")
        upload.seek(0)
        try:
            parse_header(upload, upload.size, name)
        except NotSafetensors as exc:
            raise forms.ValidationError(str(exc)) from None
        finally:
            upload.seek(0)
        return upload

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        if data.get("action") == AdapterAction.ADD and "file" not in self.errors \
                and (not data.get("file") or not data.get("workflow")):
            raise forms.ValidationError("adding takes a file and a workflow")
        return data


def apply(action: AdapterAction, upload: Any = None, model_dir: str = "") -> None:
    """Carry the action out on the registry; record the verdict on the row."""
    reg = store()
    try:
        if action.action == AdapterAction.ADD:
            folder = Path(model_dir) if model_dir else envs.STATE_DIR / "models" / action.workflow
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / (Path(getattr(upload, "name", "") or "adapter").name)
                with open(path, "wb") as f:
                    for chunk in upload.chunks():
                        f.write(chunk)
                a = reg.add(action.name, path, action.workflow, folder, action.scale_default)
            action.status, action.digest = "done", a.digest
            action.detail = f"rank {a.rank}, {len(a.targets)} target modules"
        else:
            action.status = "done" if reg.remove(action.name) else "refused"
            action.detail = "" if action.status == "done" else f"no adapter named {action.name!r}"
    except AdapterError as exc:
        action.status, action.detail = "refused", f"{exc.field}: {exc}"


@admin.register(AdapterAction)
class AdapterActionAdmin(admin.ModelAdmin):
    form = AdapterActionForm
    list_display = ["created_at", "action", "name", "workflow", "status", "detail", "actor"]
    list_filter = ["action", "status"]
    search_fields = ["name"]
    readonly_fields = ["status", "detail", "digest", "actor", "created_at"]
    change_list_template = "admin/adapters/adapteraction/change_list.html"

    def has_change_permission(self, request: HttpRequest, obj: object = None) -> bool:
        return False  # an action is a record: to do something else, add another

    def save_model(self, request: HttpRequest, obj: AdapterAction, form: Any, change: bool) -> None:
        obj.actor = request.user
        apply(obj, form.cleaned_data.get("file"), form.cleaned_data.get("model_dir", ""))
        super().save_model(request, obj, form, change)
        audit(request.user, f"adapters.{obj.action}", obj.name, workflow=obj.workflow, status=obj.status,
              detail=obj.detail)
        level = messages.ERROR if obj.status == "refused" else messages.INFO
        self.message_user(request, f"{obj.action} {obj.name}: {obj.status} {obj.detail}", level)

    def changelist_view(self, request: HttpRequest, extra_context: dict[str, Any] | None = None) -> Any:
        registry = [{**a.public(), "bytes": a.bytes} for a in store().list()]
        return super().changelist_view(request, {**(extra_context or {}), "registry": registry})
