"""Flask support: the ``FlaskOutbox`` extension, the dead-letter admin pages, ``/readyz``, ``/metrics``
and ``flask outbox ...``.

The extension, in the usual shape (declare at import, bind in the app factory)::

    db = SQLAlchemy(model_class=Base)
    outbox = FlaskOutbox()
    outbox.define_tables(Base.metadata)

    @outbox.consumer("OrderPlaced", name="notify")
    def notify(session, event): ...

    @outbox.task(name="shop.confirm")                 # importable by any module: a proxy of each app's task
    def confirm(session, order_id): ...

    def create_app():
        app = Flask("shop")
        app.config.from_prefixed_env()            # OUTBOX_*, SQLALCHEMY_DATABASE_URI, CELERY...
        db.init_app(app)
        outbox.init_app(app, db=db)
        return app

One module per part, as the Django side is split: ``extension.py`` (``FlaskOutbox``, ``init_app``),
``admin.py`` (the dead-letter pages; their Jinja templates in ``templates/outbox_admin/``), ``csp.py``
(the security headers and the Content-Security-Policy), ``probes.py`` (``/readyz``, ``/metrics``) and
``cli.py`` (``flask outbox``).
"""

from __future__ import annotations

from celery_outbox.errors import missing_extra

try:
    import flask  # noqa: F401  (every module of this package needs it: one line naming the extra if it is missing)
except ModuleNotFoundError as e:
    raise missing_extra(e.name, needed_by="celery_outbox.contrib.flask") from None

from celery_outbox.contrib.flask.admin import CSRF_COOKIE, CSRF_FIELD, EXT, make_blueprint
from celery_outbox.contrib.flask.cli import flask_cli
from celery_outbox.contrib.flask.csp import CONTENT_SECURITY_POLICY, security_headers
from celery_outbox.contrib.flask.extension import EXT_OUTBOX, FlaskOutbox, init_app, settings_from_config

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "CSRF_COOKIE",
    "CSRF_FIELD",
    "EXT",
    "EXT_OUTBOX",
    "FlaskOutbox",
    "flask_cli",
    "init_app",
    "make_blueprint",
    "security_headers",
    "settings_from_config",
]
