-- Human approval of tool calls (docs/orchestrator.md, "Approvals").
-- `awaiting_since`: set while a running turn waits for decisions (its job ended; no worker holds
-- it); NULL otherwise. `resumes`: how many times the turn was dispatched again after its calls
-- were decided (its job's `Nats-Msg-Id` is `<turn_id>.<resumes>` from the first on).
ALTER TABLE orch_turns ADD COLUMN awaiting_since BIGINT;
ALTER TABLE orch_turns ADD COLUMN resumes BIGINT NOT NULL DEFAULT 0;

-- One row per call that asked for approval; the first decision holds (`decision` goes from NULL
-- to 'approve' or 'deny' once). `step` is the step of the call's tool batch: a decision binds to
-- it. `arguments` is the call's JSON object as text.
CREATE TABLE IF NOT EXISTS orch_approvals (
    turn_id      TEXT   NOT NULL,
    call_id      TEXT   NOT NULL,
    session_id   TEXT   NOT NULL REFERENCES orch_sessions (id),
    step         BIGINT NOT NULL,
    tool         TEXT   NOT NULL,
    arguments    TEXT   NOT NULL,
    persona      TEXT   NOT NULL DEFAULT '',
    requested_at BIGINT NOT NULL,
    deadline     BIGINT NOT NULL,
    decision     TEXT   CHECK (decision IN ('approve', 'deny')),
    reason       TEXT,
    decided_by   TEXT,
    decided_at   BIGINT,
    PRIMARY KEY (turn_id, call_id)
);
CREATE INDEX IF NOT EXISTS orch_approvals_session ON orch_approvals (session_id, call_id);
CREATE INDEX IF NOT EXISTS orch_approvals_deadline ON orch_approvals (decision, deadline);
