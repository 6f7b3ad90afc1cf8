-- pacerd ledger, version 5: leadership by partition, and destinations that
-- cost nothing while idle.
--
-- Forward-only.
--
-- Partitions. Every destination hashes into one of a fixed number of
-- partitions (`partitions` in pacerd.settings, set by `pacerd migrate
-- --partitions`, default 64), so every instance agrees which partition a
-- destination is in; an instance leads partitions, not destinations, and
-- `pacerd.partitions` records who leads each one (for status).
--
-- Waking. `destinations.wake_at` is when a destination next needs its
-- leader: while it is active, a time in the past; when its leader parks it
-- (nothing due, nothing in flight, no new outcomes), the time its next job
-- becomes due, or NULL when nothing is scheduled. Whatever can give a parked
-- destination work lowers it: a job scheduled, revised or replayed (the
-- triggers below). (A paused destination with due work is never parked: it
-- stays in view, paused, until it is resumed.) The leader finds the
-- destinations to plan in one index scan of wake_at, and never polls an
-- idle one.
--
-- The race between parking and scheduling: the park locks the destination
-- row FOR UPDATE and reads the earliest scheduled job in a later statement
-- of its transaction; a schedule that does not lower wake_at takes the row
-- FOR KEY SHARE. So a job inserted before the park's lock is committed
-- before the park reads (the lock waits for it), and one inserted after
-- lowers wake_at once the park has committed.

INSERT INTO pacerd.settings (key, value) VALUES ('partitions', '64')
ON CONFLICT (key) DO NOTHING;

CREATE FUNCTION pacerd._partition_of(p_destination text, p_partitions integer)
RETURNS integer LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT ((hashtextextended(p_destination, 0) & 9223372036854775807)
            % greatest(p_partitions, 1))::integer
$$;

CREATE TABLE pacerd.partitions (
    partition    integer PRIMARY KEY,
    leader       text,
    leader_since timestamptz
);

-- The partition is stored with the destination when it is created (and
-- rewritten by `pacerd migrate --partitions`).
CREATE FUNCTION pacerd._partition() RETURNS integer
LANGUAGE sql STABLE SET search_path = pg_catalog, pacerd, pg_temp AS $$
    SELECT coalesce((SELECT (s.value #>> '{}')::integer FROM pacerd.settings s
                     WHERE s.key = 'partitions'), 64)
$$;

ALTER TABLE pacerd.destinations
    ADD COLUMN partition integer NOT NULL DEFAULT 0,
    ADD COLUMN wake_at timestamptz DEFAULT now();
UPDATE pacerd.destinations
SET partition = pacerd._partition_of(destination, pacerd._partition()), wake_at = now();
CREATE INDEX destinations_partition_idx ON pacerd.destinations (partition);

CREATE FUNCTION pacerd._place_destination() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pacerd, pg_temp AS $$
BEGIN
    NEW.partition := pacerd._partition_of(NEW.destination, pacerd._partition());
    RETURN NEW;
END
$$;
CREATE TRIGGER destinations_place BEFORE INSERT ON pacerd.destinations
    FOR EACH ROW EXECUTE FUNCTION pacerd._place_destination();
CREATE INDEX destinations_wake_idx ON pacerd.destinations (wake_at)
    WHERE wake_at IS NOT NULL;

-- The release slices' closed check reads only these (pacerd/sql/queries.sql,
-- closed_destinations).
CREATE INDEX destinations_paused_idx ON pacerd.destinations (destination) WHERE paused;
CREATE INDEX destinations_cooldown_idx ON pacerd.destinations (cooldown_until)
    WHERE cooldown_until IS NOT NULL;

CREATE FUNCTION pacerd._wake_for_job() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pacerd, pg_temp AS $$
BEGIN
    UPDATE pacerd.destinations d SET wake_at = NEW.next_attempt_at
    WHERE d.destination = NEW.destination
      AND (d.wake_at IS NULL OR d.wake_at > NEW.next_attempt_at);
    IF NOT FOUND THEN
        PERFORM 1 FROM pacerd.destinations d WHERE d.destination = NEW.destination
        FOR KEY SHARE;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_wake_on_insert AFTER INSERT ON pacerd.jobs
    FOR EACH ROW WHEN (NEW.state = 'scheduled')
    EXECUTE FUNCTION pacerd._wake_for_job();
-- A job in flight that returns to scheduled (a released claim, a reclaimed
-- lease, a retry) belongs to a destination that is not parked: parking
-- needs nothing in flight. Those updates do not fire, so no statement that
-- touches many destinations' jobs locks their rows here.
CREATE TRIGGER jobs_wake_on_update AFTER UPDATE OF state, next_attempt_at, destination
    ON pacerd.jobs
    FOR EACH ROW WHEN (NEW.state = 'scheduled' AND (
        OLD.state NOT IN ('claimed', 'offered')
        OR NEW.revision <> OLD.revision OR NEW.destination <> OLD.destination))
    EXECUTE FUNCTION pacerd._wake_for_job();

REVOKE ALL ON FUNCTION pacerd._partition_of, pacerd._partition,
    pacerd._place_destination, pacerd._wake_for_job FROM PUBLIC;
REVOKE ALL ON pacerd.partitions FROM PUBLIC;
