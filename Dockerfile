# One image for the orders app, the worker, beat, the standalone relay and flower: the library installed
# from the wheel, the reference deployment (orders/, relay/, consumers/, celeryconfig.py, devtools/) beside it.
FROM python:3.11-slim
WORKDIR /app
# OUTBOX_APP: the reference deployment names its Outbox for the `outbox` command, as any user's image does.
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PYTHONPATH=/app OUTBOX_APP=relay.app
COPY pyproject.toml README.md ./
COPY celery_outbox ./celery_outbox
# gunicorn comes with [flask]; flower with the same bound as the dev extra (tests/unit/test_compose.py checks both).
RUN pip install ".[postgres,redis,flask]" "flower>=2.0,<3"
COPY celeryconfig.py ./
COPY orders ./orders
COPY relay ./relay
COPY consumers ./consumers
COPY devtools ./devtools
EXPOSE 8000 5555 9808
CMD ["outbox", "--help"]
