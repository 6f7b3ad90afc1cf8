"""The composition root: builds every component from the config, starts them
in order, sends READY, and runs the stop sequence.

    signals ─► Daemon (SignalTarget) ─► flags and events
    supervisor (every tick): broker connection, leadership (leadership.py),
        reload, WATCHDOG
    tick loop (tickloop.py) ─► admission per active destination ─► pacer (pure)
        ─► shared ledger statements (batching.py) ─► publisher
    outcome consumer ─► ledger.apply_reports      reconciler ─► ledger.reclaim

No SQL and no AMQP here: those belong to ledger.py and publisher.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import anyio
import structlog

from pacerd import config as config_module
from pacerd import ledger as ledger_module
from pacerd.admission import AdmissionConfig
from pacerd.clock import Clock, SystemClock
from pacerd.config import instance_name
from pacerd.errors import ConfigError, LedgerError, LedgerUnavailable, MigrationError, PacerdError
from pacerd.exitcodes import EX_NOT_MIGRATED
from pacerd.leadership import LeaderLocks, Leadership
from pacerd.observer import OutcomeObserver, TelemetryObserver, due_metrics
from pacerd.outcomes import OutcomeConsumer
from pacerd.publisher import Broker
from pacerd.reconciler import Reconciler, ReconcilerConfig
from pacerd.sdnotify import Notifier, watchdog_interval_seconds
from pacerd.signals import handle_signals
from pacerd.telemetry import redact
from pacerd.tickloop import TickLoop

if TYPE_CHECKING:
    from pacerd.config import Config
    from pacerd.telemetry import Telemetry

log = structlog.get_logger("pacerd.daemon")

EX_OK = 0


class Daemon:
    """One pacerd process."""

    def __init__(
        self,
        cfg: Config,
        *,
        config_path: str | None,
        clock: Clock | None = None,
        telemetry: Telemetry | None = None,
        notifier: Notifier | None = None,
        shadow: bool = False,
        signals: bool = True,
    ) -> None:
        self.cfg = cfg
        self.signals = signals
        self.config_path = config_path
        self.clock = clock or SystemClock()
        self.telemetry = telemetry
        self.notifier = notifier or Notifier.from_environment()
        self.shadow = shadow or cfg.pacing.mode == "shadow"
        self.instance = instance_name(cfg)
        self.observer = TelemetryObserver(telemetry, self.clock)
        self.stop_requested = anyio.Event()
        self.ready_event = anyio.Event()
        self._reload_requested = False
        self._local_paused = False
        self._cancel_scope: anyio.CancelScope | None = None
        self._shadows: set[str] = set()  # destinations named like a group, not admitted
        self.ledger: ledger_module.Ledger | None = None
        self.broker = Broker(
            url=cfg.broker.url,
            queue_type=cfg.broker.queue_type,
            publish_timeout_seconds=cfg.broker.publish_timeout_seconds,
            declare_queues=cfg.broker.declare_queues,
            name=f"pacerd {self.instance}",
            route=lambda destination: self.cfg.route_for(destination).routing_key,
        )
        self.locks = LeaderLocks(cfg.database.dsn, instance=self.instance, clock=self.clock)
        self.leadership: Leadership | None = None  # once the ledger says how many partitions
        self.tickloop: TickLoop | None = None
        self._broker_retry_at = 0.0
        self._broker_backoff = 0.5
        self.ready = False
        # WATCHDOG=1 at half systemd's interval (at most once a second without one).
        self._watchdog_every = min(1.0, watchdog_interval_seconds() or 1.0)
        self._next_watchdog = 0.0
        self._ledger_error: str | None = None  # the last supervisor pass's, for /readyz

    # -- SignalTarget ----------------------------------------------------------

    def request_stop(self) -> None:
        if not self.stop_requested.is_set():
            log.info("stop_requested", grace_seconds=self.cfg.daemon.shutdown_grace_seconds)
            self.notifier.stopping("stopping: draining confirms")
            self.stop_requested.set()

    def force_stop(self) -> None:
        log.warning("forced_stop")
        self.stop_requested.set()
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    def reload(self) -> None:
        self._reload_requested = True

    def pause_local(self) -> None:
        if not self._local_paused:
            log.info("admission_paused_locally")
        self._local_paused = True

    def resume_local(self) -> None:
        if self._local_paused:
            log.info("admission_resumed_locally")
        self._local_paused = False

    # -- what the tick loop is given -------------------------------------------------

    def _admission_config(self, destination: str) -> AdmissionConfig:
        return AdmissionConfig(
            destination=destination,
            queue=self.cfg.queue_for(destination),
            params=self.cfg.pacing_for(destination),
            claim_seconds=self.cfg.leases.claim_seconds,
            offer_seconds=self.cfg.leases.offer_seconds,
            instance=self.instance,
            shadow=self.shadow,
        )

    def _route(self, destination: str) -> tuple[str, str] | None:
        """(routing key, queue) of ``destination``; None for one named like a
        group whose ``match`` it does not fit: its routing key would also
        reach the group's queue, so it is not admitted (logged once)."""
        group = self.cfg.groups.get(destination)
        if group is not None and self.cfg.group_for(destination) != destination:
            if destination not in self._shadows:
                self._shadows.add(destination)
                log.error(
                    "destination_not_admitted", destination=destination,
                    reason="named like a group whose match it does not fit", match=group.match,
                )  # fmt: skip
            return None
        route = self.cfg.route_for(destination)
        return route.routing_key, route.queue

    def _tick_seconds(self) -> float:
        return min(
            [self.cfg.pacing.tick_seconds]
            + [self.cfg.pacing_for(d).tick_seconds for d in self.cfg.destinations]
        )

    # -- start-up ----------------------------------------------------------------------

    async def _retry_until_up(self, what: str, attempt: Any) -> Any:
        backoff = 0.5
        while not self.stop_requested.is_set():
            try:
                return await attempt()
            except (LedgerUnavailable, PacerdError) as exc:
                if isinstance(exc, MigrationError):
                    raise
                log.warning(f"{what}_unavailable", error=str(exc), retry_in=backoff)
                with anyio.move_on_after(backoff):
                    await self.stop_requested.wait()
                backoff = min(backoff * 2, 10.0)
        return None

    async def _connect_ledger(self) -> ledger_module.Ledger:
        led = await ledger_module.Ledger.connect(
            self.cfg.database.dsn,
            max_size=self.cfg.database.pool_max_size,
            connect_timeout=self.cfg.database.connect_timeout_seconds,
        )
        try:
            pending = await ledger_module.pending_migrations(led.pool)
            if pending:
                raise MigrationError(
                    f"the ledger schema is not up to date ({', '.join(pending)} pending):"
                    " run `pacerd migrate` first"
                )
            await led.write_settings(ledger_module.settings_from_retry(self.cfg.retry))
            for destination in self.cfg.destinations:
                await led.ensure_destination(destination)
            self.leadership = Leadership(
                self.locks,
                partitions=await led.read_partitions(),
                instance=self.instance,
                clock=self.clock,
                broker_grace_seconds=max(5.0, 3 * self.cfg.pacing.tick_seconds),
            )
        except BaseException:
            await led.close()
            raise
        return led

    async def _declare_known(self, *, every_destination: bool) -> None:
        """Declares the groups' queues and the configured destinations' (and,
        at start, every known destination's): after each broker connect."""
        names = set(self.cfg.destinations)
        if every_destination and self.ledger is not None:
            names |= {row.destination for row in await self.ledger.list_destinations()}
        routes = {
            (r.routing_key, r.queue) for r in map(self.cfg.route_for_group, self.cfg.groups)
        } | {route for d in sorted(names) if (route := self._route(d)) is not None}
        for routing_key, queue in sorted(routes):
            try:
                await self.broker.declare_destination(routing_key, queue)
            except PacerdError as exc:
                log.error("declare_failed", routing_key=routing_key, queue=queue, error=str(exc))

    # -- supervision ---------------------------------------------------------------

    async def _supervise_broker(self) -> None:
        if self.broker.connected:
            self._broker_backoff = 0.5
            return
        now = self.clock.monotonic()
        if now < self._broker_retry_at:
            return
        try:
            await self.broker.connect()
            log.info("broker_connected", url=self.cfg.redacted_broker_url())
            self._broker_backoff = 0.5
            await self._declare_known(every_destination=False)
        except PacerdError as exc:
            log.warning("broker_unavailable", error=str(exc), retry_in=self._broker_backoff)
            self._broker_retry_at = now + self._broker_backoff
            self._broker_backoff = min(self._broker_backoff * 2, 10.0)

    def _apply_reload(self) -> None:
        self._reload_requested = False
        if self.config_path is None:
            log.warning("reload_ignored", reason="no config file")
            return
        self.notifier.reloading("reloading config")
        try:
            new = config_module.load_config(self.config_path)
        except ConfigError as exc:
            log.error("reload_rejected", problems=exc.problems)
            self.notifier.ready("running (reload rejected: invalid config)")
            return
        diff = config_module.reload_diff(self.cfg, new)
        self.cfg = new
        if self.tickloop is not None:
            self.tickloop.reconfigure()
        if self.telemetry is not None:
            from pacerd.telemetry import set_log_level

            set_log_level(new.telemetry.log_level)
        log.info("config_reloaded", changed=diff.changed, needs_restart=diff.needs_restart)
        self.notifier.ready("running (config reloaded)")

    def _healthy(self) -> bool:
        """The tick loop, and every destination it runs, passed recently."""
        limit = 3 * self._tick_seconds() + self.cfg.broker.publish_timeout_seconds + 5
        return self.tickloop is None or self.tickloop.healthy(limit)

    async def _supervisor(self, *, task_status: Any) -> None:
        assert self.ledger is not None
        assert self.leadership is not None
        started = False
        deadline = self.clock.monotonic()
        while not self.stop_requested.is_set():
            if self._reload_requested:
                self._apply_reload()
            try:
                await self._supervise_broker()
                await self.leadership.supervise(
                    self.ledger, broker_connected=self.broker.connected,
                    settle_seconds=self._tick_seconds(),
                )  # fmt: skip
                if self.telemetry is not None:
                    self.telemetry.record_leadership(
                        {str(p): True for p in sorted(self.leadership.held())}
                    )
                self._ledger_error = None
            except PacerdError as exc:
                if isinstance(exc, LedgerError):
                    self._ledger_error = redact(str(exc))
                log.warning("supervisor_pass_failed", error=str(exc))
            if not started:
                task_status.started()
                started = True
            now = self.clock.monotonic()
            if self.ready and now >= self._next_watchdog and self._healthy():
                self.notifier.watchdog()
                self._next_watchdog = now + self._watchdog_every
            deadline = max(deadline + self._tick_seconds(), self.clock.monotonic())
            with anyio.move_on_after(max(0.0, deadline - self.clock.monotonic())):
                await self.stop_requested.wait()

    # -- lifecycle -------------------------------------------------------------------

    async def run(self) -> int:
        with anyio.CancelScope() as scope:
            self._cancel_scope = scope
            async with anyio.create_task_group() as outer:
                if self.signals:
                    await outer.start(handle_signals, self)
                code = await self._run_services()
                outer.cancel_scope.cancel()
                return code
        return EX_OK  # forced stop

    async def _run_services(self) -> int:
        self.notifier.status("connecting to the ledger")
        try:
            self.ledger = await self._retry_until_up("ledger", self._connect_ledger)
        except MigrationError as exc:
            log.error("ledger_not_migrated", error=str(exc))
            return EX_NOT_MIGRATED
        if self.ledger is None:
            return EX_OK
        assert self.leadership is not None
        try:
            log.info(
                "pacerd_starting", instance=self.instance, database=self.cfg.redacted_dsn(),
                broker=self.cfg.redacted_broker_url(), shadow=self.shadow,
                partitions=self.leadership.partitions,
            )  # fmt: skip
            await self._retry_until_up("broker", self.broker.connect)
            if self.stop_requested.is_set():
                return EX_OK
            await self._declare_known(every_destination=True)
            await self._run_components(self.ledger)
            return EX_OK
        finally:
            with anyio.CancelScope(shield=True):
                await self._close()

    async def _run_components(self, ledger: ledger_module.Ledger) -> None:
        assert self.leadership is not None
        leadership = self.leadership
        outcomes = OutcomeObserver(self.telemetry)
        consumer = OutcomeConsumer(
            ledger=ledger, broker=self.broker, clock=self.clock,
            prefetch=self.cfg.broker.outcome_prefetch, on_result=outcomes.on_outcomes,
            on_report=outcomes.on_report, wait_connected=self._wait_broker,
        )  # fmt: skip
        reconciler = Reconciler(
            ledger=ledger, clock=self.clock,
            config=ReconcilerConfig(
                interval_seconds=self.cfg.reconcile.interval_seconds,
                batch_size=self.cfg.reconcile.batch_size,
            ),
            on_result=outcomes.on_reconcile, telemetry=self.telemetry,
            should_run=lambda: not self.shadow and leadership.reconciles(),
        )  # fmt: skip
        self.tickloop = TickLoop(
            ledger=ledger, broker=self.broker, clock=self.clock, leadership=leadership,
            admission_config=self._admission_config, route=self._route,
            observer=self.observer, is_paused_locally=lambda: self._local_paused,
            stop=self.stop_requested, tick_seconds=self._tick_seconds,
            forget=self.observer.forget,
        )  # fmt: skip
        with anyio.CancelScope() as services_scope:
            async with anyio.create_task_group() as tg:
                await tg.start(consumer.run)
                await tg.start(reconciler.run)
                if self.cfg.telemetry.http_address:
                    from pacerd.health import serve_health

                    address = self.cfg.telemetry.http_address
                    await tg.start(
                        lambda task_status: serve_health(
                            address,
                            liveness=self._liveness,
                            readiness=self._readiness,
                            task_status=task_status,
                        )
                    )
                await tg.start(self._supervisor)
                admissions_scope = anyio.CancelScope()
                admissions_done = anyio.Event()

                async def ticks(*, task_status: Any) -> None:
                    assert self.tickloop is not None
                    try:
                        with admissions_scope:
                            await self.tickloop.run(task_status=task_status)
                    finally:
                        admissions_done.set()

                await tg.start(ticks)
                tg.start_soon(due_metrics, ledger, self, self.observer)
                self.ready = True
                self.ready_event.set()
                self.notifier.ready(f"running as {self.instance}")
                log.info("pacerd_ready", instance=self.instance)
                await self.stop_requested.wait()
                # Stop admitting: every tick stops at its next release slice, its
                # confirms drained and its unpublished claims released; past the
                # grace, the ticks are cancelled (and still release).
                grace = self.cfg.daemon.shutdown_grace_seconds
                admissions_scope.deadline = anyio.current_time() + grace
                await admissions_done.wait()
                services_scope.cancel()

    async def _wait_broker(self) -> None:
        while not self.broker.connected:
            with anyio.move_on_after(0.25):
                await self.stop_requested.wait()

    async def _close(self) -> None:
        if self.leadership is not None:
            await self.leadership.give_up(self.ledger)
        await self.broker.close()
        await self.locks.close()
        if self.ledger is not None:
            await self.ledger.close()
        log.info("pacerd_stopped", instance=self.instance)

    def _liveness(self) -> tuple[bool, dict[str, Any]]:
        return self._healthy(), {"instance": self.instance}

    def _readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ledger and broker reachable (the supervisor pass reads the ledger every tick)."""
        ledger = self.ledger is not None and self._ledger_error is None
        ok = self.ready and self.broker.connected and ledger
        data: dict[str, Any] = {"broker": self.broker.connected, "ledger": ledger}
        if self._ledger_error is not None:
            data["ledger_error"] = self._ledger_error
        held = sorted(self.leadership.held()) if self.leadership is not None else []
        return ok, {**data, "leading": sorted(self.locks.held), "partitions": held}


def main(cfg: Config, *, config_path: str | None, shadow: bool = False) -> int:
    """``pacerd run``: set up telemetry, run the daemon on uvloop, return the exit code."""
    from pacerd.telemetry import setup_telemetry

    telemetry = setup_telemetry(
        cfg.telemetry.service_name,
        cfg.telemetry.log_level,
        cfg.telemetry.log_format,
        prometheus=bool(cfg.telemetry.http_address),
        set_global=True,
        instance=instance_name(cfg),
        series=cfg.series_for,
    )

    async def run() -> int:
        # Built inside the event loop: the daemon's events belong to it.
        daemon = Daemon(cfg, config_path=config_path, telemetry=telemetry, shadow=shadow)
        return await daemon.run()

    try:
        code: int = anyio.run(run, backend_options={"use_uvloop": True})
    finally:
        telemetry.shutdown()
    return code
