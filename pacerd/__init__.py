"""pacerd: paced release of durable, due work from PostgreSQL into RabbitMQ."""

from __future__ import annotations

__version__ = "0.1.0"
