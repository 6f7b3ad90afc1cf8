-- pacerd ledger, version 2: set-based application of a batch of outcome reports.
--
-- Forward-only, additive. pacerd.report is unchanged and stays the contract
-- (docs/protocol.md, "SQL API"); pacerd.report_many gives a batch exactly the results
-- and effects that calling pacerd.report on each report, in order, in one
-- transaction, would give — with the common case done in a few set-based
-- statements instead of five statements per report, and the destination's
-- counters row (a hot row) updated once per destination instead of once per
-- report.
--
-- The fast path takes the reports that are certainly applied as 'ok': a valid
-- report (what pacerd.report would not reject) with outcome 'ok', whose job is
-- named by no other report of the batch (so the order of reports on one job
-- cannot matter), and whose job is at that attempt, claimed or offered, with
-- its lease not expired (checked by the UPDATE itself, on the row it locks).
-- Every other report — another outcome, stale, unknown, invalid, or a job
-- named twice — then goes through pacerd.report itself, in batch order. The
-- two paths touch disjoint jobs, and what they add to a destination's
-- counters commutes (sums; the epoch is not changed by reports), so the
-- result equals the sequential one. An invalid report raises exactly as
-- pacerd.report does (22023), undoing the whole call.

CREATE FUNCTION pacerd.report_many(
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
