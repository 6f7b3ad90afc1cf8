"""The supervisor: what each destination's admission is given from the
config, and every tick the broker connection (reconnected with backoff, the
groups' queues declared again), one leadership pass, a config reload when
SIGHUP asked for one, the leadership metrics and systemd's WATCHDOG.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import structlog

from pacerd import config as config_module
from pacerd.admission import AdmissionConfig
from pacerd.errors import ConfigError, LedgerError, LedgerUnavailable, MigrationError, PacerdError
from pacerd.ledger import settings_from_retry
from pacerd.sdnotify import watchdog_interval_seconds
from pacerd.telemetry import redact

if TYPE_CHECKING:
    from pacerd.config import Config
    from pacerd.daemon import Daemon

log = structlog.get_logger("pacerd.daemon")


class Supervisor:
    """The daemon's per-tick care (one per daemon)."""

    def __init__(self, daemon: Daemon) -> None:
        self.d = daemon
        self.shadows: set[str] = set()  # destinations named like a group, not admitted
        self._broker_retry_at = 0.0
        self._broker_backoff = 0.5
        # WATCHDOG=1 at half systemd's interval (at most once a second without one).
        self._watchdog_every = min(1.0, watchdog_interval_seconds() or 1.0)
        self._next_watchdog = 0.0
        self._led: tuple[frozenset[int], int] | None = None  # leadership last recorded
        self.ledger_error: str | None = None  # the last pass's, for /readyz

    def admission_config(self, destination: str) -> AdmissionConfig:
        return AdmissionConfig(
            destination=destination,
            queue=self.d.cfg.queue_for(destination),
            params=self.d.cfg.pacing_for(destination),
            claim_seconds=self.d.cfg.leases.claim_seconds,
            offer_seconds=self.d.cfg.leases.offer_seconds,
            instance=self.d.instance,
            shadow=self.d.shadow,
        )

    def route(self, destination: str) -> tuple[str, str] | None:
        """(routing key, queue) of ``destination``; None for one named like a
        group whose ``match`` it does not fit: its routing key would also
        reach the group's queue, so it is not admitted (logged once)."""
        group = self.d.cfg.groups.get(destination)
        if group is not None and self.d.cfg.group_for(destination) != destination:
            if destination not in self.shadows:
                self.shadows.add(destination)
                log.error(
                    "destination_not_admitted", destination=destination,
                    reason="named like a group whose match it does not fit", match=group.match,
                )  # fmt: skip
            return None
        route = self.d.cfg.route_for(destination)
        return route.routing_key, route.queue

    def tick_seconds(self) -> float:
        return min(
            [self.d.cfg.pacing.tick_seconds]
            + [self.d.cfg.pacing_for(d).tick_seconds for d in self.d.cfg.destinations]
        )

    async def declare_known(self, *, every_destination: bool) -> None:
        """Declares the groups' queues and the configured destinations' (and,
        at start, every known destination's): after each broker connect."""
        names = set(self.d.cfg.destinations)
        if every_destination and self.d.ledger is not None:
            names |= {row.destination for row in await self.d.ledger.list_destinations()}
        routes = {
            (r.routing_key, r.queue) for r in map(self.d.cfg.route_for_group, self.d.cfg.groups)
        } | {route for d in sorted(names) if (route := self.route(d)) is not None}
        for routing_key, queue in sorted(routes):
            try:
                await self.d.broker.declare_destination(routing_key, queue)
            except PacerdError as exc:
                log.error("declare_failed", routing_key=routing_key, queue=queue, error=str(exc))

    async def _supervise_broker(self) -> None:
        if self.d.broker.connected:
            self._broker_backoff = 0.5
            return
        now = self.d.clock.monotonic()
        if now < self._broker_retry_at:
            return
        try:
            await self.d.broker.connect()
            log.info("broker_connected", url=self.d.cfg.redacted_broker_url())
            self._broker_backoff = 0.5
            await self.declare_known(every_destination=False)
        except PacerdError as exc:
            log.warning("broker_unavailable", error=str(exc), retry_in=self._broker_backoff)
            self._broker_retry_at = now + self._broker_backoff
            self._broker_backoff = min(self._broker_backoff * 2, 10.0)

    async def _apply_reload(self) -> None:
        self.d._reload_requested = False
        if self.d.config_path is None:
            log.warning("reload_ignored", reason="no config file")
            return
        self.d.notifier.reloading("reloading config")
        try:
            new = config_module.load_config(self.d.config_path)
        except ConfigError as exc:
            log.error("reload_rejected", problems=exc.problems)
            self.d.notifier.ready("running (reload rejected: invalid config)")
            return
        diff = config_module.reload_diff(self.d.cfg, new)
        old, self.d.cfg = self.d.cfg, new
        if self.d.tickloop is not None:
            self.d.tickloop.reconfigure()
        if self.d.telemetry is not None:
            from pacerd.telemetry import set_log_level

            set_log_level(new.telemetry.log_level)
        try:
            await self._apply_to_services(old, new)
        except PacerdError as exc:  # the rest stands; the next reload tries again
            log.error("reload_incomplete", error=str(exc))
        log.info("config_reloaded", changed=diff.changed, needs_restart=diff.needs_restart)
        self.d.notifier.ready("running (config reloaded)")

    async def _apply_to_services(self, old: Config, new: Config) -> None:
        """What a reload changes outside the process: the SQL API's retry
        limits, the destinations it names (registered), and the queues of
        its groups and destinations (declared, a no-op for those declared
        already: a changed ``queue`` or a new group is bound before the next
        publish goes to it)."""
        ledger = self.d.ledger
        if ledger is None:
            return
        if new.retry != old.retry:
            await ledger.write_settings(settings_from_retry(new.retry))
        for destination in sorted(set(new.destinations) - set(old.destinations)):
            await ledger.ensure_destination(destination)
        if self.d.broker.connected and (
            new.destinations != old.destinations or new.groups != old.groups
        ):
            await self.declare_known(every_destination=True)

    def healthy(self) -> bool:
        """The tick loop, and every destination it runs, passed recently."""
        limit = 3 * self.tick_seconds() + self.d.cfg.broker.publish_timeout_seconds + 5
        return self.d.tickloop is None or self.d.tickloop.healthy(limit)

    async def run(self, *, task_status: Any) -> None:
        assert self.d.ledger is not None
        assert self.d.leadership is not None
        started = False
        deadline = self.d.clock.monotonic()
        while not self.d.stop_requested.is_set():
            if self.d._reload_requested:
                await self._apply_reload()
            try:
                await self._supervise_broker()
                await self.d.leadership.supervise(
                    self.d.ledger, broker_connected=self.d.broker.connected,
                    settle_seconds=self.tick_seconds(),
                )  # fmt: skip
                self._record_leadership()
                self.ledger_error = None
            except PacerdError as exc:
                if isinstance(exc, LedgerError):
                    self.ledger_error = redact(str(exc))
                log.warning("supervisor_pass_failed", error=str(exc))
            if not started:
                task_status.started()
                started = True
            now = self.d.clock.monotonic()
            if self.d.ready_event.is_set() and now >= self._next_watchdog and self.healthy():
                self.d.notifier.watchdog()
                self._next_watchdog = now + self._watchdog_every
            deadline = max(deadline + self.tick_seconds(), self.d.clock.monotonic())
            with anyio.move_on_after(max(0.0, deadline - self.d.clock.monotonic())):
                await self.d.stop_requested.wait()

    def _record_leadership(self) -> None:
        """``pacerd.leader`` of every destination this instance has run: led
        while its partition is held (recorded when that changes)."""
        loop, leadership, telemetry = self.d.tickloop, self.d.leadership, self.d.telemetry
        if telemetry is None or loop is None or leadership is None:
            return
        held = frozenset(leadership.held())
        if self._led == (held, len(loop.seen)):
            return
        self._led = (held, len(loop.seen))
        telemetry.record_leadership({d: p in held for d, p in loop.seen.items()})

    async def retry_until_up(self, what: str, attempt: Any) -> Any:
        backoff = 0.5
        while not self.d.stop_requested.is_set():
            try:
                return await attempt()
            except (LedgerUnavailable, PacerdError) as exc:
                if isinstance(exc, MigrationError):
                    raise
                log.warning(f"{what}_unavailable", error=str(exc), retry_in=backoff)
                with anyio.move_on_after(backoff):
                    await self.d.stop_requested.wait()
                backoff = min(backoff * 2, 10.0)
        return None

    async def wait_broker(self) -> None:
        while not self.d.broker.connected:
            with anyio.move_on_after(0.25):
                await self.d.stop_requested.wait()

    def liveness(self) -> tuple[bool, dict[str, Any]]:
        return self.healthy(), {"instance": self.d.instance}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ledger and broker reachable (the supervisor pass reads the ledger every tick)."""
        ledger = self.d.ledger is not None and self.ledger_error is None
        ok = self.d.ready_event.is_set() and self.d.broker.connected and ledger
        data: dict[str, Any] = {"broker": self.d.broker.connected, "ledger": ledger}
        if self.ledger_error is not None:
            data["ledger_error"] = self.ledger_error
        held = sorted(self.d.leadership.held()) if self.d.leadership is not None else []
        return ok, {**data, "leading": sorted(self.d.locks.held), "partitions": held}
