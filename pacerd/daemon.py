"""The composition root: builds every component from the config, runs them in
one task group, and owns the lifecycle — start-up order and READY, leadership
and broker supervision, reload, local pause, graceful and forced stop.

    signals ─► Daemon (SignalTarget) ─► flags and events
    supervisor pass (every tick): leadership locks, broker connection,
        destinations (declare, start one admission loop each), WATCHDOG
    admission loops ─► pacer (pure) ─► ledger claim ─► publisher ─► ledger mark
    outcome consumer ─► ledger.apply_reports      reconciler ─► ledger.reclaim

No SQL and no AMQP here: those belong to ledger.py and publisher.py.
"""

from __future__ import annotations

import contextlib
import math
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from pacerd import config as config_module
from pacerd import ledger as ledger_module
from pacerd.admission import AdmissionConfig, DestinationAdmission, TickResult, run_destination
from pacerd.clock import Clock, SystemClock
from pacerd.config import instance_name
from pacerd.errors import ConfigError, LedgerError, LedgerUnavailable, MigrationError, PacerdError
from pacerd.exitcodes import EX_NOT_MIGRATED
from pacerd.outcomes import OutcomeConsumer, OutcomeResult
from pacerd.publisher import Broker, message_id
from pacerd.reconciler import Reconciler, ReconcilerConfig, ReconcileResult
from pacerd.sdnotify import Notifier, watchdog_interval_seconds
from pacerd.signals import handle_signals
from pacerd.telemetry import inject_traceparent, redact

if TYPE_CHECKING:
    from collections.abc import Iterator, Sequence

    from pacerd.config import Config
    from pacerd.models import ClaimedJob, Report
    from pacerd.publisher import Delivery
    from pacerd.telemetry import Telemetry

log = structlog.get_logger("pacerd.daemon")

EX_OK = 0


