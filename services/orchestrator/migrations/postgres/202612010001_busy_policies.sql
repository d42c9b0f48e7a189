-- Double-texting and asks between agents (docs/orchestrator.md, docs/comm.md).
-- `queued` = 1: the message was sent under the `enqueue` policy while a turn ran; it waits for
-- the next turn and is never claimed at a steer boundary.
-- `ask_chain`: for an ask's message, the JSON list of agents already answering an ask this one
-- serves (outermost first), ending with the asked persona; copied into the turn job so the
-- worker's `ask_agent` passes it on and a cycle is refused at once.
ALTER TABLE orch_messages ADD COLUMN queued BIGINT NOT NULL DEFAULT 0;
ALTER TABLE orch_messages ADD COLUMN ask_chain TEXT;
