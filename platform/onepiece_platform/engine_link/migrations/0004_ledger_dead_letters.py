
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('engine_link', '0003_rejection_set_mode'),
    ]

    operations = [
        migrations.CreateModel(
            name='DeadLetter',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('entry_id', models.CharField(max_length=64, unique=True)),
                ('uid', models.CharField(blank=True, db_index=True, max_length=64)),
                ('fields', models.JSONField()),
                ('reason', models.CharField(choices=[('malformed', 'malformed'), ('unknown_job', 'unknown job'), ('failed', 'could not apply')], max_length=16)),
                ('detail', models.TextField(blank=True)),
                ('created_at', models.DateTimeField(auto_now_add=True, db_index=True)),
            ],
            options={
                'ordering': ['-created_at', '-id'],
            },
        ),
        migrations.CreateModel(
            name='HeldEvent',
            fields=[
                ('id', models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name='ID')),
                ('entry_id', models.CharField(max_length=64, unique=True)),
                ('uid', models.CharField(db_index=True, max_length=64)),
                ('fields', models.JSONField()),
                ('held_at', models.DateTimeField(auto_now_add=True)),
            ],
            options={
                'ordering': ['id'],
            },
        ),
        migrations.AddField(
            model_name='streamcursor',
            name='applied',
            field=models.PositiveBigIntegerField(default=0, help_text='events applied to the ledger'),
        ),
        migrations.AddField(
            model_name='streamcursor',
            name='dead',
            field=models.PositiveBigIntegerField(default=0, help_text='events sent to the dead letters'),
        ),
        migrations.AddField(
            model_name='streamcursor',
            name='held',
            field=models.PositiveBigIntegerField(default=0, help_text='events held because their job was not known yet'),
        ),
        migrations.AddField(
            model_name='streamcursor',
            name='retried',
            field=models.PositiveBigIntegerField(default=0, help_text='transient failures met (a lost database connection, Redis away) and tried again, the cursor unmoved'),
        ),
    ]
