"""The shop's own tables (``manage.py migrate`` creates them, beside the outbox's ``outbox_*`` tables)."""

from __future__ import annotations

from django.db import models


class Order(models.Model):  # type: ignore[misc]
    id = models.CharField(max_length=64, primary_key=True)
    customer_id = models.CharField(max_length=64)
    email = models.CharField(max_length=320)
    currency = models.CharField(max_length=3)
    total_cents = models.BigIntegerField()
    status = models.CharField(max_length=32, default="placed")
    created_at_ms = models.BigIntegerField()

    class Meta:
        db_table = "orders"

    def __str__(self) -> str:
        return f"order {self.id}"


class OrderLine(models.Model):  # type: ignore[misc]
    id = models.BigAutoField(primary_key=True)
    order = models.ForeignKey(Order, on_delete=models.CASCADE, related_name="lines", db_column="order_id")
    sku = models.CharField(max_length=64)
    quantity = models.IntegerField()
    unit_price_cents = models.BigIntegerField()

    class Meta:
        db_table = "order_lines"
        ordering = ("id",)

    def __str__(self) -> str:
        return f"{self.quantity} x {self.sku}"


class Shipment(models.Model):  # type: ignore[misc]
    """The Django consumer's effect: one shipment per OrderPlaced, however often it is delivered."""

    id = models.BigAutoField(primary_key=True)
    order_id = models.CharField(max_length=64, db_index=True)
    address_line = models.CharField(max_length=500, default="")
    items = models.IntegerField()
    created_at_ms = models.BigIntegerField()

    class Meta:
        db_table = "shipments"

    def __str__(self) -> str:
        return f"shipment {self.id} of order {self.order_id}"
