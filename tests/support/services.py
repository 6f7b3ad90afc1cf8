"""Where the tests find PostgreSQL and RabbitMQ, and the URLs derived from
them: one database or virtual host of the server, or the same service
reached through a port of the fault proxy."""

from __future__ import annotations

import os
from urllib.parse import quote, urlsplit, urlunsplit

ADMIN_DSN = os.environ.get("PACERD_TEST_DSN", "postgresql://postgres@127.0.0.1:5432/postgres")
AMQP_URL = os.environ.get("PACERD_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


def dsn_for(database: str, admin_dsn: str = ADMIN_DSN) -> str:
    """``admin_dsn`` with its database replaced by ``database``."""
    return urlunsplit(urlsplit(admin_dsn)._replace(path=f"/{database}"))


def amqp_url_for(vhost: str, amqp_url: str = AMQP_URL) -> str:
    """``amqp_url`` with its virtual host replaced by ``vhost``."""
    return urlunsplit(urlsplit(amqp_url)._replace(path="/" + quote(vhost, safe="")))


def with_port(url: str, port: int) -> str:
    """``url`` (a DSN or an AMQP URL) on another port of the same host, with
    its credentials: the service reached through a proxy."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    host = f"{parts.hostname}:{port}"
    return urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))


def with_user(url: str, user: str, password: str | None = None) -> str:
    """``url`` (a DSN or an AMQP URL) with other credentials: the same
    service and database or virtual host, reached as ``user``."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    login = quote(user, safe="") + (f":{quote(password, safe='')}" if password else "")
    return urlunsplit(parts._replace(netloc=f"{login}@{host}"))