class TelemetryObserver:
    """Hands each tick's figures to OpenTelemetry and the log."""

    def __init__(self, telemetry: Telemetry | None, clock: Clock) -> None:
        self.telemetry = telemetry
        self.clock = clock
        self.last: dict[str, TickResult] = {}
        self.due: dict[str, tuple[int, float | None]] = {}

    def tick_span(self, destination: str, *, shadow: bool) -> AbstractContextManager[Any]:
        if self.telemetry is None:
            return nullcontext()
        return self.telemetry.tick_span(destination, shadow=shadow)

    def claim_span(self, destination: str, *, limit: int) -> AbstractContextManager[Any]:
        if self.telemetry is None:
            return nullcontext()
        return self.telemetry.claim_span(destination, limit=limit)

    @contextlib.contextmanager
    def publish_span(
        self, destination: str, jobs: Sequence[ClaimedJob]
    ) -> Iterator[dict[str, str]]:
        headers: dict[str, str] = {}
        if self.telemetry is None:
            yield headers
            return
        messages = [message_id(job.job_id, job.attempt) for job in jobs]
        with self.telemetry.publish_span(destination, messages=messages):
            inject_traceparent(headers)
            began = self.clock.monotonic()
            yield headers  # the slice is published and its confirms awaited here
            seconds = self.clock.monotonic() - began
        self.telemetry.record_publish(destination, confirm_seconds=seconds)

    def mark_offered_span(self, destination: str, *, count: int) -> AbstractContextManager[Any]:
        if self.telemetry is None:
            return nullcontext()
        return self.telemetry.mark_offered_span(destination, count=count)

    def tick_completed(self, result: TickResult) -> None:
        self.last[result.destination] = result
        due, oldest_age = self.due.get(result.destination, (0, None))
        eta = due / result.rate if result.rate > 0 and due else None
        if self.telemetry is not None:
            self.telemetry.record_tick(
                result.destination,
                rate=result.rate,
                budget=result.budget,
                admitted=result.offered if not result.shadow else result.claimed,
                inflight=result.inflight,
                due=due,
                oldest_due_age_seconds=oldest_age,
                drain_eta_seconds=eta,
                refused=result.refused,
                shadow=result.shadow,
            )
            self.telemetry.record_admission_state(
                result.destination,
                paused=result.skipped == "paused",
                paused_locally=result.skipped == "paused_local",
                cooldown=result.skipped == "cooldown",
            )
            self.telemetry.record_publish(
                result.destination, nacked=result.nacked, returned=result.returned,
                timeouts=result.confirm_timeouts,
            )  # fmt: skip
        log.debug(
            "tick_completed",
            destination=result.destination,
            skipped=result.skipped,
            rate=round(result.rate, 3),
            budget=result.budget,
            claimed=result.claimed,
            offered=result.offered,
            released=result.released,
            inflight=result.inflight,
            accepted=result.accepted,
            refused=result.refused,
        )


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
        self._admissions: dict[str, DestinationAdmission] = {}
        self._last_pass: dict[str, float] = {}
        self.ledger: ledger_module.Ledger | None = None
        self.broker = Broker(
            url=cfg.broker.url,
            queue_type=cfg.broker.queue_type,
            publish_timeout_seconds=cfg.broker.publish_timeout_seconds,
            declare_queues=cfg.broker.declare_queues,
            name=f"pacerd {self.instance}",
            route=lambda destination: self.cfg.route_for(destination).routing_key,
        )
        self.locks = ledger_module.LeaderLocks(
            cfg.database.dsn, instance=self.instance, clock=self.clock
        )
        self._leader_unrecorded: set[str] = set()  # led, `set_leader` not yet written
        self._shadows: set[str] = set()  # destinations named like a group, not admitted
        self._pass = 0  # supervisor passes so far: records count takeovers in passes
        self._broker_down_since: float | None = None  # leadership is given up after a while
        self._broker_retry_at = 0.0
        self._broker_backoff = 0.5
        self._locks_retry_at = 0.0
        self.ready = False
        self.started_at = self.clock.monotonic()
        # WATCHDOG=1 at half systemd's interval (at most once a second without one).
        self._watchdog_every = min(1.0, watchdog_interval_seconds() or 1.0)
        self._next_watchdog = 0.0
        self._ok_applied = 0  # `ok` reports applied since the last batch was counted
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

    # -- building blocks ---------------------------------------------------------

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
        except BaseException:
            await led.close()
            raise
        return led

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
        except PacerdError as exc:
            log.warning("broker_unavailable", error=str(exc), retry_in=self._broker_backoff)
            self._broker_retry_at = now + self._broker_backoff
            self._broker_backoff = min(self._broker_backoff * 2, 10.0)

    async def _supervise_leadership(self, destinations: list[str]) -> None:
        """One pass of leadership: keep the lock session up, lead a fair share
        of the destinations (ceil(destinations / live instances)), hand one
        over per pass while leading more than that, and take the reconciler's
        lock when it is free. Leadership changes only when instances come or
        go. A destination taken here starts admitting one tick later (see
        ``_run_admission``). An instance that cannot reach the broker for
        ``max(5 s, 3 x tick)`` cannot admit: it closes its lock session (so
        it no longer counts as an instance) until the broker is back."""
        now = self.clock.monotonic()
        if self.broker.connected:
            self._broker_down_since = None
        else:
            self._broker_down_since = self._broker_down_since or now
            grace = max(5.0, 3 * self.cfg.pacing.tick_seconds)
            if now - self._broker_down_since >= grace:
                if self.locks.backend_pid is not None:
                    log.warning("leadership_session_closed", reason="broker_unavailable")
                    assert self.ledger is not None
                    for destination in self.locks.held:
                        if destination != ledger_module.RECONCILER_LOCK:
                            with contextlib.suppress(PacerdError):
                                await self.ledger.set_leader(destination, None)
                    await self.locks.close()
                return
        if not await self.locks.alive():
            now = self.clock.monotonic()
            if now < self._locks_retry_at:
                return
            try:
                await self.locks.connect()
                log.info("leadership_session_connected", backend_pid=self.locks.backend_pid)
            except PacerdError as exc:
                self._locks_retry_at = now + 2.0
                log.warning("leadership_session_unavailable", error=str(exc))
                return
        assert self.ledger is not None
        instances = await self.locks.count_instances()
        fair_share = math.ceil(len(destinations) / instances) if destinations else 0
        held = [d for d in destinations if self.locks.holds(d)]
        handing_over = any(self.locks.releasing(d) for d in destinations)
        if len(held) > fair_share and len(held) > 1 and not handing_over:
            give_up = sorted(held)[-1]
            self.locks.begin_release(give_up)  # its loop ends its tick, then unlocks
            log.info(
                "leadership_handover_started",
                destination=give_up,
                fair_share=fair_share,
                instances=instances,
            )
            held.remove(give_up)
        for destination in destinations:
            if len(held) >= max(fair_share, 1):
                break
            if destination in held or self.locks.has_lock(destination):
                continue
            admission = self._admissions.get(destination)
            settle = (admission.config if admission else self._admission_config(destination)).params
            if await self.locks.try_acquire(destination, settle_seconds=settle.tick_seconds):
                held.append(destination)
                self._leader_unrecorded.add(destination)
                log.info(
                    "leadership_acquired",
                    destination=destination,
                    admitting_in_seconds=settle.tick_seconds,
                    fair_share=fair_share,
                    instances=instances,
                    supervisor_pass=self._pass,
                )
        for destination in sorted(self._leader_unrecorded):
            if self.locks.holds(destination):
                await self.ledger.set_leader(destination, self.instance)
            self._leader_unrecorded.discard(destination)
        if not self.locks.has_lock(ledger_module.RECONCILER_LOCK) and await self.locks.try_acquire(
            ledger_module.RECONCILER_LOCK
        ):
            log.info("leadership_acquired", role="reconciler", supervisor_pass=self._pass)

    async def _supervise_destinations(self, tg: anyio.abc.TaskGroup) -> list[str]:
        assert self.ledger is not None
        rows = await self.ledger.list_destinations()
        names = self._without_shadows(
            sorted({r.destination for r in rows} | set(self.cfg.destinations))
        )
        if self.broker.connected:  # a group's queue exists before its first destination
            for group in self.cfg.groups:
                route = self.cfg.route_for_group(group)
                try:
                    await self.broker.declare_destination(route.routing_key, route.queue)
                except PacerdError as exc:
                    log.error("declare_failed", group=group, queue=route.queue, error=str(exc))
        for destination in names:
            if self.broker.connected:
                route = self.cfg.route_for(destination)
                try:  # a no-op once declared on this connection
                    await self.broker.declare_destination(route.routing_key, route.queue)
                except PacerdError as exc:
                    log.error(
                        "declare_failed", destination=destination, queue=route.queue,
                        error=str(exc),
                    )  # fmt: skip
            if destination not in self._admissions:
                admission = DestinationAdmission(
                    ledger=self.ledger,
                    publisher=self.broker,
                    clock=self.clock,
                    config=self._admission_config(destination),
                    observer=self.observer,
                    is_paused_locally=lambda: self._local_paused,
                )
                self._admissions[destination] = admission
                self._last_pass[destination] = self.clock.monotonic()
                tg.start_soon(self._run_admission, admission)
                log.info("destination_discovered", destination=destination)
        return names

    def _without_shadows(self, names: list[str]) -> list[str]:
        """``names`` but those named like a group whose ``match`` they do not
        fit: their routing key would also reach the group's queue, so they
        are not admitted (logged once)."""
        shadows = {d for d in names if d in self.cfg.groups and self.cfg.group_for(d) != d}
        for destination in sorted(shadows - self._shadows):
            log.error(
                "destination_not_admitted", destination=destination,
                reason="named like a group whose match it does not fit",
                match=self.cfg.groups[destination].match,
            )  # fmt: skip
        self._shadows = shadows
        return [d for d in names if d not in shadows]

    async def _run_admission(self, admission: DestinationAdmission) -> None:
        """The admission loop of one destination, on every instance.

        Standby until this instance holds the destination's lock *and* one
        tick has passed since it took it (``usable_at``): whoever led before
        claimed last before its lock was free, so a new leader's first claim
        comes at least one tick after the previous leader's last one, and
        the two never publish at once. The first tick resumes from the
        persisted pacer state (rate, credit, cut, ceiling), never from
        ``initial_rate``. Then ticks run until leadership ends: a lost
        session or a lapsed lease cancels the tick in flight at once (its
        unpublished claims are released); a handover lets the tick finish,
        then unlocks."""
        destination = admission.config.destination
        locks = self.locks
        while not self.stop_requested.is_set():
            changed = locks.changed()
            if locks.releasing(destination):
                await self._hand_over(destination)
                continue
            now = self.clock.monotonic()
            usable_at = locks.usable_at(destination)
            if usable_at is None or now < usable_at:
                admission.reset()
                self._last_pass[destination] = now
                wake = now + admission.config.params.tick_seconds
                await self._await_leadership(
                    changed, wake if usable_at is None else min(wake, usable_at)
                )
                continue
            await self._admit_while_leading(admission)
            admission.reset()

    async def _admit_while_leading(self, admission: DestinationAdmission) -> None:
        """Runs the destination's ticks until this instance stops leading it."""
        destination = admission.config.destination
        locks = self.locks
        lost = False

        def leads() -> bool:
            return locks.holds(destination) and self.broker.connected

        log.info("admission_leading", destination=destination)
        with anyio.CancelScope() as run_scope:

            def on_pass() -> None:
                self._last_pass[destination] = self.clock.monotonic()
                if not locks.holds(destination):
                    run_scope.cancel()  # between ticks: handover, or lost after the tick

            async def watch() -> None:
                nonlocal lost
                await locks.wait_lost(destination)
                lost = True
                log.warning("leadership_lost", destination=destination)
                run_scope.cancel()  # at once, mid-tick: someone else may lead soon

            async with anyio.create_task_group() as tg:
                tg.start_soon(watch)
                await run_destination(
                    admission, leads=leads, stop=self.stop_requested, on_pass=on_pass
                )
                tg.cancel_scope.cancel()
        if self.telemetry is not None:
            self.telemetry.forget_destination(destination)
        if not lost and not self.stop_requested.is_set() and not locks.has_lock(destination):
            log.warning("leadership_lost", destination=destination)

    async def _await_leadership(self, changed: anyio.Event, deadline: float) -> None:
        """Waits until what this instance leads changes, a stop, or ``deadline``."""
        with anyio.move_on_after(max(0.0, deadline - self.clock.monotonic())):
            async with anyio.create_task_group() as tg:

                async def on_stop() -> None:
                    await self.stop_requested.wait()
                    tg.cancel_scope.cancel()

                tg.start_soon(on_stop)
                await changed.wait()
                tg.cancel_scope.cancel()

    async def _hand_over(self, destination: str) -> None:
        """Unlocks a destination whose last tick has ended (rebalancing)."""
        assert self.ledger is not None
        try:
            await self.ledger.set_leader(destination, None)
        except PacerdError as exc:
            log.warning("set_leader_failed", destination=destination, error=str(exc))
        try:
            await self.locks.release(destination)
        except PacerdError as exc:  # the session was given up: released all the same
            log.warning("leadership_release_failed", destination=destination, error=str(exc))
        log.info("leadership_released", destination=destination)

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
        for destination, admission in self._admissions.items():
            admission.update_config(self._admission_config(destination))
        if self.telemetry is not None:
            from pacerd.telemetry import set_log_level

            set_log_level(new.telemetry.log_level)
        log.info("config_reloaded", changed=diff.changed, needs_restart=diff.needs_restart)
        self.notifier.ready("running (config reloaded)")

    def _watchdog_due(self) -> bool:
        """True when every destination loop this instance leads passed recently."""
        now = self.clock.monotonic()
        for destination, admission in self._admissions.items():
            limit = (
                3 * admission.config.params.tick_seconds
                + self.cfg.broker.publish_timeout_seconds
                + 5
            )
            if now - self._last_pass.get(destination, now) > limit:
                return False
        return True

    def _status_line(self) -> str:
        parts = []
        for destination, result in sorted(self.observer.last.items()):
            if not self.locks.holds(destination):
                continue
            due, oldest = self.observer.due.get(destination, (0, None))
            age = f"{oldest:.0f}s" if oldest is not None else "-"
            parts.append(f"{destination} {result.rate:.1f}/s due {due} oldest {age}")
        return "; ".join(parts) or "running, leading no destination"

    async def _supervisor(self, tg: anyio.abc.TaskGroup, *, task_status: Any) -> None:
        started = False
        deadline = self.clock.monotonic()
        while not self.stop_requested.is_set():
            self._pass += 1
            log.debug("supervisor_pass", supervisor_pass=self._pass)
            if self._reload_requested:
                self._apply_reload()
            try:
                await self._supervise_broker()
                names = await self._supervise_destinations(tg)
                await self._supervise_leadership(names)
                if self.telemetry is not None:
                    self.telemetry.record_leadership({d: self.locks.holds(d) for d in names})
                self._ledger_error = None
            except PacerdError as exc:
                if isinstance(exc, LedgerError):
                    self._ledger_error = redact(str(exc))
                log.warning("supervisor_pass_failed", error=str(exc))
            if not started:
                task_status.started()
                started = True
            now = self.clock.monotonic()
            if self.ready and now >= self._next_watchdog and self._watchdog_due():
                self.notifier.watchdog()
                self._next_watchdog = now + self._watchdog_every
            tick = min(
                [a.config.params.tick_seconds for a in self._admissions.values()]
                or [self.cfg.pacing.tick_seconds]
            )
            deadline = max(deadline + tick, self.clock.monotonic())
            with anyio.move_on_after(max(0.0, deadline - self.clock.monotonic())):
                await self.stop_requested.wait()

    async def _due_metrics(self) -> None:
        """Due counts for status and metrics, on a slower cadence (they count rows)."""
        assert self.ledger is not None
        while not self.stop_requested.is_set():
            began = self.clock.monotonic()
            try:
                for row in await self.ledger.due_summary():
                    oldest = row.oldest_scheduled_at
                    age = (self.clock.now() - oldest).total_seconds() if oldest else None
                    self.observer.due[row.destination] = (row.due, age)
                    if self.telemetry is not None:
                        self.telemetry.record_dead(row.destination, row.dead)
                self.notifier.status(self._status_line())
            except PacerdError as exc:
                log.warning("due_summary_failed", error=str(exc))
            # Counting due rows grows with the backlog: at most 1/20 of the time.
            pause = max(5.0, self.cfg.pacing.tick_seconds, 20 * (self.clock.monotonic() - began))
            with anyio.move_on_after(pause):
                await self.stop_requested.wait()

    async def _reconcile_loop(self, reconciler: Reconciler, *, task_status: Any) -> None:
        task_status.started()
        interval = self.cfg.reconcile.interval_seconds
        while not self.stop_requested.is_set():
            with anyio.move_on_after(interval):
                await self.stop_requested.wait()
            if self.stop_requested.is_set():
                break
            if self.shadow or not self.locks.holds(ledger_module.RECONCILER_LOCK):
                continue  # shadow mode changes nothing in the ledger
            try:
                await reconciler.run_once()
            except PacerdError as exc:
                log.warning("reconcile_failed", error=str(exc))

    def _on_reconcile(self, result: ReconcileResult) -> None:
        if self.telemetry is not None and result.total:
            self.telemetry.record_reconcile(
                claims_released=result.claims_returned,
                offers_rescheduled=result.offers_returned,
                offers_dead=result.dead,
            )

    def _on_report(self, delivery: Delivery, report: Report, result: str) -> None:
        """One outcome applied: a span continuing the worker's trace, and a count.
        The common case (an `ok` applied) is only counted, per batch: a span per
        report was a fifth of the daemon's CPU at full speed."""
        if self.telemetry is None:
            return
        if result == "applied" and report.outcome == "ok":
            self._ok_applied += 1
            return
        with self.telemetry.outcome_span(
            delivery.headers, job_id=report.job_id, attempt=report.attempt,
            outcome=str(report.outcome),
        ) as span:  # fmt: skip
            self.telemetry.record_outcome(str(report.outcome), result, span=span)

    def _on_outcomes(self, result: OutcomeResult) -> None:
        if self.telemetry is None:
            return
        if self._ok_applied:
            self.telemetry.count_outcomes("ok", "applied", self._ok_applied)
            self._ok_applied = 0
        if result.invalid:
            self.telemetry.outcomes_invalid.add(result.invalid, {"reason": "malformed"})

    async def _wait_broker(self) -> None:
        while not self.broker.connected:
            with anyio.move_on_after(0.25):
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
        try:
            log.info(
                "pacerd_starting",
                instance=self.instance,
                database=self.cfg.redacted_dsn(),
                broker=self.cfg.redacted_broker_url(),
                shadow=self.shadow,
            )
            await self._retry_until_up("broker", self.broker.connect)
            if self.stop_requested.is_set():
                return EX_OK
            with anyio.CancelScope() as services_scope:
                async with anyio.create_task_group() as tg:
                    consumer = OutcomeConsumer(
                        ledger=self.ledger,
                        broker=self.broker,
                        clock=self.clock,
                        prefetch=self.cfg.broker.outcome_prefetch,
                        on_result=self._on_outcomes,
                        on_report=self._on_report,
                        wait_connected=self._wait_broker,
                    )
                    reconciler = Reconciler(
                        ledger=self.ledger,
                        clock=self.clock,
                        config=ReconcilerConfig(
                            interval_seconds=self.cfg.reconcile.interval_seconds,
                            batch_size=self.cfg.reconcile.batch_size,
                        ),
                        on_result=self._on_reconcile,
                    )
                    await tg.start(consumer.run)
                    await tg.start(self._reconcile_loop, reconciler)
                    if self.cfg.telemetry.http_address:
                        from pacerd.health import serve_health

                        await tg.start(
                            lambda task_status: serve_health(
                                self.cfg.telemetry.http_address,
                                liveness=self._liveness,
                                readiness=self._readiness,
                                task_status=task_status,
                            )
                        )
                    admissions_scope = anyio.CancelScope()
                    admissions_done = anyio.Event()

                    async def supervised(*, task_status: Any) -> None:
                        try:
                            with admissions_scope:
                                async with anyio.create_task_group() as atg:
                                    await atg.start(self._supervisor, atg)
                                    task_status.started()
                        finally:
                            admissions_done.set()

                    await tg.start(supervised)
                    tg.start_soon(self._due_metrics)
                    self.ready = True
                    self.ready_event.set()
                    self.notifier.ready(f"running as {self.instance}")
                    log.info("pacerd_ready", instance=self.instance)
                    await self.stop_requested.wait()
                    # Stop admitting: every loop ends after its current tick, whose
                    # confirms are drained and whose unpublished claims are released;
                    # past the grace, the ticks are cancelled (and still release).
                    grace = self.cfg.daemon.shutdown_grace_seconds
                    admissions_scope.deadline = anyio.current_time() + grace
                    await admissions_done.wait()
                    services_scope.cancel()
            return EX_OK
        finally:
            with anyio.CancelScope(shield=True):
                await self._close()

    async def _close(self) -> None:
        if self.ledger is not None:
            for destination in self.locks.held:
                if destination != ledger_module.RECONCILER_LOCK:
                    with contextlib.suppress(PacerdError):
                        await self.ledger.set_leader(destination, None)
        await self.broker.close()
        await self.locks.close()
        if self.ledger is not None:
            await self.ledger.close()
        log.info("pacerd_stopped", instance=self.instance)

    def _liveness(self) -> tuple[bool, dict[str, Any]]:
        return self._watchdog_due(), {"instance": self.instance}

    def _readiness(self) -> tuple[bool, dict[str, Any]]:
        """Ledger and broker reachable (the supervisor pass reads the ledger every tick)."""
        ledger = self.ledger is not None and self._ledger_error is None
        ok = self.ready and self.broker.connected and ledger
        data: dict[str, Any] = {"broker": self.broker.connected, "ledger": ledger}
        if self._ledger_error is not None:
            data["ledger_error"] = self._ledger_error
        return ok, {**data, "leading": sorted(self.locks.held)}


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
