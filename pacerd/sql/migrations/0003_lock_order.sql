-- pacerd ledger, version 3: one lock order for every statement that locks
-- several rows.
--
-- Forward-only. Two statements that lock the same jobs in different orders
-- can each hold a row the other waits for: PostgreSQL then aborts one of
-- them (40P01). So every statement that waits for locks on several rows
-- takes them in one order: jobs by job_id first, then destinations by name.
-- The daemon's marks and releases do so in `queries.sql`; its claims and the
-- reconciler use SKIP LOCKED and never wait. pacerd.report locks one job,
-- then its destination, which is that order already.
--
-- pacerd.report_many locked its jobs in batch order and in plan order, and
-- each destination's counters row when it came to it. It now takes every
-- lock it needs up front, in that order; its results and effects are
-- unchanged (see 0002_report_many.sql).
--
-- pacerd.resume(NULL) updated every paused destination in scan order; it
-- now locks them by name first.

CREATE OR REPLACE FUNCTION pacerd.report_many(
    job_id        text[],
    attempt       integer[],
    outcome       text[],
    retry_after_s double precision[],
    error         text[],
    detail        jsonb[],
    cursor        jsonb[]
) RETURNS text[]
LANGUAGE plpgsql AS $$
DECLARE
    v_results text[] := array_fill(NULL::text, ARRAY[coalesce(cardinality(job_id), 0)]);
    v_done    integer[];
    r         record;
BEGIN
    IF coalesce(cardinality(job_id), 0) = 0 THEN
        RETURN '{}'::text[];
    END IF;

    -- Every job the batch names, in job_id order, then their destinations'
    -- counters, in name order: what follows only touches rows already held.
    PERFORM 1 FROM pacerd.jobs j WHERE j.job_id = ANY (report_many.job_id)
    ORDER BY j.job_id FOR UPDATE;
    PERFORM 1 FROM pacerd.destinations d
    WHERE d.destination IN (SELECT j.destination FROM pacerd.jobs j
                           WHERE j.job_id = ANY (report_many.job_id))
    ORDER BY d.destination FOR UPDATE;

    WITH input AS (
        SELECT i.*, count(*) OVER (PARTITION BY i.job_id) AS named
        FROM unnest(report_many.job_id, report_many.attempt, report_many.outcome,
                    report_many.retry_after_s, report_many.error, report_many.detail,
                    report_many.cursor)
             WITH ORDINALITY AS i(job_id, attempt, outcome, retry_after_s, error, detail,
                                  cursor, n)
    ), fast AS MATERIALIZED (
        SELECT i.* FROM input i
        WHERE i.outcome = 'ok' AND i.named = 1
          AND i.job_id IS NOT NULL AND btrim(i.job_id) <> '' AND i.attempt >= 1
          AND (i.retry_after_s IS NULL
               OR (i.retry_after_s >= 0 AND i.retry_after_s <= 31536000
                   AND i.retry_after_s <> 'NaN'::float8))
    ), done AS (
        UPDATE pacerd.jobs j SET state = 'completed', lease_expires_at = NULL,
            ever_offered = true, cursor = coalesce(f.cursor, j.cursor), last_error = NULL,
            updated_at = now()
        FROM fast f
        WHERE j.job_id = f.job_id AND j.attempt = f.attempt
          -- (a CASE, so that the plan looks jobs up by primary key: the partial
          -- in-flight index would match a plain predicate, and its statistics
          -- are often stale in a burst — a nested loop over every job in flight)
          AND CASE WHEN j.state IN ('claimed', 'offered') THEN j.lease_expires_at >= now()
                   ELSE false END
        RETURNING f.n, j.job_id, f.attempt, j.destination, j.admit_epoch, f.retry_after_s,
                  f.error, f.detail
    ), events AS (
        INSERT INTO pacerd.job_events (job_id, attempt, event, detail)
        SELECT d.job_id, d.attempt, 'completed', jsonb_strip_nulls(jsonb_build_object(
            'outcome', 'ok', 'retry_after_s', d.retry_after_s, 'error', d.error,
            'detail', d.detail))
        FROM done d ORDER BY d.n
    ), per_destination AS (
        SELECT d.destination, count(*) AS n, array_agg(d.admit_epoch) AS epochs
        FROM done d GROUP BY d.destination
    ), counted AS (
        UPDATE pacerd.destinations dst SET
            n_accepted = dst.n_accepted + p.n,
            n_accepted_fresh = dst.n_accepted_fresh + (
                SELECT count(*) FROM unnest(p.epochs) e WHERE e >= coalesce(dst.epoch, 0)),
            updated_at = now()
        FROM per_destination p
        WHERE dst.destination = p.destination
    )
    SELECT array_agg(d.n::integer) INTO v_done FROM done d;
    FOR i IN 1 .. coalesce(cardinality(v_done), 0) LOOP
        v_results[v_done[i]] := 'applied';
    END LOOP;

    FOR r IN
        SELECT i.job_id, i.attempt, i.outcome, i.retry_after_s, i.error, i.detail, i.cursor, i.n
        FROM unnest(report_many.job_id, report_many.attempt, report_many.outcome,
                    report_many.retry_after_s, report_many.error, report_many.detail,
                    report_many.cursor)
             WITH ORDINALITY AS i(job_id, attempt, outcome, retry_after_s, error, detail, cursor, n)
        ORDER BY i.n
    LOOP
        CONTINUE WHEN v_results[r.n::integer] IS NOT NULL;
        v_results[r.n::integer] := pacerd.report(job_id => r.job_id, attempt => r.attempt,
            outcome => r.outcome, retry_after_s => r.retry_after_s, error => r.error,
            detail => r.detail, cursor => r.cursor);
    END LOOP;
    RETURN v_results;
END
$$;

CREATE OR REPLACE FUNCTION pacerd.resume(destination text DEFAULT NULL) RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    v_changed integer := 0;
    v_n integer;
BEGIN
    IF destination IS NULL THEN
        UPDATE pacerd.control c SET paused_all = false, paused_at = NULL WHERE c.paused_all;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        v_changed := v_changed + v_n;
        PERFORM 1 FROM pacerd.destinations d WHERE d.paused ORDER BY d.destination FOR UPDATE;
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
