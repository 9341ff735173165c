
import django.db.models.deletion
from django.db import migrations, models


def stage_times_to_runs(apps, schema_editor):
    """The old ``stage_times`` document (stage -> {started, finished}) becomes attempt-1 stage runs."""
    Job = apps.get_model("jobs", "Job")
    StageRun = apps.get_model("jobs", "StageRun")
    for job in Job.objects.exclude(stage_times={}).only("pk", "stage_times").iterator():
        StageRun.objects.bulk_create([
            StageRun(job_id=job.pk, stage=stage, attempt=1, started=t.get("started"), finished=t.get("finished"))
            for stage, t in (job.stage_times or {}).items() if isinstance(t, dict)
        ])


class Migration(migrations.Migration):

    dependencies = [
        ('jobs', '0001_initial'),
    ]

    operations = [
        migrations.AddField(
            model_name='job',
            name='charge_settled',
            field=models.PositiveIntegerField(default=0, editable=False, help_text='the charge_version the quota counters were told'),
        ),
        migrations.AddField(
            model_name='job',
            name='charge_version',
            field=models.PositiveIntegerField(default=0, editable=False, help_text='bumped each time the charge of a finished job is set'),
        ),
        migrations.AddField(
            model_name='job',
            name='submitting',
            field=models.BooleanField(default=False, editable=False, help_text='the engine has not answered the submission yet'),
        ),
        migrations.AlterField(
            model_name='job',
            name='cost_measured_gpu_s',
            field=models.FloatField(blank=True, help_text="sum of the stage runs' device seconds, over attempts", null=True),
        ),
        migrations.CreateModel(
            name='StageRun',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('stage', models.CharField(max_length=64)),
                ('attempt', models.PositiveSmallIntegerField(default=1)),
                ('started', models.FloatField(blank=True, null=True)),
                ('finished', models.FloatField(blank=True, null=True)),
                ('stopped', models.BooleanField(default=False, help_text='gave up early (cancel, deadline, error)')),
                ('detail', models.CharField(blank=True, max_length=500)),
                ('job', models.ForeignKey(on_delete=django.db.models.deletion.CASCADE, related_name='stage_runs', to='jobs.job')),
            ],
            options={
                'ordering': ['job', 'attempt', 'started', 'id'],
                'constraints': [models.UniqueConstraint(fields=('job', 'stage', 'attempt'), name='one_stage_run_per_attempt')],
            },
        ),
        migrations.RunPython(stage_times_to_runs, migrations.RunPython.noop),
        migrations.RemoveField(
            model_name='job',
            name='stage_times',
        ),
    ]
