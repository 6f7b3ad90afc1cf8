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
