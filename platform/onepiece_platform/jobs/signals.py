"""Receivers of the jobs app: a deleted ledger row takes its objects in the object store with it.

A row is deleted by the ledger's clean-up (``onepiece.clean_up``, which deletes the objects first and marks
the rows), by an operator in the admin, or with its owner (the user's deletion cascades). Whatever the path,
a completed job's output that was stored and not yet deleted (``output_purged_at`` unset) is deleted from
the store once the transaction that deleted the row commits (never for a row whose deletion rolled back).
"""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction
from django.db.models.signals import post_delete
from django.dispatch import receiver

from onepiece_platform.jobs.models import Job

log = logging.getLogger(__name__)


def _purge(uid: str) -> None:
    from engine.store.objects import ObjectStoreError, result_prefix
    from onepiece_platform.engine_link.objects import get_object_store

    store = get_object_store()
    if store is None:
        return
    try:
        store.purge(result_prefix(uid))
    except ObjectStoreError:  # the bucket's lifecycle rule is the backstop (docs/operations.md)
        log.warning("could not delete the objects of deleted job %s", uid, exc_info=True)


@receiver(post_delete, sender=Job, dispatch_uid="onepiece.jobs.purge_output")
def purge_deleted_output(sender: Any, instance: Job, **kwargs: Any) -> None:
    if instance.uid and instance.output_key and instance.output_purged_at is None:
        transaction.on_commit(lambda uid=instance.uid: _purge(uid))
