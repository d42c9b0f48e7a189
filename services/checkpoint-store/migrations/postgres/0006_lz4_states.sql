-- States over PostgreSQL's TOAST threshold (≈ 2 KB: a turn's base, a full snapshot) are
-- compressed with lz4 instead of the default pglz: on a 62 KB base (a 1,000-message window) the
-- insert's compression took 0.2–0.3 ms with pglz and 0.03–0.04 ms with lz4, at about the same
-- size (docs/checkpoint-store.md, "Performance"). Only values written from now on; older ones
-- stay pglz and read as before. A server built without lz4, or older than PostgreSQL 14 (no
-- per-column compression), keeps its default: the statements run only where they can.
DO $$
BEGIN
    EXECUTE 'ALTER TABLE checkpoint_bases ALTER COLUMN state SET COMPRESSION lz4';
    EXECUTE 'ALTER TABLE checkpoints ALTER COLUMN state SET COMPRESSION lz4';
EXCEPTION WHEN feature_not_supported OR syntax_error THEN
    RAISE NOTICE 'lz4 column compression is not available; states keep the server default';
END
$$;
