-- Several personas in one session (docs/orchestrator.md, "Several personas").
-- `persona`: the persona a turn runs as (its job's `env.persona`). A message sent while a turn
-- runs is steered into it only when it addresses that persona; otherwise it is `queued` for the
-- next turn, which runs as the persona the session last used. Empty for turns written before.
ALTER TABLE orch_turns ADD COLUMN persona TEXT NOT NULL DEFAULT '';
