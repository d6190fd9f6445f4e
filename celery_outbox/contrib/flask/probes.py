"""``/readyz`` and ``/metrics`` on a Flask app: what a load balancer and Prometheus ask of a web process.

Both answer from fixed names only (check names and reasons, metric names): a failed check's details
(host, port, user, driver text) go to the server log, never into the answer.
"""

from __future__ import annotations

import json

from flask import Flask, Response, current_app
from prometheus_client import CollectorRegistry

from celery_outbox.celery.probe import broker_probe
from celery_outbox.contrib.flask.csp import NO_CONTENT_POLICY, security_headers
from celery_outbox.ops import health
from celery_outbox.ops import metrics as ops_metrics
from celery_outbox.outbox import Outbox


def mount_readiness(app: Flask, outbox: Outbox, path: str, broker_timeout_s: float) -> None:
    """``GET <path>``: 200 when the database answers, the schema is at the library's head revision and
    the broker accepts a connection; else 503 naming the failed checks. The answer is built from check
    names and fixed reasons only (``health.Readiness.public_dict``): no host, port, user or driver text;
    the details go to the server log."""
    probe = broker_probe(outbox.broker_url, timeout_s=broker_timeout_s, settings=outbox.settings)

    def readyz() -> Response:
        result = health.readiness(outbox.sessions(), prefix=outbox.settings.table_prefix, broker=probe)
        resp = Response(json.dumps(result.public_dict(), sort_keys=True), 200 if result.ok else 503,
                        {"Content-Type": "application/json", "Cache-Control": "no-store"})
        if not result.ok:
            current_app.logger.warning("not ready: %s", "; ".join(c.line() for c in result.failed))
            resp.headers["Retry-After"] = "5"
        security_headers(resp, csp=NO_CONTENT_POLICY)
        return resp

    app.add_url_rule(path, endpoint="celery_outbox_readyz", view_func=readyz, methods=["GET"])


def mount_metrics(app: Flask, registry: CollectorRegistry, path: str) -> None:
    """``GET <path>``: the registry in Prometheus' text format."""

    def metrics() -> Response:
        resp = Response(ops_metrics.render(registry), 200, {"Content-Type": ops_metrics.CONTENT_TYPE})
        security_headers(resp, csp=NO_CONTENT_POLICY)
        return resp

    app.add_url_rule(path, endpoint="celery_outbox_metrics", view_func=metrics, methods=["GET"])
