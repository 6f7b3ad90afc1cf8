-- Every statement pacerd sends: the daemon's, the migration runner's, the client's. One block per query:
--   -- name: <name>
--   -- <one-line description>
--   <statement>
-- ledger.py loads this file once and has one method per block, same name
-- (the leadership session's are on LeaderLocks; the migration runner's are
-- sent by name). The client's statements are in the last section.
-- Time arrives as a parameter: coalesce($n::timestamptz, now()), so tests can
-- pin it and production lets the database decide.
--
-- Lock order: a statement that waits for locks on several rows takes them in
-- one order, jobs by job_id first, then destinations by name (a locking CTE,
-- ORDER BY ... FOR UPDATE), so that two statements never wait on each other
-- in a cycle (40P01). The claim and the reconciler use SKIP LOCKED on jobs:
-- they never wait for a job. The claim first takes its one destination row
-- FOR SHARE, before any job: while it waits for a report or pause in
-- progress on that row it holds nothing they could wait for, so it joins no cycle.

-- name: claim_due
-- The claim of a tick for every destination it admits ($1, one entry each): up to $3 due jobs each, oldest first, $2 of them reserved for the live lane; sets the claim lease.
WITH b AS (
    -- one statement whatever the number of destinations: the arrays are
    -- unnested and each destination's jobs are taken by a LATERAL range
    -- scan; the destination rows are taken FOR SHARE first, in name order
    -- (see the header), before any job
    SELECT * FROM unnest($1::text[], $2::int[], $3::int[], $4::double precision[],
                         $5::bigint[], $6::double precision[])
        AS b(destination, live_limit, lim, claim_seconds, epoch, live_window)
), dest AS MATERIALIZED (
    -- the destinations' rows as last committed: FOR SHARE waits for a report
    -- or pause in progress on one, so one that began before this claim is seen
    SELECT d.destination, d.paused, d.cooldown_until FROM pacerd.destinations d
    WHERE d.destination = ANY ($1::text[])
    ORDER BY d.destination
    FOR SHARE OF d
), open AS (
    -- neither paused nor in a Retry-After cool-down: checked here too, so that
    -- a tick that read a destination open claims nothing once a pause or a
    -- refusal has committed
    SELECT b.* FROM b CROSS JOIN pacerd.control c LEFT JOIN dest d ON d.destination = b.destination
    WHERE NOT (c.paused_all OR coalesce(d.paused, false)
               OR coalesce(d.cooldown_until > coalesce($7::timestamptz, now()), false))
), live AS (
    SELECT o.destination, x.job_id, x.next_attempt_at
    FROM open o, LATERAL (
        SELECT j.job_id, j.next_attempt_at
        FROM pacerd.jobs j
        WHERE j.destination = o.destination AND j.state = 'scheduled'
          AND j.next_attempt_at <= coalesce($7::timestamptz, now())
          AND j.next_attempt_at > coalesce($7::timestamptz, now())
                                  - make_interval(secs => o.live_window)
          AND NOT j.ever_offered
        ORDER BY j.next_attempt_at
        LIMIT o.lim
        FOR UPDATE OF j SKIP LOCKED
    ) x
), backlog AS (
    SELECT o.destination, x.job_id, x.next_attempt_at
    FROM open o, LATERAL (
        SELECT j.job_id, j.next_attempt_at
        FROM pacerd.jobs j
        WHERE j.destination = o.destination AND j.state = 'scheduled'
          AND j.next_attempt_at <= coalesce($7::timestamptz, now())
          AND (j.ever_offered
               OR j.next_attempt_at <= coalesce($7::timestamptz, now())
                                       - make_interval(secs => o.live_window))
        ORDER BY j.next_attempt_at
        LIMIT o.lim
        FOR UPDATE OF j SKIP LOCKED
    ) x
), shares AS (
    -- each lane's count per destination, aggregated once (a count per
    -- destination over the whole lane is quadratic in the destinations)
    SELECT o.destination, o.lim, o.claim_seconds, o.epoch,
           least(coalesce(l.n, 0),
                 greatest(o.live_limit::bigint, o.lim::bigint - coalesce(k.n, 0))) AS n_live
    FROM open o
    LEFT JOIN (SELECT destination, count(*) AS n FROM live GROUP BY destination) l
           ON l.destination = o.destination
    LEFT JOIN (SELECT destination, count(*) AS n FROM backlog GROUP BY destination) k
           ON k.destination = o.destination
), picked AS (
    SELECT l.job_id, true AS live, s.claim_seconds, s.epoch FROM (
        SELECT x.destination, x.job_id,
               row_number() OVER (PARTITION BY x.destination
                                  ORDER BY x.next_attempt_at, x.job_id) AS rn
        FROM live x
    ) l JOIN shares s ON s.destination = l.destination WHERE l.rn <= s.n_live
    UNION ALL
    SELECT k.job_id, false AS live, s.claim_seconds, s.epoch FROM (
        SELECT x.destination, x.job_id,
               row_number() OVER (PARTITION BY x.destination
                                  ORDER BY x.next_attempt_at, x.job_id) AS rn
        FROM backlog x
    ) k JOIN shares s ON s.destination = k.destination WHERE k.rn <= s.lim::bigint - s.n_live
), claimed AS (
    UPDATE pacerd.jobs j SET
        state = 'claimed',
        attempt = j.attempt + 1,
        lease_expires_at = coalesce($7::timestamptz, now())
                           + make_interval(secs => picked.claim_seconds),
        admit_epoch = picked.epoch,
        claimed_by = $8,
        updated_at = coalesce($7::timestamptz, now())
    FROM picked
    WHERE j.job_id = ANY (ARRAY(SELECT job_id FROM picked)) AND j.job_id = picked.job_id
    RETURNING j.job_id, j.kind, j.destination, j.attempt, j.revision, j.payload, j.cursor,
              j.next_attempt_at, picked.live, picked.epoch
), events AS (
    INSERT INTO pacerd.job_events (job_id, attempt, event, at, detail)
    SELECT c.job_id, c.attempt, 'claimed', coalesce($7::timestamptz, now()),
           jsonb_build_object('lane', CASE WHEN c.live THEN 'live' ELSE 'backlog' END,
                              'by', $8::text, 'epoch', c.epoch)
    FROM claimed c
)
SELECT job_id, kind, destination, attempt, revision, payload::text AS payload,
       cursor::text AS cursor, next_attempt_at, live
