"""Schemathesis against the OpenAPI schema: every operation, positive and negative data, all checks.

Runs through the WSGI app in this process. The engine is the in-process front
over the real job store, with a thread playing the workers so generated
submissions run to completion. Examples are bounded so the module stays well
under a minute. (schemathesis' pytest plugin does not load under pytest 9, so
the operations are driven with hypothesis directly.)
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode, checks

from tests.fixtures.web import make_user, sd_body, wan_body
from tests.fixtures.workers import Workers

MAX_EXAMPLES = 6
# Submissions whose validity depends on content the schema cannot state (an input must decode as an
# image; Wan's frames = 4k + 1 and pixel budget across width x height; a webhook URL's host must resolve
# to an address the platform may call; a lora name must be an adapter the operators registered for that
# workflow): schema-valid data may get a 400 there, so
# positive_data_acceptance is not run on these. Every other check runs on them.
CONTENT_DEPENDENT = {"POST /api/v1/jobs", "POST /v1/videos", "POST /api/v1/webhooks", "PATCH /api/v1/webhooks/{id}",
                     "POST /v1/images/generations"}
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _run(operation: Any, mode: GenerationMode, headers: dict[str, str], failures: list[str]) -> None:
    @seed(0)  # reproducible in CI; the examples still cover every operation in both modes
    @given(case=operation.as_strategy(mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        excluded = [checks.positive_data_acceptance] if operation.label in CONTENT_DEPENDENT else []
        case.call_and_validate(headers={**headers, **(case.headers or {})}, excluded_checks=excluded)

    try:
        check()
    except Unsatisfiable:
        pass  # no negative data exists for an operation without inputs
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # FailureGroup is a BaseExceptionGroup; collected to report every operation
        failures.append(f"{operation.label} [{mode.value}]: {str(exc)[:1200]}")


def test_every_operation_conforms_to_the_schema(db: None, web_redis: str, settings: Any) -> None:
    from django.core.wsgi import get_wsgi_application

    # schemathesis sends bad credentials on purpose (ignored_auth): the failure limit is raised here
    settings.ONEPIECE = {**settings.ONEPIECE, "IMAGE_WAIT_S": 10.0, "AUTH_FAILURES_LIMIT": 10**6,
                         "WEBHOOK_ALLOW_PRIVATE": True,
                         "DEFAULT_QUOTA": {"max_concurrent_jobs": 1000, "gpu_seconds_per_day": 1e9,
                                           "max_pixels": 1280 * 1280, "max_frames": 129, "max_steps": 1000}}
    schema = schemathesis.openapi.from_wsgi("/api/schema/", get_wsgi_application())
    _, key = make_user("fuzz")
    workers = Workers(web_redis)
    failures: list[str] = []
    try:
        operations = [r.ok() for r in schema.get_all_operations()]
        assert len(operations) >= 15
        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                _run(op, mode, {"Authorization": f"Bearer {key}"}, failures)
        # the content-dependent submissions, with valid content: every check, positive acceptance included
        by_label = {op.label: op for op in operations}
        auth = {"Authorization": f"Bearer {key}"}
        for body in (sd_body(), wan_body()):
            r = by_label["POST /api/v1/jobs"].Case(body=body, media_type="application/json").call_and_validate(
                headers=auth)
            assert r.status_code == 202
        # a webhook endpoint whose URL may be called (a fresh key: the fuzzing may have given the first one)
        _, hook_key = make_user("fuzz-hooks")
        r = by_label["POST /api/v1/webhooks"].Case(body={"url": "http://127.0.0.1:9/hook"},
                                                   media_type="application/json").call_and_validate(
            headers={"Authorization": f"Bearer {hook_key}"})
        assert r.status_code == 201
    finally:
        workers.close()
    assert not failures, "\n\n".join(failures)
