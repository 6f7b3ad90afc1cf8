-- Run once by the postgres image on an empty data directory (as the superuser
-- POSTGRES_USER): the roles of the compose stack, each with the least it needs.
-- `pacerd migrate` finds the three NOLOGIN roles here and grants them their
-- functions (docs/security.md). The passwords are for this local stack only.

-- The owner: runs `pacerd migrate` and `pacerd run`; owns the database, not a superuser.
CREATE ROLE pacerd LOGIN PASSWORD 'pacerd' NOSUPERUSER NOCREATEDB NOCREATEROLE;
CREATE DATABASE pacerd OWNER pacerd;

-- The roles `pacerd migrate` grants (it creates them too; here so that the
-- logins below can be their members before the first migrate).
DO $roles$
DECLARE
    role text;
BEGIN
    FOREACH role IN ARRAY ARRAY['pacerd_producer', 'pacerd_worker', 'pacerd_operator'] LOOP
        IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = role) THEN
            EXECUTE format('CREATE ROLE %I NOLOGIN', role);
        END IF;
    END LOOP;
END
$roles$;

-- The demo workers (`is_current`, `report`) and the producer (`schedule`, `cancel`).
CREATE ROLE demo_worker LOGIN PASSWORD 'demo_worker' IN ROLE pacerd_worker;
CREATE ROLE demo_producer LOGIN PASSWORD 'demo_producer' IN ROLE pacerd_producer;
