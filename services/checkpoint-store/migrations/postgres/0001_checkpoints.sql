-- Per-step snapshots (DESIGN §3). The id is `{agent_id}:{step}`; (agent_id, step) is unique and
-- serves `latest` and `list` (newest step first) as an index scan.
CREATE TABLE IF NOT EXISTS checkpoints (
    id         TEXT        PRIMARY KEY,
    agent_id   TEXT        NOT NULL,
    step       BIGINT      NOT NULL CHECK (step >= 0),
    state      JSONB       NOT NULL CHECK (jsonb_typeof(state) = 'object'),
    turn_id    TEXT,
    attempt    BIGINT,
    created_at TIMESTAMPTZ NOT NULL,
    updated_at TIMESTAMPTZ NOT NULL,
    CONSTRAINT checkpoints_owner_step UNIQUE (agent_id, step)
);

-- Fencing (DESIGN §5): the newest delivery attempt that wrote for a turn. Raised in the same
-- transaction as the checkpoint upsert, so an older attempt can never write after a newer one.
CREATE TABLE IF NOT EXISTS turn_attempts (
    turn_id     TEXT        PRIMARY KEY,
    max_attempt BIGINT      NOT NULL,
    updated_at  TIMESTAMPTZ NOT NULL
);
