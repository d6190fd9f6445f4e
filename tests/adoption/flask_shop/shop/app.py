# The glue a Flask + Flask-SQLAlchemy team writes to adopt celery-outbox (README "Adopt it" copies this file).
from celery import shared_task
from flask import Flask, jsonify, request
from flask_sqlalchemy import SQLAlchemy

from celery_outbox import Event
from celery_outbox.contrib.flask import FlaskOutbox
from shop.models import Base, Confirmation, Notification, Order

db = SQLAlchemy(model_class=Base)
outbox = FlaskOutbox()
outbox.define_tables(Base.metadata)              # outbox_* tables in MY metadata; alembic_filters() hides them

@outbox.consumer("OrderPlaced", name="notify", max_retries=3)
def notify(session, event):                      # effect + inbox row commit together
    session.add(Notification(order_id=event.payload["order_id"]))

@shared_task(name="shop.confirm")
def confirm(order_id):                           # a plain task, in the app context: db.session works
    db.session.add(Confirmation(order_id=order_id))
    db.session.commit()

def create_app():
    app = Flask("shop")
    app.config.from_prefixed_env("SHOP")         # SHOP_SQLALCHEMY_DATABASE_URI, SHOP_CELERY__broker_url; OUTBOX_* too
    db.init_app(app)
    outbox.init_app(app, db=db)                  # settings, db.engine, Celery, /readyz, /metrics, `flask outbox`

    @app.post("/orders")
    def place():
        with outbox.transaction(db.session):     # the order, its event and its task: one commit
            db.session.add(Order(id=request.json["id"]))
            outbox.publish(db.session, Event("OrderPlaced", {"order_id": request.json["id"]}))
            confirm.delay(request.json["id"])
            db.session.commit()
        return jsonify(ok=True), 201

    return app
