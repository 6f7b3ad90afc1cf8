-- pacerd ledger, version 7: pacerd.report_many refuses arrays of different
-- lengths.
--
-- Forward-only. Its arrays hold one element per report. unnest pads a
-- shorter array with NULLs, so a caller whose retry_after_s array came one
-- element short had the last report applied without its Retry-After, and
-- nothing said so: the destination was not closed, and work went out inside
-- the advertised window. A short attempt or outcome array failed as if a
-- report had said NULL. Now job_id, attempt and outcome must have the same
-- length. Each optional array (retry_after_s, error, detail, cursor) must
-- have that length too, or be NULL or empty, which means none for every
-- report. Otherwise the call fails with pacerd.report's error code (22023)
-- and a message that gives the lengths. Nothing else changes: the function
-- is the one of 0003_lock_order.sql with these checks first (restated whole,
-- as CREATE OR REPLACE needs, with its SECURITY DEFINER and search_path).

CREATE OR REPLACE FUNCTION pacerd.report_many(
    job_id        text[],
    attempt       integer[],
    outcome       text[],
    retry_after_s double precision[],
    error         text[],
    detail        jsonb[],
    cursor        jsonb[]
) RETURNS text[]
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pacerd, pg_temp AS $$
DECLARE
    v_results text[] := array_fill(NULL::text, ARRAY[coalesce(cardinality(job_id), 0)]);
    v_done    integer[];
    r         record;
    v_n       integer := coalesce(cardinality(report_many.job_id), 0);
    v_array   record;
BEGIN
    IF coalesce(cardinality(report_many.attempt), 0) <> v_n
       OR coalesce(cardinality(report_many.outcome), 0) <> v_n THEN
        PERFORM pacerd._reject('report_many', format(
            'job_id, attempt and outcome need one element per report, got %s, %s and %s',
            v_n, coalesce(cardinality(report_many.attempt), 0),
            coalesce(cardinality(report_many.outcome), 0)));
    END IF;
    FOR v_array IN
        SELECT * FROM (VALUES ('retry_after_s', cardinality(report_many.retry_after_s)),
                              ('error', cardinality(report_many.error)),
                              ('detail', cardinality(report_many.detail)),
                              ('cursor', cardinality(report_many.cursor))) AS a(name, length)
    LOOP
        IF coalesce(v_array.length, 0) NOT IN (0, v_n) THEN
            PERFORM pacerd._reject('report_many', format(
                '%s needs one element per report (%s) or none, got %s',
                v_array.name, v_n, v_array.length));
        END IF;
    END LOOP;
    IF v_n = 0 THEN
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
