-- pacerd ledger, version 1: tables, indexes and the public SQL API.
--
-- Forward-only. Applied by `pacerd migrate` in one transaction, under an
-- advisory lock. Never edit this file once released: add 0002_....sql.

CREATE SCHEMA IF NOT EXISTS pacerd;

-- Limits the functions enforce. `pacerd migrate` and `pacerd run` write them
-- from the config file, so every caller (any language) sees the same rules.
CREATE TABLE pacerd.settings (
    key        text PRIMARY KEY,
    value      jsonb NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

INSERT INTO pacerd.settings (key, value) VALUES
    ('payload_max_bytes', '262144'),
    ('max_attempts', '10'),
    ('backoff_base_seconds', '1.0'),
    ('backoff_cap_seconds', '3600.0');

CREATE TABLE pacerd.jobs (
    job_id           text PRIMARY KEY,
    kind             text NOT NULL,
    destination      text NOT NULL,
    state            text NOT NULL DEFAULT 'scheduled',
    attempt          integer NOT NULL DEFAULT 0,
    failures         integer NOT NULL DEFAULT 0,
    max_attempts     integer NOT NULL,
    next_attempt_at  timestamptz NOT NULL,
    revision         bigint NOT NULL DEFAULT 0,
    payload          jsonb NOT NULL,
    cursor           jsonb,
    last_error       text,
    lease_expires_at timestamptz,
    ever_offered     boolean NOT NULL DEFAULT false,
    admit_epoch      bigint NOT NULL DEFAULT 0,
    claimed_by       text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT jobs_state_check CHECK (
        state IN ('scheduled', 'claimed', 'offered', 'completed', 'dead', 'cancelled')),
    CONSTRAINT jobs_attempt_check CHECK (attempt >= 0 AND failures >= 0 AND max_attempts >= 1),
    CONSTRAINT jobs_lease_check CHECK (
        (state IN ('claimed', 'offered')) = (lease_expires_at IS NOT NULL))
);

-- Due work, oldest first, per destination: the claim and the oldest-due age
-- are range scans on this index whatever the size of the backlog.
CREATE INDEX jobs_due_idx ON pacerd.jobs (destination, next_attempt_at)
    WHERE state = 'scheduled';
-- Leases to reclaim, and in-flight counts per destination.
CREATE INDEX jobs_lease_idx ON pacerd.jobs (lease_expires_at)
    WHERE state IN ('claimed', 'offered');
CREATE INDEX jobs_inflight_idx ON pacerd.jobs (destination)
    WHERE state IN ('claimed', 'offered');
-- Dead letters, newest first, for `pacerd dead` and bulk replay.
CREATE INDEX jobs_dead_idx ON pacerd.jobs (destination, updated_at)
    WHERE state = 'dead';

-- The audit trail: one row per transition, append-only.
CREATE TABLE pacerd.job_events (
    id      bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id  text NOT NULL,
    attempt integer NOT NULL,
    event   text NOT NULL,
    at      timestamptz NOT NULL DEFAULT now(),
    detail  jsonb
);
CREATE INDEX job_events_job_idx ON pacerd.job_events (job_id, id);

-- Per-destination state shared by every instance: durable pause, Retry-After
-- cool-down, the persisted pacer, outcome counters, and who leads it.
CREATE TABLE pacerd.destinations (
    destination       text PRIMARY KEY,
    paused            boolean NOT NULL DEFAULT false,
    paused_at         timestamptz,
    cooldown_until    timestamptz,
    epoch             bigint NOT NULL DEFAULT 0,
    pacer_state       jsonb,
    n_accepted        bigint NOT NULL DEFAULT 0,
    n_refused         bigint NOT NULL DEFAULT 0,
    n_accepted_fresh  bigint NOT NULL DEFAULT 0,
    n_refused_fresh   bigint NOT NULL DEFAULT 0,
    n_retry_after     bigint NOT NULL DEFAULT 0,
    leader            text,
    leader_since      timestamptz,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now()
);

-- Cluster-wide switches (one row): the pause of every destination.
CREATE TABLE pacerd.control (
    id         boolean PRIMARY KEY DEFAULT true CHECK (id),
    paused_all boolean NOT NULL DEFAULT false,
    paused_at  timestamptz
);
INSERT INTO pacerd.control (id) VALUES (true);

-- ---------------------------------------------------------------------------
-- Internal helpers
-- ---------------------------------------------------------------------------

CREATE FUNCTION pacerd._setting(p_key text) RETURNS jsonb
LANGUAGE sql STABLE AS $$
    SELECT value FROM pacerd.settings WHERE key = p_key
$$;

CREATE FUNCTION pacerd._reject(p_function text, p_message text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION USING
        ERRCODE = '22023',  -- invalid_parameter_value
        MESSAGE = format('pacerd.%s: %s', p_function, p_message);
END
$$;

CREATE FUNCTION pacerd._event(p_job_id text, p_attempt integer, p_event text, p_detail jsonb)
RETURNS void LANGUAGE sql AS $$
    INSERT INTO pacerd.job_events (job_id, attempt, event, detail)
    VALUES (p_job_id, p_attempt, p_event, p_detail)
$$;

-- Exponential backoff with full jitter: uniform in [0, min(cap, base * 2^(n-1))].
CREATE FUNCTION pacerd._backoff_seconds(p_failures integer) RETURNS double precision
LANGUAGE sql VOLATILE AS $$
    SELECT random() * least(
        (pacerd._setting('backoff_cap_seconds'))::double precision,
        (pacerd._setting('backoff_base_seconds'))::double precision
            * power(2.0, least(greatest(p_failures, 1) - 1, 60)))
$$;

CREATE FUNCTION pacerd._valid_destination(p_destination text) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT p_destination ~ '^[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}$'
$$;

-- ---------------------------------------------------------------------------
-- Public API
-- ---------------------------------------------------------------------------

CREATE FUNCTION pacerd.schedule(
    job_id       text,
    kind         text,
    destination  text,
    payload      jsonb,
    eligible_at  timestamptz DEFAULT now(),
    revision     bigint DEFAULT 0,
    max_attempts integer DEFAULT NULL
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_job       pacerd.jobs;
    v_limit     bigint := (pacerd._setting('payload_max_bytes'))::bigint;
    v_size      bigint;
    v_max       integer := coalesce(max_attempts, (pacerd._setting('max_attempts'))::integer);
    v_at        timestamptz := coalesce(eligible_at, now());
    v_revision  bigint := coalesce(revision, 0);
BEGIN
    IF job_id IS NULL OR btrim(job_id) = '' THEN
        PERFORM pacerd._reject('schedule', 'job_id must not be empty');
    END IF;
    IF length(job_id) > 512 THEN
        PERFORM pacerd._reject('schedule', 'job_id must be at most 512 characters');
    END IF;
    IF kind IS NULL OR btrim(kind) = '' THEN
        PERFORM pacerd._reject('schedule', 'kind must not be empty');
    END IF;
    IF destination IS NULL OR btrim(destination) = '' THEN
        PERFORM pacerd._reject('schedule', 'destination must not be empty');
    END IF;
    IF NOT pacerd._valid_destination(destination) THEN
        PERFORM pacerd._reject('schedule', format(
            'destination %L must match [A-Za-z0-9][A-Za-z0-9_.:-]{0,199}', destination));
    END IF;
    IF payload IS NULL THEN
        PERFORM pacerd._reject('schedule', 'payload must not be NULL (use ''{}'' for none)');
    END IF;
    v_size := octet_length(payload::text);
    IF v_size > v_limit THEN
        PERFORM pacerd._reject('schedule', format(
            'payload is %s bytes, over the limit of %s bytes (retry.payload_max_bytes)',
            v_size, v_limit));
    END IF;
    IF v_max < 1 THEN
        PERFORM pacerd._reject('schedule', format('max_attempts must be at least 1, got %s', v_max));
    END IF;
    IF v_revision < 0 THEN
        PERFORM pacerd._reject('schedule', format('revision must not be negative, got %s', v_revision));
    END IF;

    INSERT INTO pacerd.destinations (destination) VALUES (schedule.destination)
    ON CONFLICT DO NOTHING;

    INSERT INTO pacerd.jobs AS j
        (job_id, kind, destination, max_attempts, next_attempt_at, revision, payload)
    VALUES (schedule.job_id, schedule.kind, schedule.destination, v_max, v_at, v_revision,
            schedule.payload)
    ON CONFLICT ON CONSTRAINT jobs_pkey DO NOTHING
    RETURNING * INTO v_job;
    IF FOUND THEN
        PERFORM pacerd._event(v_job.job_id, v_job.attempt, 'scheduled', jsonb_build_object(
            'revision', v_revision, 'eligible_at', v_at, 'destination', schedule.destination));
        RETURN 'scheduled';
    END IF;

    SELECT * INTO v_job FROM pacerd.jobs j WHERE j.job_id = schedule.job_id FOR UPDATE;
    IF v_revision <= v_job.revision THEN
        RETURN 'unchanged';
    END IF;

    UPDATE pacerd.jobs j SET
        kind = schedule.kind,
        destination = schedule.destination,
        state = 'scheduled',
        failures = 0,
        max_attempts = v_max,
        next_attempt_at = v_at,
        revision = v_revision,
        payload = schedule.payload,
        cursor = NULL,
        last_error = NULL,
        lease_expires_at = NULL,
        ever_offered = false,
        claimed_by = NULL,
        updated_at = now()
    WHERE j.job_id = schedule.job_id;

    IF v_job.state IN ('completed', 'dead', 'cancelled') THEN
        PERFORM pacerd._event(v_job.job_id, v_job.attempt, 'scheduled', jsonb_build_object(
            'revision', v_revision, 'eligible_at', v_at, 'destination', schedule.destination,
            'restarted_from', v_job.state));
        RETURN 'scheduled';
    END IF;
    PERFORM pacerd._event(v_job.job_id, v_job.attempt, 'revised', jsonb_build_object(
        'revision', v_revision, 'previous_revision', v_job.revision, 'eligible_at', v_at,
        'destination', schedule.destination, 'previous_state', v_job.state));
    RETURN 'revised';
END
$$;

CREATE FUNCTION pacerd.report(
    job_id        text,
    attempt       integer,
    outcome       text,
    retry_after_s double precision DEFAULT NULL,
    error         text DEFAULT NULL,
    detail        jsonb DEFAULT NULL,
    cursor        jsonb DEFAULT NULL
) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_job    pacerd.jobs;
    v_dest   pacerd.destinations;
    v_fresh  boolean;
    v_info   jsonb;
    v_next   timestamptz;
BEGIN
    IF job_id IS NULL OR btrim(job_id) = '' THEN
        PERFORM pacerd._reject('report', 'job_id must not be empty');
    END IF;
    IF attempt IS NULL OR attempt < 1 THEN
        PERFORM pacerd._reject('report', format('attempt must be a positive integer, got %s',
            coalesce(attempt::text, 'NULL')));
    END IF;
    IF outcome IS NULL OR outcome NOT IN ('ok', 'refused', 'retry', 'fail', 'continue') THEN
        PERFORM pacerd._reject('report', format(
            'outcome must be one of ok, refused, retry, fail, continue; got %s',
            coalesce(quote_literal(outcome), 'NULL')));
    END IF;
    IF retry_after_s IS NOT NULL AND (retry_after_s < 0 OR retry_after_s = 'NaN'::float8
                                      OR retry_after_s = 'Infinity'::float8) THEN
        PERFORM pacerd._reject('report', format(
            'retry_after_s must be a finite number >= 0, got %s', retry_after_s));
    END IF;
    -- An upstream's Retry-After is outside data: bound it, so that a nonsense
    -- value is a clear rejection rather than a timestamp overflow.
    IF retry_after_s > 31536000 THEN
        PERFORM pacerd._reject('report', format(
            'retry_after_s must be at most 31536000 (365 days), got %s', retry_after_s));
    END IF;

    SELECT * INTO v_job FROM pacerd.jobs j WHERE j.job_id = report.job_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'unknown';
    END IF;

    v_info := jsonb_strip_nulls(jsonb_build_object(
        'outcome', outcome, 'retry_after_s', retry_after_s, 'error', error, 'detail', detail));

    IF attempt <> v_job.attempt
       OR v_job.state NOT IN ('claimed', 'offered')
       OR v_job.lease_expires_at < now() THEN
        PERFORM pacerd._event(v_job.job_id, attempt, 'stale_report', v_info || jsonb_build_object(
            'current_attempt', v_job.attempt, 'state', v_job.state,
            'lease_expired', coalesce(v_job.lease_expires_at < now(), false)));
        RETURN 'stale';
    END IF;

    -- An applied report proves the message reached a worker, even when it beat
    -- the publisher confirm: the job counts as offered, so whatever comes next
    -- (a retry, a refusal, a continuation, a replay) is backlog, not live.
    IF outcome = 'ok' THEN
        UPDATE pacerd.jobs j SET state = 'completed', lease_expires_at = NULL, ever_offered = true,
            cursor = coalesce(report.cursor, j.cursor), last_error = NULL, updated_at = now()
        WHERE j.job_id = v_job.job_id;
        PERFORM pacerd._event(v_job.job_id, attempt, 'completed', v_info);
    ELSIF outcome = 'refused' THEN
        v_next := CASE WHEN retry_after_s IS NULL THEN v_job.next_attempt_at
                       ELSE greatest(v_job.next_attempt_at, now() + make_interval(secs => retry_after_s))
                  END;
        UPDATE pacerd.jobs j SET state = 'scheduled', lease_expires_at = NULL, ever_offered = true,
            next_attempt_at = v_next, claimed_by = NULL, updated_at = now()
        WHERE j.job_id = v_job.job_id;
        PERFORM pacerd._event(v_job.job_id, attempt, 'refused', v_info);
    ELSIF outcome = 'retry' THEN
        IF v_job.failures + 1 >= v_job.max_attempts THEN
            UPDATE pacerd.jobs j SET state = 'dead', lease_expires_at = NULL, ever_offered = true,
                failures = j.failures + 1, last_error = report.error, claimed_by = NULL,
                updated_at = now()
            WHERE j.job_id = v_job.job_id;
            PERFORM pacerd._event(v_job.job_id, attempt, 'dead', v_info || jsonb_build_object(
                'reason', 'attempts_exhausted', 'failures', v_job.failures + 1));
        ELSE
            v_next := now() + make_interval(secs => pacerd._backoff_seconds(v_job.failures + 1));
            UPDATE pacerd.jobs j SET state = 'scheduled', lease_expires_at = NULL, ever_offered = true,
                failures = j.failures + 1, last_error = report.error, claimed_by = NULL,
                next_attempt_at = v_next, updated_at = now()
            WHERE j.job_id = v_job.job_id;
            PERFORM pacerd._event(v_job.job_id, attempt, 'rescheduled', v_info || jsonb_build_object(
                'failures', v_job.failures + 1, 'next_attempt_at', v_next));
        END IF;
    ELSIF outcome = 'fail' THEN
        UPDATE pacerd.jobs j SET state = 'dead', lease_expires_at = NULL, ever_offered = true,
            last_error = report.error, claimed_by = NULL, updated_at = now()
        WHERE j.job_id = v_job.job_id;
        PERFORM pacerd._event(v_job.job_id, attempt, 'dead', v_info || jsonb_build_object(
            'reason', 'failed'));
    ELSE  -- continue: checkpoint, eligible again at once, keeping its place in line
        UPDATE pacerd.jobs j SET state = 'scheduled', lease_expires_at = NULL, ever_offered = true,
            cursor = report.cursor, claimed_by = NULL,
            next_attempt_at = least(j.next_attempt_at, now()), updated_at = now()
        WHERE j.job_id = v_job.job_id;
        PERFORM pacerd._event(v_job.job_id, attempt, 'continued', v_info || jsonb_build_object(
            'cursor', report.cursor));
    END IF;

    -- Outcome counters feed the pacer of the destination's leader, wherever
    -- the report came from. "Fresh" outcomes are for jobs admitted since the
    -- pacer's last cut (the epoch), so one episode cuts only once.
    SELECT * INTO v_dest FROM pacerd.destinations d
    WHERE d.destination = v_job.destination FOR UPDATE;
    v_fresh := v_job.admit_epoch >= coalesce(v_dest.epoch, 0);
    UPDATE pacerd.destinations d SET
        n_accepted = d.n_accepted + (outcome <> 'refused')::int,
        n_refused = d.n_refused + (outcome = 'refused')::int,
        n_accepted_fresh = d.n_accepted_fresh + (outcome <> 'refused' AND v_fresh)::int,
        n_refused_fresh = d.n_refused_fresh + (outcome = 'refused' AND v_fresh)::int,
        n_retry_after = d.n_retry_after + (outcome = 'refused' AND retry_after_s IS NOT NULL)::int,
        cooldown_until = CASE
            WHEN outcome = 'refused' AND retry_after_s IS NOT NULL THEN greatest(
                d.cooldown_until, now() + make_interval(secs => retry_after_s))
            ELSE d.cooldown_until END,
        updated_at = now()
    WHERE d.destination = v_job.destination;
    RETURN 'applied';
END
$$;

CREATE FUNCTION pacerd.cancel(job_id text, reason text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_job pacerd.jobs;
BEGIN
    IF job_id IS NULL OR btrim(job_id) = '' THEN
        PERFORM pacerd._reject('cancel', 'job_id must not be empty');
    END IF;
    SELECT * INTO v_job FROM pacerd.jobs j WHERE j.job_id = cancel.job_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'unknown';
    END IF;
    IF v_job.state IN ('completed', 'dead', 'cancelled') THEN
        RETURN 'unchanged';
    END IF;
    UPDATE pacerd.jobs j SET state = 'cancelled', lease_expires_at = NULL, claimed_by = NULL,
        updated_at = now()
    WHERE j.job_id = v_job.job_id;
    PERFORM pacerd._event(v_job.job_id, v_job.attempt, 'cancelled', jsonb_strip_nulls(
        jsonb_build_object('reason', reason, 'previous_state', v_job.state)));
    RETURN 'cancelled';
END
$$;

CREATE FUNCTION pacerd.replay(job_id text, reason text) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_job pacerd.jobs;
BEGIN
    IF job_id IS NULL OR btrim(job_id) = '' THEN
        PERFORM pacerd._reject('replay', 'job_id must not be empty');
    END IF;
    IF reason IS NULL OR btrim(reason) = '' THEN
        PERFORM pacerd._reject('replay', 'reason must not be empty: say why the job is replayed');
    END IF;
    SELECT * INTO v_job FROM pacerd.jobs j WHERE j.job_id = replay.job_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN 'unknown';
    END IF;
    IF v_job.state <> 'dead' THEN
        RETURN 'unchanged';
    END IF;
    -- A replay is backlog (docs/protocol.md, Terms), never the live lane.
    UPDATE pacerd.jobs j SET state = 'scheduled', failures = 0, next_attempt_at = now(),
        ever_offered = true, updated_at = now()
    WHERE j.job_id = v_job.job_id;
    PERFORM pacerd._event(v_job.job_id, v_job.attempt, 'replayed', jsonb_build_object(
        'reason', reason, 'failures_before', v_job.failures, 'last_error', v_job.last_error));
    RETURN 'replayed';
END
$$;

CREATE FUNCTION pacerd.is_current(job_id text, attempt integer) RETURNS boolean
LANGUAGE sql STABLE AS $$
    SELECT coalesce((
        SELECT j.attempt = is_current.attempt
               AND j.state IN ('claimed', 'offered')
               AND j.lease_expires_at >= now()
        FROM pacerd.jobs j WHERE j.job_id = is_current.job_id), false)
$$;

-- pause(NULL) pauses every destination, present and future; pause(d) one
-- destination, known yet or not. resume(NULL) lifts every pause; resume(d)
-- lifts d's own pause (a pause of all still applies to d).
CREATE FUNCTION pacerd.pause(destination text DEFAULT NULL) RETURNS text
LANGUAGE plpgsql AS $$
BEGIN
    IF destination IS NULL THEN
        UPDATE pacerd.control c SET paused_all = true, paused_at = coalesce(c.paused_at, now())
        WHERE NOT c.paused_all;
        RETURN CASE WHEN FOUND THEN 'paused' ELSE 'unchanged' END;
    END IF;
    IF NOT pacerd._valid_destination(destination) THEN
        PERFORM pacerd._reject('pause', format(
            'destination %L must match [A-Za-z0-9][A-Za-z0-9_.:-]{0,199}', destination));
    END IF;
    INSERT INTO pacerd.destinations AS d (destination, paused, paused_at)
    VALUES (pause.destination, true, now())
    ON CONFLICT ON CONSTRAINT destinations_pkey DO UPDATE SET paused = true, paused_at = now(), updated_at = now()
        WHERE NOT d.paused;
    RETURN CASE WHEN FOUND THEN 'paused' ELSE 'unchanged' END;
END
$$;

CREATE FUNCTION pacerd.resume(destination text DEFAULT NULL) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_changed integer := 0;
    v_n integer;
BEGIN
    IF destination IS NULL THEN
        UPDATE pacerd.control c SET paused_all = false, paused_at = NULL WHERE c.paused_all;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_changed := v_changed + v_n;
        UPDATE pacerd.destinations d SET paused = false, paused_at = NULL, updated_at = now()
        WHERE d.paused;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_changed := v_changed + v_n;
    ELSE
        UPDATE pacerd.destinations d SET paused = false, paused_at = NULL, updated_at = now()
        WHERE d.destination = resume.destination AND d.paused;
        GET DIAGNOSTICS v_changed = ROW_COUNT;
    END IF;
    RETURN CASE WHEN v_changed > 0 THEN 'resumed' ELSE 'unchanged' END;
END
$$;