FROM claimed
ORDER BY destination, next_attempt_at, job_id;

-- name: mark_offered
-- Marks confirmed publishes offered (fenced by state and attempt) and sets the offer lease.
WITH params AS (
    SELECT coalesce($4::timestamptz, now()) AS now
), locked AS MATERIALIZED (
    -- in job_id order, whatever order the confirms came in (see the header)
    SELECT j.job_id FROM pacerd.jobs j
    WHERE j.job_id = ANY ($1::text[])
    ORDER BY j.job_id
    FOR UPDATE OF j
), offered AS (
    UPDATE pacerd.jobs j SET
        state = 'offered',
        ever_offered = true,
        lease_expires_at = p.now + make_interval(secs => $3),
        updated_at = p.now
    FROM unnest($1::text[], $2::int[]) AS c(job_id, attempt), params p
    -- (an array of the locked ids: taken in full before this scan starts, and
    -- each job then looked up by primary key)
    WHERE j.job_id = ANY (ARRAY(SELECT job_id FROM locked))
      AND j.job_id = c.job_id AND j.attempt = c.attempt
      -- a CASE, so that the plan looks each job up by primary key: a plain
      -- predicate matches the partial in-flight index, whose statistics are
      -- stale in a burst (a scan of every job in flight for each mark)
      AND CASE WHEN j.state = 'claimed' THEN true ELSE false END
    RETURNING j.job_id, j.attempt
), events AS (
    INSERT INTO pacerd.job_events (job_id, attempt, event, at)
    SELECT o.job_id, o.attempt, 'offered', p.now FROM offered o, params p
)
SELECT job_id, attempt FROM offered;

