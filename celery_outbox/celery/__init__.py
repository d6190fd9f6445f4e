"""The only modules that import celery or kombu: app configuration, the kombu publisher, the tasks."""
