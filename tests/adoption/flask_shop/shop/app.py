# The glue a Flask + SQLAlchemy team writes to adopt celery-outbox (README "Adopt it" copies this file).
import sqlalchemy as sa
from celery import Celery
from flask import Flask, jsonify, request
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from celery_outbox import Event, Outbox, Settings


class Base(DeclarativeBase):
    pass

class Order(Base):
    __tablename__ = "orders"
    id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)

class Notification(Base):
    __tablename__ = "notifications"
    order_id: Mapped[str] = mapped_column(sa.String(64), primary_key=True)

def create(database_url: str, broker_url: str, namespace: str = "shop") -> tuple[Flask, Outbox]:
    engine = sa.create_engine(database_url)
    Session = sessionmaker(engine)
    outbox = Outbox(Celery("shop", broker=broker_url), engine=engine, settings=Settings(namespace=namespace))
    outbox.define_tables(Base.metadata)          # outbox_* tables in MY metadata (my Alembic sees them)

    @outbox.consumer("OrderPlaced", name="notify", max_retries=3)
    def notify(session, event):                  # effect + inbox row commit together
        session.add(Notification(order_id=event.payload["order_id"]))

    web = Flask("shop")

    @web.post("/orders")
    def place():
        with Session.begin() as s:               # the order and its event: one commit
            s.add(Order(id=request.json["id"]))
            outbox.publish(s, Event("OrderPlaced", {"order_id": request.json["id"]}))
        return jsonify(ok=True), 201

    return web, outbox