-- name: release_claims
-- Returns unpublished claims to scheduled without spending an attempt (fenced by state and attempt).
WITH params AS (
    SELECT coalesce($4::timestamptz, now()) AS now
), locked AS MATERIALIZED (
    SELECT j.job_id FROM pacerd.jobs j
    WHERE j.job_id = ANY ($1::text[])
    ORDER BY j.job_id
    FOR UPDATE OF j
), released AS (
    UPDATE pacerd.jobs j SET
        state = 'scheduled',
        lease_expires_at = NULL,
        claimed_by = NULL,
        updated_at = p.now
    FROM unnest($1::text[], $2::int[]) AS c(job_id, attempt), params p
    WHERE j.job_id = ANY (ARRAY(SELECT job_id FROM locked))
      AND j.job_id = c.job_id AND j.attempt = c.attempt AND j.state = 'claimed'
    RETURNING j.job_id, j.attempt
), events AS (
    INSERT INTO pacerd.job_events (job_id, attempt, event, at, detail)
    SELECT r.job_id, r.attempt, 'released', p.now, jsonb_build_object('reason', $3::text)
    FROM released r, params p
)
SELECT job_id, attempt FROM released;

-- name: reclaim_expired
-- Returns up to $2 expired claims (no attempt spent) and offers (an attempt spent; dead at the cap).
WITH expired AS (
    SELECT j.job_id, j.state, j.attempt, j.failures, j.max_attempts
    FROM pacerd.jobs j
    WHERE j.state IN ('claimed', 'offered')
      AND j.lease_expires_at < coalesce($1::timestamptz, now())
    ORDER BY j.lease_expires_at
    LIMIT $2
    FOR UPDATE OF j SKIP LOCKED
), reclaimed AS (
    UPDATE pacerd.jobs j SET
        state = CASE
            WHEN e.state = 'offered' AND e.failures + 1 >= e.max_attempts THEN 'dead'
            ELSE 'scheduled' END,
        failures = j.failures + (e.state = 'offered')::int,
        last_error = CASE WHEN e.state = 'offered' THEN 'offer lease expired without an outcome'
                          ELSE j.last_error END,
        lease_expires_at = NULL,
        ever_offered = true,  -- reclaimed leases are backlog (docs/protocol.md, Terms)
        claimed_by = NULL,
        updated_at = coalesce($1::timestamptz, now())
    FROM expired e
    WHERE j.job_id = ANY (ARRAY(SELECT job_id FROM expired)) AND j.job_id = e.job_id
    RETURNING j.job_id, j.attempt, j.destination, e.state AS previous_state, j.state, j.failures
), events AS (
    INSERT INTO pacerd.job_events (job_id, attempt, event, at, detail)
    SELECT r.job_id, r.attempt,
           CASE WHEN r.state = 'dead' THEN 'dead' ELSE 'lease_expired' END,
           coalesce($1::timestamptz, now()),
           jsonb_build_object('lease', CASE WHEN r.previous_state = 'claimed' THEN 'claim'
                                            ELSE 'offer' END,
                              'failures', r.failures,
                              'reason', CASE WHEN r.state = 'dead' THEN 'attempts_exhausted'
                                             ELSE NULL END)
    FROM reclaimed r
)
SELECT job_id, attempt, destination, previous_state, state FROM reclaimed;

-- name: oldest_due
-- The next_attempt_at of the oldest due job of one destination (an index lookup).
SELECT min(next_attempt_at) AS oldest_due_at
FROM pacerd.jobs
WHERE destination = $1 AND state = 'scheduled' AND next_attempt_at <= coalesce($2::timestamptz, now());

