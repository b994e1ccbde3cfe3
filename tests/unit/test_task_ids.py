"""Task ids made in bulk at submit (cloud_hub/service/submit.py, ``task_ids``): what
``uuid.uuid4().hex`` gives, one random draw for the whole batch."""

from __future__ import annotations

import uuid

from cloud_hub.service.submit import task_ids


def test_task_ids_are_distinct_version_4_uuids() -> None:
    ids = task_ids(5000)
    assert len(set(ids)) == 5000 and task_ids(0) == []
    for tid in ids[:500]:
        u = uuid.UUID(tid)
        assert u.hex == tid and u.version == 4 and u.variant == uuid.RFC_4122
