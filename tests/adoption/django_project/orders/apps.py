from django.apps import AppConfig


class OrdersConfig(AppConfig):
    name = "orders"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self):
        # consumers import models: include them once the app registry is ready, in every process
        from proj.celery import outbox

        from orders.consumers import notify

        outbox.include(notify)
