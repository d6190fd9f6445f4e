"""WSGI entry point: ``gunicorn shop_project.wsgi`` or ``manage.py runserver``."""

from __future__ import annotations

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop_project.settings")

application = get_wsgi_application()
