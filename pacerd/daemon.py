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

from functools import partial
from typing import TYPE_CHECKING

import anyio
import structlog

from pacerd import heap
from pacerd import ledger as ledger_module
from pacerd.clock import Clock, SystemClock
from pacerd.config import instance_name
from pacerd.errors import MigrationError
from pacerd.exitcodes import EX_NOT_MIGRATED, EX_OK
from pacerd.leadership import LeaderLocks, Leadership
from pacerd.notices import ControlNotices
from pacerd.observer import OutcomeObserver, TelemetryObserver, due_metrics
from pacerd.outcomes import OutcomeConsumer
from pacerd.publisher import Broker
from pacerd.reconciler import Reconciler, ReconcilerConfig
from pacerd.sdnotify import Notifier
from pacerd.signals import handle_signals
from pacerd.supervisor import Supervisor
from pacerd.tickloop import TickLoop

if TYPE_CHECKING:
    from collections.abc import Callable

    from pacerd.config import Config
    from pacerd.telemetry import Telemetry

log = structlog.get_logger("pacerd.daemon")


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
        on_ready: Callable[[], None] = lambda: None,  # `pacerd run`: heap.settle
    ) -> None:
        self.cfg, self.on_ready = cfg, on_ready
        self.signals = signals
        self.config_path = config_path
        self.clock = clock or SystemClock()
        self.telemetry = telemetry
        self.notifier = notifier or Notifier.from_environment()
        self.shadow = shadow or cfg.pacing.mode == "shadow"
        self.instance = instance_name(cfg)
        self.observer = TelemetryObserver(telemetry, self.clock, cfg.leases.offer_seconds)
        self.stop_requested = anyio.Event()
        self.ready_event = anyio.Event()
        self._reload_requested = False
        self._local_paused = False
        self._cancel_scope: anyio.CancelScope | None = None
        self.ledger: ledger_module.Ledger | None = None
        self.broker = Broker(
            url=cfg.broker.url, queue_type=cfg.broker.queue_type, name=f"pacerd {self.instance}",
            publish_timeout_seconds=cfg.broker.publish_timeout_seconds,
            declare_queues=cfg.broker.declare_queues,
            route=lambda destination: self.cfg.route_for(destination).routing_key,
        )  # fmt: skip
        self.locks = LeaderLocks(cfg.database.dsn, instance=self.instance, clock=self.clock)
        self.leadership: Leadership | None = None  # once the ledger says how many partitions
        self.tickloop: TickLoop | None = None
        self.supervisor = Supervisor(self)

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
        if self.tickloop is not None:
            self.tickloop.wake()

    # -- start-up ----------------------------------------------------------------------

    async def _connect_ledger(self) -> ledger_module.Ledger:
        led = await ledger_module.Ledger.connect(
            self.cfg.database.dsn, max_size=self.cfg.database.pool_max_size,
            connect_timeout=self.cfg.database.connect_timeout_seconds,
        )  # fmt: skip
        self.observer.count_statements(led.statements, self.locks.statements)
        try:
            await led.prepare(self.cfg.retry, self.cfg.destinations)
            self.leadership = Leadership(
                self.locks, partitions=await led.read_partitions(), instance=self.instance,
                clock=self.clock, broker_grace_seconds=max(5.0, 3 * self.cfg.pacing.tick_seconds),
                reconciler=not self.shadow,
            )  # fmt: skip
        except BaseException:
            await led.close()
            raise
        return led

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
            self.ledger = await self.supervisor.retry_until_up("ledger", self._connect_ledger)
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
            await self.supervisor.retry_until_up("broker", self.broker.connect)
            if self.stop_requested.is_set():
                return EX_OK
            await self.supervisor.declare_known(every_destination=True)
            await self._run_components(self.ledger)
            return EX_OK
        finally:
            with anyio.CancelScope(shield=True):
                await self._close()

    async def _run_components(self, ledger: ledger_module.Ledger) -> None:
        assert self.leadership is not None
        leadership = self.leadership
        outcomes = OutcomeObserver(self.telemetry, self.observer.releases)
        consumer = OutcomeConsumer(
            ledger=ledger, broker=self.broker, clock=self.clock,
            prefetch=self.cfg.broker.outcome_prefetch, on_result=outcomes.on_outcomes,
            on_report=outcomes.on_report, wait_connected=self.supervisor.wait_broker,
        )  # fmt: skip
        reconciler = Reconciler(
            ledger=ledger, clock=self.clock,
            config=ReconcilerConfig(**self.cfg.reconcile.model_dump()),
            on_result=outcomes.on_reconcile, telemetry=self.telemetry,
            should_run=leadership.reconciles,  # never in shadow mode: it takes no reconciler lock
        )  # fmt: skip
        tickloop = self.tickloop = TickLoop(
            ledger=ledger, broker=self.broker, clock=self.clock, leadership=leadership,
            admission_config=self.supervisor.admission_config, route=self.supervisor.route,
            observer=self.observer, is_paused_locally=lambda: self._local_paused,
            stop=self.stop_requested, tick_seconds=self.supervisor.tick_seconds,
            forget=self.observer.forget, grace_seconds=self.cfg.daemon.shutdown_grace_seconds,
            notices=ControlNotices(self.cfg.database.dsn, clock=self.clock),
        )  # fmt: skip
        with anyio.CancelScope() as services_scope:
            async with anyio.create_task_group() as tg:
                await tg.start(consumer.run)
                await tg.start(reconciler.run)
                if self.cfg.telemetry.http_address:
                    from pacerd.health import serve_health

                    await tg.start(partial(
                        serve_health, self.cfg.telemetry.http_address,
                        liveness=self.supervisor.liveness, readiness=self.supervisor.readiness,
                    ))  # fmt: skip
                await tg.start(self.supervisor.run)
                await tg.start(tickloop.run)
                tg.start_soon(due_metrics, ledger, self, self.observer)
                self.ready_event.set()
                self.on_ready()
                self.notifier.ready(f"running as {self.instance}")
                log.info("pacerd_ready", instance=self.instance)
                await self.stop_requested.wait()
                await tickloop.ended.wait()  # its ticks stopped, within the grace
                services_scope.cancel()

    async def _close(self) -> None:
        if self.leadership is not None:
            await self.leadership.give_up(self.ledger)
        await self.broker.close()
        await self.locks.close()
        if self.ledger is not None:
            await self.ledger.close()
        log.info("pacerd_stopped", instance=self.instance)


def main(cfg: Config, *, config_path: str | None, shadow: bool = False) -> int:
    """``pacerd run``: set up telemetry, run the daemon on uvloop, return the exit code."""
    from pacerd.telemetry import setup_telemetry

    telemetry = setup_telemetry(
        cfg.telemetry.service_name, cfg.telemetry.log_level, cfg.telemetry.log_format,
        prometheus=bool(cfg.telemetry.http_address), set_global=True,
        instance=instance_name(cfg), series=cfg.series_for,
    )  # fmt: skip

    async def run() -> int:
        return await Daemon(  # built inside the event loop: its events belong to it
            cfg, config_path=config_path, telemetry=telemetry, shadow=shadow, on_ready=heap.settle
        ).run()

    try:
        return int(anyio.run(run, backend_options={"use_uvloop": True}))
    finally:
        telemetry.shutdown()
