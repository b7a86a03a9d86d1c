"""Alembic environment: run migrations on the connection the store hands over."""

from alembic import context

from exporter.store.schema import metadata

connection = context.config.attributes.get("connection")
if connection is None:
    raise RuntimeError("migrations are applied through exporter.store.Store.migrate(), which passes a connection")
context.configure(connection=connection, target_metadata=metadata, render_as_batch=connection.dialect.name == "sqlite")
with context.begin_transaction():
    context.run_migrations()
