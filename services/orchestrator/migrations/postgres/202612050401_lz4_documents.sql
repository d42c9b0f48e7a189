-- Documents over PostgreSQL's TOAST threshold (≈ 2 KB) are compressed with lz4 instead of the
-- default pglz: a turn's job carries its window (62 KB at 1,000 messages), whose compression
-- took 0.2–0.3 ms a row with pglz and 0.03–0.04 ms with lz4, at about the same size
-- (docs/orchestrator.md). Only values written from now on. A server built without lz4, or older
-- than PostgreSQL 14 (no per-column compression), keeps its default.
DO $$
BEGIN
    EXECUTE 'ALTER TABLE orch_turns ALTER COLUMN job SET COMPRESSION lz4';
    EXECUTE 'ALTER TABLE orch_messages ALTER COLUMN message SET COMPRESSION lz4';
EXCEPTION WHEN feature_not_supported OR syntax_error THEN
    RAISE NOTICE 'lz4 column compression is not available; documents keep the server default';
END
$$;