-- name: has_due_many
-- For each (destination, bound) of $1 and $2, in their order, whether it has at least that many due jobs: its due jobs counted up to the bound (a bounded index range scan each; the shadow ticks of many destinations in one statement).
SELECT s.n
FROM unnest($1::text[], $2::int[]) WITH ORDINALITY AS d(destination, at_least, ord)
CROSS JOIN LATERAL (
    SELECT count(*) AS n FROM (
        SELECT 1 FROM pacerd.jobs j
        WHERE j.destination = d.destination AND j.state = 'scheduled'
          AND j.next_attempt_at <= coalesce($3::timestamptz, now())
        ORDER BY j.next_attempt_at  -- an index range scan, whatever the statistics say
        LIMIT d.at_least
    ) due
) s
ORDER BY d.ord;

-- name: list_destinations
-- Every destination the ledger knows, with its shared state and counters.
SELECT d.destination, d.paused, c.paused_all, d.cooldown_until, d.epoch,
       d.pacer_state::text AS pacer_state, d.n_accepted, d.n_refused, d.n_accepted_fresh,
       d.n_refused_fresh, d.n_retry_after, p.leader, p.leader_since,
       coalesce($1::timestamptz, now()) AS now
FROM pacerd.destinations d CROSS JOIN pacerd.control c
LEFT JOIN pacerd.partitions p ON p.partition = d.partition
ORDER BY d.destination;

-- name: read_destination
-- The shared state and outcome counters of each destination of $1, read at the top of a tick and before release slices; with $3, its claimed and offered jobs too (counted by the in-flight index, each bounded by its max_inflight).
SELECT d.destination, d.paused, c.paused_all, d.cooldown_until, d.epoch,
       d.pacer_state::text AS pacer_state, d.n_accepted, d.n_refused, d.n_accepted_fresh,
       d.n_refused_fresh, d.n_retry_after, p.leader, p.leader_since,
       coalesce($2::timestamptz, now()) AS now,
       CASE WHEN $3::boolean THEN
           (SELECT count(*) FROM pacerd.jobs j
            WHERE j.destination = d.destination AND j.state IN ('claimed', 'offered'))
       END AS inflight
FROM pacerd.destinations d CROSS JOIN pacerd.control c
LEFT JOIN pacerd.partitions p ON p.partition = d.partition
WHERE d.destination = ANY ($1::text[]);

-- name: wake_destinations
-- The destinations of the partitions $1 that need their leader now: active ones and those whose work came due (one index scan of wake_at).
SELECT d.destination, d.partition
FROM pacerd.destinations d
WHERE d.wake_at <= coalesce($2::timestamptz, now())
  AND d.partition = ANY ($1::int[]);

-- name: closed_destinations
-- The destinations paused (left: NULL) or in a Retry-After cool-down now (left: its seconds to go), and "*" when every destination is paused (small index scans).
SELECT d.destination, NULL::float8 AS left_seconds FROM pacerd.destinations d WHERE d.paused
UNION ALL
SELECT d.destination,
       extract(epoch FROM d.cooldown_until - coalesce($1::timestamptz, now()))::float8
FROM pacerd.destinations d
WHERE d.cooldown_until > coalesce($1::timestamptz, now())
UNION ALL
SELECT '*', NULL FROM pacerd.control c WHERE c.paused_all;

-- name: lock_parking
-- Locks the destinations of $1 (name order) before parking them (see park_destinations).
SELECT d.destination FROM pacerd.destinations d
WHERE d.destination = ANY ($1::text[])
ORDER BY d.destination
FOR UPDATE OF d;

-- name: park_destinations
-- Parks the destinations of $1 that have nothing due and nothing in flight and are not in a cool-down: wake_at becomes their next job's time, or NULL; returns the parked ones.
WITH next AS (
    -- run after lock_parking, in its transaction: this statement's snapshot
    -- sees every job scheduled before the lock was taken
    SELECT d.destination,
           (SELECT min(j.next_attempt_at) FROM pacerd.jobs j
             WHERE j.destination = d.destination AND j.state = 'scheduled') AS next_at,
           EXISTS (SELECT 1 FROM pacerd.jobs j
                    WHERE j.destination = d.destination
                      AND j.state IN ('claimed', 'offered')) AS busy
    FROM pacerd.destinations d
    WHERE d.destination = ANY ($1::text[])
      AND coalesce(d.cooldown_until <= coalesce($2::timestamptz, now()), true)
)
UPDATE pacerd.destinations d SET wake_at = n.next_at
FROM next n
WHERE d.destination = n.destination AND NOT n.busy
  AND (n.next_at IS NULL OR n.next_at > coalesce($2::timestamptz, now()))
