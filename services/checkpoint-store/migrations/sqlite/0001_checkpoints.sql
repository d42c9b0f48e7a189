-- Per-step snapshots (DESIGN §3). The id is `{agent_id}:{step}`; (agent_id, step) is unique and
-- serves `latest` and `list` (newest step first) as an index scan. Timestamps are RFC 3339 text
-- with exactly six fraction digits and a `Z`, so text order is time order.
CREATE TABLE IF NOT EXISTS checkpoints (
    id         TEXT    PRIMARY KEY NOT NULL,
    agent_id   TEXT    NOT NULL,
    step       INTEGER NOT NULL CHECK (step >= 0),
    state      TEXT    NOT NULL CHECK (json_valid(state) AND json_type(state) = 'object'),
    turn_id    TEXT,
    attempt    INTEGER,
    created_at TEXT    NOT NULL,
    updated_at TEXT    NOT NULL,
    CONSTRAINT checkpoints_owner_step UNIQUE (agent_id, step)
);

-- Fencing (DESIGN §5): the newest delivery attempt that wrote for a turn. Raised in the same
-- transaction as the checkpoint upsert, so an older attempt can never write after a newer one.
CREATE TABLE IF NOT EXISTS turn_attempts (
    turn_id     TEXT    PRIMARY KEY NOT NULL,
    max_attempt INTEGER NOT NULL,
    updated_at  TEXT    NOT NULL
);
