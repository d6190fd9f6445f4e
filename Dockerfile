# One image for the orders app, the worker, beat, the standalone relay and flower.
FROM python:3.11-slim
WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY pyproject.toml README.md celeryconfig.py ./
COPY outbox ./outbox
COPY orders ./orders
COPY relay ./relay
COPY consumers ./consumers
COPY ops ./ops
RUN pip install . flower gunicorn
EXPOSE 8000 5555 9808
CMD ["outbox", "--help"]