RETURNING d.destination;

-- name: ensure_destination
-- Registers a destination (from the config) so that it is declared and led.
INSERT INTO pacerd.destinations (destination) VALUES ($1)
ON CONFLICT DO NOTHING;

-- name: save_pacer_state
-- Persists the pacers of the destinations of $1 ($2 their states, $3 their epochs, bumped at each cut), in name order.
WITH s AS (
    SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[]) AS s(destination, state, epoch)
), locked AS MATERIALIZED (
    SELECT d.destination FROM pacerd.destinations d
    WHERE d.destination = ANY ($1::text[])
    ORDER BY d.destination
    FOR NO KEY UPDATE OF d
)
UPDATE pacerd.destinations d SET
    pacer_state = s.state::jsonb,
    epoch = greatest(d.epoch, s.epoch),
    updated_at = coalesce($4::timestamptz, now())
FROM s
WHERE d.destination = ANY (ARRAY(SELECT destination FROM locked)) AND d.destination = s.destination;

-- name: set_leader
-- Records which instance leads partition $1, and since when (for status); NULL: none.
INSERT INTO pacerd.partitions AS p (partition, leader, leader_since)
VALUES ($1, $2, CASE WHEN $2::text IS NULL THEN NULL ELSE coalesce($3::timestamptz, now()) END)
ON CONFLICT (partition) DO UPDATE SET
    leader = excluded.leader,
    leader_since = CASE WHEN p.leader IS DISTINCT FROM excluded.leader THEN excluded.leader_since
                        ELSE p.leader_since END;

