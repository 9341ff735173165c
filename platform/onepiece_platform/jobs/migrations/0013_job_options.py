"""A job's options apart from its model's parameters: ``Job.options`` (engine.workflow.options); the options
that rows of before kept among their ``params`` (quality, preview_every, lora) move into it."""

from django.db import migrations, models

MOVED = ("preview_every", "quality", "lora")  # engine.workflow.options.PARAM_OPTIONS when this was written
DEFAULTS = {"preview_every": 0, "quality": "lossless"}  # Options.to_json leaves a default out


def split(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    for job in Job.objects.exclude(params={}).only("pk", "params").iterator(chunk_size=500):
        params = dict(job.params or {})
        moved = {k: params.pop(k) for k in MOVED if k in params}
        if not moved:
            continue
        options = {k: v for k, v in moved.items() if v not in (None, [], DEFAULTS.get(k))}
        Job.objects.filter(pk=job.pk).update(params=params, options=options)


def join(apps, schema_editor):
    Job = apps.get_model("jobs", "Job")
    for job in Job.objects.exclude(options={}).only("pk", "params", "options").iterator(chunk_size=500):
        Job.objects.filter(pk=job.pk).update(params={**(job.params or {}), **(job.options or {})})


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0012_job_priority_help'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='options',
            field=models.JSONField(blank=True, default=dict, help_text="the request's quality, preview_every and lora (engine.workflow.options)"),
        ),
        migrations.AlterField(
            model_name='job',
            name='params',
            field=models.JSONField(default=dict, help_text="the model's parameters, as its spec resolved them"),
        ),
        migrations.RunPython(split, join),
    ]
