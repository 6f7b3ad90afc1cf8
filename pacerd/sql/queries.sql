-- The daemon's private statements. One block per query:
--   -- name: <name>
--   -- <one-line description>
--   <statement>
-- ledger.py loads this file once and has one method per block, same name.
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
-- Claims up to $3 due jobs of destination $1, oldest first, $2 of them reserved for the live lane; sets the claim lease.
WITH dest AS MATERIALIZED (
    -- the destination's row as last committed: FOR SHARE waits for a report or
    -- pause in progress on it, so one that began before this claim is seen
    SELECT d.paused, d.cooldown_until FROM pacerd.destinations d
    WHERE d.destination = $1
    FOR SHARE OF d
), closed AS (
    -- paused, or in a Retry-After cool-down: checked here too, so that a tick
    -- that read the destination open claims nothing once a pause or a
    -- refusal has committed
    SELECT 1 FROM dest d, pacerd.control c
    WHERE d.paused OR c.paused_all OR d.cooldown_until > coalesce($7::timestamptz, now())
), live AS (
    SELECT j.job_id, j.next_attempt_at
    FROM pacerd.jobs j
    WHERE j.destination = $1 AND j.state = 'scheduled' AND NOT EXISTS (SELECT 1 FROM closed)
      AND j.next_attempt_at <= coalesce($7::timestamptz, now())
      AND j.next_attempt_at > coalesce($7::timestamptz, now()) - make_interval(secs => $6)
      AND NOT j.ever_offered
    ORDER BY j.next_attempt_at
    LIMIT $3
    FOR UPDATE OF j SKIP LOCKED
), backlog AS (
    SELECT j.job_id, j.next_attempt_at
    FROM pacerd.jobs j
    WHERE j.destination = $1 AND j.state = 'scheduled' AND NOT EXISTS (SELECT 1 FROM closed)
      AND j.next_attempt_at <= coalesce($7::timestamptz, now())
      AND (j.ever_offered
           OR j.next_attempt_at <= coalesce($7::timestamptz, now()) - make_interval(secs => $6))
    ORDER BY j.next_attempt_at
    LIMIT $3
    FOR UPDATE OF j SKIP LOCKED
), shares AS (
    SELECT least((SELECT count(*) FROM live),
                 greatest($2::bigint, $3::bigint - (SELECT count(*) FROM backlog))) AS n_live
), picked AS (
    SELECT l.job_id, true AS live FROM (
        SELECT job_id, row_number() OVER (ORDER BY next_attempt_at, job_id) AS rn FROM live
    ) l, shares s WHERE l.rn <= s.n_live
    UNION ALL
    SELECT b.job_id, false AS live FROM (
        SELECT job_id, row_number() OVER (ORDER BY next_attempt_at, job_id) AS rn FROM backlog
    ) b, shares s WHERE b.rn <= $3::bigint - s.n_live
), claimed AS (
    UPDATE pacerd.jobs j SET
        state = 'claimed',
        attempt = j.attempt + 1,
        lease_expires_at = coalesce($7::timestamptz, now()) + make_interval(secs => $4),
        admit_epoch = $5,
        claimed_by = $8,
        updated_at = coalesce($7::timestamptz, now())
    FROM picked
    WHERE j.job_id = ANY (ARRAY(SELECT job_id FROM picked)) AND j.job_id = picked.job_id
    RETURNING j.job_id, j.kind, j.destination, j.attempt, j.revision, j.payload, j.cursor,
              j.next_attempt_at, picked.live
), events AS (
    INSERT INTO pacerd.job_events (job_id, attempt, event, at, detail)
    SELECT c.job_id, c.attempt, 'claimed', coalesce($7::timestamptz, now()),
           jsonb_build_object('lane', CASE WHEN c.live THEN 'live' ELSE 'backlog' END,
                              'by', $8::text, 'epoch', $5::bigint)
    FROM claimed c
)
SELECT job_id, kind, destination, attempt, revision, payload::text AS payload,
       cursor::text AS cursor, next_attempt_at, live
FROM claimed
ORDER BY next_attempt_at, job_id;

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

-- name: count_inflight
-- Counts claimed and offered jobs of one destination (bounded by max_inflight).
SELECT count(*) AS inflight
FROM pacerd.jobs
WHERE destination = $1 AND state IN ('claimed', 'offered');

-- name: oldest_due
-- The next_attempt_at of the oldest due job of one destination (an index lookup).
SELECT min(next_attempt_at) AS oldest_due_at
FROM pacerd.jobs
WHERE destination = $1 AND state = 'scheduled' AND next_attempt_at <= coalesce($2::timestamptz, now());

-- name: has_due
-- Whether one destination has at least $2 due jobs beyond the first (bounded scan).
SELECT count(*) AS n FROM (
    SELECT 1 FROM pacerd.jobs
    WHERE destination = $1 AND state = 'scheduled'
      AND next_attempt_at <= coalesce($3::timestamptz, now())
    ORDER BY next_attempt_at  -- an index range scan, whatever the statistics say
    LIMIT $2
) s;

-- name: list_destinations
-- Every destination the ledger knows, with its shared state and counters.
SELECT d.destination, d.paused, c.paused_all, d.cooldown_until, d.epoch,
       d.pacer_state::text AS pacer_state, d.n_accepted, d.n_refused, d.n_accepted_fresh,
       d.n_refused_fresh, d.n_retry_after, d.leader, d.leader_since,
       coalesce($1::timestamptz, now()) AS now
FROM pacerd.destinations d, pacerd.control c
ORDER BY d.destination;

-- name: read_destination
-- One destination's shared state and outcome counters, read at the top of a tick.
SELECT d.destination, d.paused, c.paused_all, d.cooldown_until, d.epoch,
       d.pacer_state::text AS pacer_state, d.n_accepted, d.n_refused, d.n_accepted_fresh,
       d.n_refused_fresh, d.n_retry_after, d.leader, d.leader_since,
       coalesce($2::timestamptz, now()) AS now
FROM pacerd.destinations d, pacerd.control c
WHERE d.destination = $1;

-- name: ensure_destination
-- Registers a destination (from the config) so that it is declared and led.
INSERT INTO pacerd.destinations (destination) VALUES ($1)
ON CONFLICT DO NOTHING;

-- name: save_pacer_state
-- Persists the pacer of one destination every tick; $3 is the epoch (bumped at each cut).
UPDATE pacerd.destinations SET
    pacer_state = $2::jsonb,
    epoch = greatest(epoch, $3),
    updated_at = coalesce($4::timestamptz, now())
WHERE destination = $1;

-- name: set_leader
-- Records which instance leads a destination, and since when (for status).
UPDATE pacerd.destinations SET
    leader = $2,
    leader_since = CASE WHEN leader IS DISTINCT FROM $2 THEN coalesce($3::timestamptz, now())
                        ELSE leader_since END
WHERE destination = $1;

-- name: due_summary
-- Per destination: due count, oldest due, in flight and dead, for status and metrics (it counts: a slower cadence).
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
ORDER BY d.destination;

-- name: write_settings
-- Stores the limits the SQL functions enforce (from the config file).
INSERT INTO pacerd.settings (key, value, updated_at)
SELECT k, v, now() FROM unnest($1::text[], $2::jsonb[]) AS s(k, v)
ON CONFLICT (key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at
WHERE pacerd.settings.value IS DISTINCT FROM excluded.value;

-- name: apply_reports
-- Applies a batch of outcome reports with pacerd.report's effects, in order, in the caller's transaction (set-based: pacerd.report_many).
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
