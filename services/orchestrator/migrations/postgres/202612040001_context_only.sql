-- Context-only messages (docs/orchestrator.md, "Context-only messages"): `context` = 1 marks a
-- message a chat bridge passed on so that she knows what was said, without asking for an answer.
-- It is stored unclaimed and `queued` = 1 (never steered), is never part of a turn's batch, and
-- enters the answered transcript at once: every later turn's window shows it in seq order.
ALTER TABLE orch_messages ADD COLUMN context BIGINT NOT NULL DEFAULT 0;
