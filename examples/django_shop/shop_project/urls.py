"""POST /orders places an order and its OrderPlaced event; GET /orders/<id> reads it back; /admin/ lists the
dead letters (replay, purge)."""

from __future__ import annotations

from django.contrib import admin
from django.urls import path
from shop import views

urlpatterns = [
    path("admin/", admin.site.urls),
    path("orders", views.create_order, name="create-order"),
    path("orders/<str:order_id>", views.get_order, name="get-order"),
]
