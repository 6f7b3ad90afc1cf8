-- pacerd ledger, version 6: the leaders hear at once that a destination
-- was paused, resumed or put in a cool-down.
--
-- Forward-only.
--
-- Every change of a destination's pause or cool-down, and of the global
-- pause, notifies the channel `pacerd_control` when it commits, with the
-- payload `open NAME` or `closed NAME` (`*` for every destination): what
-- the destination is now (a cool-down that has already run out is open).
-- Whatever makes the change (pacerd.pause and pacerd.resume, a report with a
-- Retry-After, an operator's UPDATE) notifies the same way, since the
-- triggers are on the tables. A leader reopens a resumed destination at once
-- instead of at its next tick, and stops a paused one at its next release.
-- The notices are a shortcut: the daemon reads the same state every tick
-- and polls it while it releases, so a notice nobody heard is only late.

CREATE FUNCTION pacerd._notify_control() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pacerd, pg_temp AS $$
BEGIN
    IF TG_TABLE_NAME = 'control' THEN
        PERFORM pg_notify('pacerd_control',
            CASE WHEN NEW.paused_all THEN 'closed *' ELSE 'open *' END);
    ELSE
        PERFORM pg_notify('pacerd_control',
            CASE WHEN NEW.paused OR coalesce(NEW.cooldown_until > now(), false)
                 THEN 'closed ' ELSE 'open ' END || NEW.destination);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER destinations_control_changed
AFTER UPDATE OF paused, cooldown_until ON pacerd.destinations
FOR EACH ROW
WHEN (OLD.paused IS DISTINCT FROM NEW.paused
      OR OLD.cooldown_until IS DISTINCT FROM NEW.cooldown_until)
EXECUTE FUNCTION pacerd._notify_control();

CREATE TRIGGER destinations_control_created
AFTER INSERT ON pacerd.destinations
FOR EACH ROW
WHEN (NEW.paused OR NEW.cooldown_until IS NOT NULL)
EXECUTE FUNCTION pacerd._notify_control();

CREATE TRIGGER control_changed
AFTER UPDATE OF paused_all ON pacerd.control
FOR EACH ROW
WHEN (OLD.paused_all IS DISTINCT FROM NEW.paused_all)
EXECUTE FUNCTION pacerd._notify_control();

-- Reached only as a trigger (see version 4: PUBLIC keeps no right).
REVOKE EXECUTE ON FUNCTION pacerd._notify_control() FROM PUBLIC;
