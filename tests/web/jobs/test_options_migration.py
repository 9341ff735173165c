"""Migration 0013 moves a job's options out of its params (engine.workflow.options): rows written before it
kept ``quality``, ``preview_every`` and ``lora`` among their params; after it the params are the model's and
``Job.options`` holds the options that are not their defaults, and going back puts them in the params again."""

from __future__ import annotations

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

BEFORE, AFTER = [("jobs", "0012_job_priority_help")], [("jobs", "0013_job_options")]
LORA = [{"name": "alpha", "scale": 0.5, "digest": "d" * 64}]


@pytest.mark.django_db(transaction=True)
def test_old_rows_options_move_out_of_their_params_and_back() -> None:
    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)
    apps = executor.loader.project_state(BEFORE).apps
    User, Job = apps.get_model("auth", "User"), apps.get_model("jobs", "Job")
    user = User.objects.create(username="before-0013")
    model = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 28}
    old = {
        "cached": {**model, "quality": "high", "preview_every": 2},
        "plain": {**model, "quality": "lossless", "preview_every": 0},
        "adapted": {**model, "preview_every": 0, "lora": LORA},
        "model only": dict(model),
    }
    pks = {k: Job.objects.create(owner=user, workflow="flux.1-dev", params=p).pk for k, p in old.items()}

    executor = MigrationExecutor(connection)
    executor.migrate(AFTER)
    Job = executor.loader.project_state(AFTER).apps.get_model("jobs", "Job")
    rows = {k: Job.objects.get(pk=pk) for k, pk in pks.items()}
    assert all(r.params == model for r in rows.values())
    assert {k: r.options for k, r in rows.items()} == {
        "cached": {"quality": "high", "preview_every": 2}, "plain": {}, "adapted": {"lora": LORA}, "model only": {}}

    executor = MigrationExecutor(connection)
    executor.migrate(BEFORE)  # and back: the options among the params again (the defaults stay out)
    Job = executor.loader.project_state(BEFORE).apps.get_model("jobs", "Job")
    assert Job.objects.get(pk=pks["cached"]).params == old["cached"]
    assert Job.objects.get(pk=pks["adapted"]).params == {**model, "lora": LORA}
    executor = MigrationExecutor(connection)
    executor.migrate(executor.loader.graph.leaf_nodes("jobs"))
