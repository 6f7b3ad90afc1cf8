-- pacerd ledger, version 4: the public SQL API runs with its owner's rights.
--
-- Forward-only. Every public function becomes SECURITY DEFINER with a fixed
-- search_path (pg_catalog first, pg_temp last: the pattern PostgreSQL
-- documents for definer functions), so a caller needs EXECUTE on a function
-- and nothing on the tables, and nothing the caller creates or puts in its own
-- search_path (a function, an operator, a temporary table) is reached from
-- inside. PUBLIC keeps no right on anything in the schema: `pacerd migrate`
-- then grants each role (producer, worker, operator) exactly its functions,
-- with names from its command line (see `pacerd migrate --print-grants`).
--
-- CREATE OR REPLACE FUNCTION keeps a function's owner and grants but resets
-- every other property to what the command says: a later migration that
-- replaces one of these functions must restate
-- `SECURITY DEFINER SET search_path = pg_catalog, pacerd, pg_temp`.
-- (`pacerd migrate` re-asserts both after every run, as a safety net.)

ALTER FUNCTION pacerd.schedule SECURITY DEFINER SET search_path = pg_catalog, pacerd, pg_temp;
ALTER FUNCTION pacerd.report SECURITY DEFINER SET search_path = pg_catalog, pacerd, pg_temp;
ALTER FUNCTION pacerd.report_many SECURITY DEFINER SET search_path = pg_catalog, pacerd, pg_temp;
ALTER FUNCTION pacerd.cancel SECURITY DEFINER SET search_path = pg_catalog, pacerd, pg_temp;
ALTER FUNCTION pacerd.replay SECURITY DEFINER SET search_path = pg_catalog, pacerd, pg_temp;
ALTER FUNCTION pacerd.is_current SECURITY DEFINER SET search_path = pg_catalog, pacerd, pg_temp;
ALTER FUNCTION pacerd.pause SECURITY DEFINER SET search_path = pg_catalog, pacerd, pg_temp;
ALTER FUNCTION pacerd.resume SECURITY DEFINER SET search_path = pg_catalog, pacerd, pg_temp;

-- Internal helpers (pacerd._*) are reached only from inside the functions
-- above, which already run as the owner on the fixed path.
REVOKE ALL ON SCHEMA pacerd FROM PUBLIC;
REVOKE ALL ON ALL TABLES IN SCHEMA pacerd FROM PUBLIC;
REVOKE ALL ON ALL SEQUENCES IN SCHEMA pacerd FROM PUBLIC;
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA pacerd FROM PUBLIC;

-- Bad input stays harmless. A job id becomes the AMQP message id
-- (`<job_id>:<attempt>`) and correlation id, short strings of at most 255
-- bytes: an id too long for them could be scheduled but never published. Ids
-- and kinds also reach logs and operators' terminals: no control characters
-- (C0, DEL, C1). Checked on insert only, so rows written before stay
-- claimable; a revision of a job tries an insert first, so it is checked too.
-- (Destinations already have their pattern, in pacerd.schedule and pause.)
CREATE FUNCTION pacerd._check_new_job() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pacerd, pg_temp AS $$
BEGIN
    IF octet_length(NEW.job_id) > 200 THEN
        PERFORM pacerd._reject('schedule', format(
            'job_id must be at most 200 bytes (it becomes the message id), got %s bytes',
            octet_length(NEW.job_id)));
    END IF;
    IF NEW.job_id ~ '[\x01-\x1f\x7f-\x9f]' THEN
        PERFORM pacerd._reject('schedule', 'job_id must not contain control characters');
    END IF;
    IF octet_length(NEW.kind) > 200 THEN
        PERFORM pacerd._reject('schedule', format(
            'kind must be at most 200 bytes, got %s bytes', octet_length(NEW.kind)));
    END IF;
    IF NEW.kind ~ '[\x01-\x1f\x7f-\x9f]' THEN
        PERFORM pacerd._reject('schedule', 'kind must not contain control characters');
    END IF;
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION pacerd._check_new_job() FROM PUBLIC;

-- The WHEN clause keeps the common case (a valid row) free of a PL/pgSQL call.
CREATE TRIGGER jobs_check_new BEFORE INSERT ON pacerd.jobs FOR EACH ROW
WHEN (octet_length(NEW.job_id) > 200 OR NEW.job_id ~ '[\x01-\x1f\x7f-\x9f]'
      OR octet_length(NEW.kind) > 200 OR NEW.kind ~ '[\x01-\x1f\x7f-\x9f]')
EXECUTE FUNCTION pacerd._check_new_job();
