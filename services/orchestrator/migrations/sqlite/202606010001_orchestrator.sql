-- The orchestrator's tables (DESIGN §6). Prefixed `orch_` and versioned far from other services'
-- migrations, so the orchestrator can share one database with them.
-- Timestamps are unix milliseconds; JSON documents are stored as text (one code path for both
-- backends). Flags are 0/1 integers.

-- One row per session; `last_seq` is the last per-session sequence number handed out. Every
-- write runs in a `BEGIN IMMEDIATE` transaction (SQLite serialises writers): that is the fence.
CREATE TABLE IF NOT EXISTS orch_sessions (
    id         TEXT   PRIMARY KEY,
    env        TEXT   NOT NULL,
    last_seq   INTEGER NOT NULL DEFAULT 0,
    created_at INTEGER NOT NULL
);

-- The transcript: user messages (durable before the ack) and assistant answers, one seq each.
-- `claimed_by_turn` NULL = pending (a user message no turn has consumed yet); `steered` = 1 when
-- it was claimed at a steer boundary rather than by the job that started the turn.
CREATE TABLE IF NOT EXISTS orch_messages (
    id              TEXT   PRIMARY KEY,
    session_id      TEXT   NOT NULL REFERENCES orch_sessions (id),
    seq            INTEGER NOT NULL,
    client_id       TEXT   NOT NULL DEFAULT '',
    idempotency_key TEXT,
    role            TEXT   NOT NULL,
    message         TEXT   NOT NULL,
    claimed_by_turn TEXT,
    steered        INTEGER NOT NULL DEFAULT 0,
    solo           INTEGER NOT NULL DEFAULT 0,
    reply_to        TEXT,
    ack             TEXT,
    created_at     INTEGER NOT NULL,
    CONSTRAINT orch_messages_seq UNIQUE (session_id, seq),
    CONSTRAINT orch_messages_key UNIQUE (session_id, idempotency_key)
);
CREATE INDEX IF NOT EXISTS orch_messages_claim ON orch_messages (session_id, claimed_by_turn, seq);
CREATE INDEX IF NOT EXISTS orch_messages_turn ON orch_messages (claimed_by_turn, seq);

-- One row per turn. `attempt` is the newest delivery attempt seen (fencing); `job` is the exact
-- TurnJob published, so a re-dispatch publishes the same bytes.
CREATE TABLE IF NOT EXISTS orch_turns (
    turn_id          TEXT   PRIMARY KEY,
    session_id       TEXT   NOT NULL REFERENCES orch_sessions (id),
    leg_id           TEXT   NOT NULL DEFAULT '',
    client_id        TEXT   NOT NULL DEFAULT '',
    status           TEXT   NOT NULL CHECK (status IN ('running', 'completed')),
    attempt         INTEGER NOT NULL DEFAULT 0,
    base_seq        INTEGER NOT NULL,
    first_message_id TEXT   NOT NULL,
    job              TEXT   NOT NULL,
    dispatched      INTEGER NOT NULL DEFAULT 0,
    outcome          TEXT,
    created_at      INTEGER NOT NULL,
    updated_at      INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS orch_turns_session ON orch_turns (session_id, status);
CREATE INDEX IF NOT EXISTS orch_turns_undispatched ON orch_turns (dispatched, status);