-- name: read_partitions
-- The number of partitions the ledger's destinations hash into (set by pacerd migrate).
SELECT (value #>> '{}')::integer AS partitions FROM pacerd.settings WHERE key = 'partitions';

-- name: due_summary
-- Per destination (or per woken one, $2): due count, oldest due, in flight and dead, for status and metrics (it counts: a slower cadence).
SELECT d.destination,
       (SELECT count(*) FROM pacerd.jobs j
         WHERE j.destination = d.destination AND j.state = 'scheduled'
           AND j.next_attempt_at <= coalesce($1::timestamptz, now())) AS due,
       (SELECT min(j.next_attempt_at) FROM pacerd.jobs j
         WHERE j.destination = d.destination AND j.state = 'scheduled'
           AND j.next_attempt_at <= coalesce($1::timestamptz, now())) AS oldest_due_at,
       (SELECT count(*) FROM pacerd.jobs j
         WHERE j.destination = d.destination AND j.state IN ('claimed', 'offered')) AS inflight,
       (SELECT count(*) FROM pacerd.jobs j
         WHERE j.destination = d.destination AND j.state = 'dead') AS dead
FROM pacerd.destinations d
-- $2: only the woken ones (the daemon's metrics: a parked destination's
-- figures do not change while it is parked); status reads them all
WHERE $2::boolean IS NOT TRUE OR d.wake_at <= coalesce($1::timestamptz, now())
ORDER BY d.destination;

-- name: write_settings
-- Stores the limits the SQL functions enforce (from the config file).
INSERT INTO pacerd.settings (key, value, updated_at)
SELECT k, v, now() FROM unnest($1::text[], $2::jsonb[]) AS s(k, v)
ON CONFLICT (key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at
WHERE pacerd.settings.value IS DISTINCT FROM excluded.value;

-- name: apply_reports
-- Applies a batch of outcome reports with pacerd.report's effects, in order, atomically (one statement; set-based: pacerd.report_many).
SELECT r.result
FROM unnest(pacerd.report_many(job_id => $1::text[], attempt => $2::int[], outcome => $3::text[],
                               retry_after_s => $4::float8[], error => $5::text[],
                               detail => $6::jsonb[], cursor => $7::jsonb[]))
     WITH ORDINALITY AS r(result, n)
ORDER BY r.n;

-- name: lock_reported
-- Locks the jobs $1 names (job_id order), then their destinations (name order), before reports applied one by one.
WITH jobs AS MATERIALIZED (
    SELECT j.job_id, j.destination FROM pacerd.jobs j
    WHERE j.job_id = ANY ($1::text[])
    ORDER BY j.job_id
    FOR UPDATE OF j
)
SELECT count(*) AS n FROM (
    SELECT d.destination FROM pacerd.destinations d
    WHERE d.destination IN (SELECT jobs.destination FROM jobs)
    ORDER BY d.destination
    FOR UPDATE OF d
) s;

-- name: set_partitions
-- Sets how many partitions destinations hash into ($1), places every destination again and forgets the leaders.
WITH setting AS (
    INSERT INTO pacerd.settings (key, value, updated_at) VALUES ('partitions', to_jsonb($1::int), now())
    ON CONFLICT (key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at
), placed AS (
    UPDATE pacerd.destinations SET partition = pacerd._partition_of(destination, $1::int)
), forgotten AS (
    DELETE FROM pacerd.partitions
)
SELECT 1;

-- name: count_instances
-- Live pacerd instances on this ledger: leadership sessions ($1 their application_name) connected to this database.
SELECT count(*) FROM pg_stat_activity
WHERE application_name = $1 AND datname = current_database();

-- name: try_acquire
-- Takes the leadership lock of one name (a partition, or the reconciler) on the lock session, if free.
SELECT pg_try_advisory_lock($1, hashtext($2));

-- name: release
-- Releases the leadership lock of one name on the lock session.
SELECT pg_advisory_unlock($1, hashtext($2));

-- name: probe_session
-- The probe of the leadership session (LeaderLocks.alive): any answer renews the lease.
SELECT 1;

-- ---------------------------------------------------------------------------
-- The migration runner's bookkeeping (ledger.migrate, ledger.pending_migrations,
-- Ledger.set_partitions): the lock that serialises `pacerd migrate` runs ($1:
-- MIGRATION_LOCK_KEY) and the table of applied migrations.
-- ---------------------------------------------------------------------------

-- name: migration_lock
-- Waits for the migration lock ($1) on the migrating session.
SELECT pg_advisory_lock($1);

-- name: migration_unlock
-- Releases the migration lock ($1) on the migrating session.
SELECT pg_advisory_unlock($1);

-- name: migration_xact_lock
-- Waits for the migration lock ($1) until the end of the transaction (a change of partitions).
SELECT pg_advisory_xact_lock($1);

-- name: create_schema
-- Creates the pacerd schema before the first migration.
CREATE SCHEMA IF NOT EXISTS pacerd;

-- name: create_migrations_table
-- Creates the table of applied migrations before the first migration.
CREATE TABLE IF NOT EXISTS pacerd.migrations (
    version integer PRIMARY KEY, name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now());

-- name: migrations_table_exists
-- Whether the table of applied migrations exists (pending_migrations on a ledger never migrated).
SELECT to_regclass('pacerd.migrations') IS NOT NULL;

-- name: applied_migrations
-- The versions of the migrations applied.
SELECT version FROM pacerd.migrations;

-- name: record_migration
-- Records migration $1 (version), $2 (file name) as applied, in its transaction.
INSERT INTO pacerd.migrations (version, name) VALUES ($1, $2);

-- name: is_superuser
-- Whether the migrating role is a superuser (a notice: the functions run with their owner's rights).
SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user;

-- ---------------------------------------------------------------------------
-- The client's statements (client.py: producers, workers, operators and the
-- CLI). Each block is named for the Client method that sends it. Writes call
-- the public SQL functions, as a producer in another language would; reads use
-- the documented tables.
--
-- dead, count_dead and replay_matching are templates: {where} is filled with
-- the conditions of a DeadFilter (client.dead_statement; its placeholders come
-- after the block's own) and {limit} with the placeholder after them.
-- ---------------------------------------------------------------------------

-- name: schedule
-- Schedules a job, or revises it (pacerd.schedule): 'scheduled', 'revised' or 'unchanged'.
SELECT pacerd.schedule(job_id => $1, kind => $2, destination => $3, payload => $4,
                       eligible_at => coalesce($5, now()), revision => $6, max_attempts => $7);

-- name: report
-- Reports the outcome of one attempt (pacerd.report): 'applied', 'stale' or 'unknown'.
SELECT pacerd.report(job_id => $1, attempt => $2, outcome => $3,
                     retry_after_s => $4, error => $5, detail => $6, cursor => $7);

-- name: cancel
-- Cancels job $1, $2 the reason (pacerd.cancel).
SELECT pacerd.cancel($1, $2);

-- name: replay
-- Replays dead job $1, $2 the reason (pacerd.replay).
SELECT pacerd.replay($1, $2);

-- name: is_current
-- Whether attempt $2 of job $1 is still the current offer (pacerd.is_current).
SELECT pacerd.is_current($1, $2);

-- name: are_current
-- pacerd.is_current for each (job $1[i], attempt $2[i]), in their order.
SELECT pacerd.is_current(j, a) FROM unnest($1::text[], $2::int[])
WITH ORDINALITY AS t(j, a, n) ORDER BY n;

-- name: pause
-- Pauses destination $1, or every destination when NULL (pacerd.pause).
SELECT pacerd.pause($1);

-- name: resume
-- Resumes destination $1, or every destination when NULL (pacerd.resume).
SELECT pacerd.resume($1);

-- name: show_job
-- One job, every column `pacerd show` prints.
SELECT job_id, kind, destination, state, attempt, failures, max_attempts, next_attempt_at,
       revision, payload, cursor, last_error, lease_expires_at, created_at, updated_at
FROM pacerd.jobs WHERE job_id = $1;

-- name: show_events
-- The events of one job, oldest first, for `pacerd show`.
SELECT id, job_id, attempt, event, at, detail FROM pacerd.job_events
WHERE job_id = $1 ORDER BY id;

-- name: dead
-- The dead jobs matching a filter ({where}), most recently dead first, up to {limit}.
SELECT job_id, kind, destination, state, attempt, failures, max_attempts, next_attempt_at,
       revision, payload, cursor, last_error, lease_expires_at, created_at, updated_at
FROM pacerd.jobs WHERE {where}
ORDER BY updated_at DESC, job_id LIMIT {limit};

-- name: count_dead
-- How many dead jobs match a filter ({where}).
SELECT count(*) FROM pacerd.jobs WHERE {where};

-- name: replay_matching
-- Replays up to $2 dead jobs matching a filter ({where}), oldest first, each through pacerd.replay with reason $1; returns how many.
SELECT count(*) FILTER (WHERE pacerd.replay(job_id, $1) = 'replayed') FROM (
    SELECT job_id FROM pacerd.jobs WHERE {where} ORDER BY updated_at, job_id
    LIMIT $2 FOR UPDATE SKIP LOCKED) s;

-- name: status_now
-- The database's clock, the one instant `pacerd status` measures ages and cool-downs from.
SELECT now();

-- name: status
-- Every destination with its pause, cool-down, persisted pacer state, leader and counters, for `pacerd status`.
SELECT d.destination, d.paused, c.paused_all, d.cooldown_until,
       d.pacer_state::text AS pacer_state, p.leader, p.leader_since,
       d.n_accepted, d.n_refused
FROM pacerd.destinations d CROSS JOIN pacerd.control c
LEFT JOIN pacerd.partitions p ON p.partition = d.partition
ORDER BY d.destination;
