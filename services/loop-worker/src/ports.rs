//! What a turn needs from the outside world, as one trait, so the turn runner is plain logic:
//! production wires it to NATS ([`crate::nats::NatsPorts`]), unit tests to an in-memory fake.

use crate::documents::FetchedDocument;
use cyrene_protocol::ErrorBody;
use cyrene_protocol::checkpoint::Checkpoint;
use cyrene_protocol::memory::MemoryReadResponse;
use cyrene_protocol::message::ToolCall;
use cyrene_protocol::model::{ModelRequest, ModelResponse, ToolSpec};
use cyrene_protocol::session::SessionEvent;
use cyrene_protocol::turn::{SteerRequest, SteerResponse, SteeredMessage};
use futures::{FutureExt, Stream, StreamExt};
use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;

/// Who is calling a tool, for built-ins that act as the running agent.
#[derive(Debug, Clone)]
pub struct ToolContext {
    /// The answering persona: `ask_agent` and `emit_event` speak as this agent.
    pub agent_id: String,
    pub session_id: String,
    pub turn_id: String,
    /// The turn's tool allow-list (the job's `tools`): `None` = every tool; otherwise a call to
    /// a tool not listed is refused with an `is_error` result and never made.
    pub allowed: Option<Vec<String>>,
    /// The job's `ask_chain`: `ask_agent` sends it with the ask, so an ask back to an agent that
    /// is waiting on this turn is refused at once instead of stalling (docs/comm.md, "Cycles").
    pub ask_chain: Vec<String>,
}

/// A tool's outcome; failures are results too (`is_error`), never errors of the turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutput {
    pub text: String,
    pub is_error: bool,
    /// Images the tool returned (`data:image/…;base64,…` URIs, checked and bounded by the
    /// caller): they ride on the tool's message as image parts (docs/tools.md, "Results").
    pub images: Vec<String>,
    /// The request went out but no reply came within the tool's timeout (a slow tool, or a
    /// reply lost while the connection was down): the tool may or may not have run. The runner
    /// calls an idempotent tool again under the same id and reports any other tool's outcome as
    /// unknown (docs/reliability.md, "Tool calls in flight").
    pub unanswered: bool,
}

/// What may be done with a tool call that was started and whose result was lost, as the tool
/// declares it (`cyrene.tool.idempotent` endpoint metadata; docs/tools.md, "Semantics").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Idempotence {
    /// No effect outside its answer (the built-in `current_time`): running it again under any id
    /// changes nothing, so a batch of only such calls records no intent.
    ReadOnly,
    /// May run again under the same `Cyrene-Tool-Call-Id` (the tool de-duplicates by it, or
    /// repeating it does no harm).
    Idempotent,
    /// Never run again by itself; also every tool that declares nothing.
    NotIdempotent,
}

impl ToolOutput {
    pub fn ok(text: impl Into<String>) -> ToolOutput {
        ToolOutput {
            text: text.into(),
            is_error: false,
            images: Vec::new(),
            unanswered: false,
        }
    }

    pub fn error(text: impl Into<String>) -> ToolOutput {
        ToolOutput {
            text: text.into(),
            is_error: true,
            images: Vec::new(),
            unanswered: false,
        }
    }
}

/// The messages the orchestrator pushes to one running turn (claimed for it before they are
/// pushed), buffered until the turn's next boundary takes them. Dropping it unsubscribes.
pub struct TurnInput {
    // In a mutex only to be `Sync` (the runner is shared across awaits); `take` has `&mut self`
    // and never locks.
    stream: Option<Mutex<Pin<Box<dyn Stream<Item = SteeredMessage> + Send>>>>,
}

impl std::fmt::Debug for TurnInput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TurnInput")
            .field("live", &self.is_live())
            .finish()
    }
}

impl TurnInput {
    /// Input arriving on `stream`.
    pub fn new(stream: impl Stream<Item = SteeredMessage> + Send + 'static) -> TurnInput {
        TurnInput {
            stream: Some(Mutex::new(Box::pin(stream))),
        }
    }

    /// No pushed input (the subscription failed): every boundary asks `cyrene.turn.steer`.
    pub fn none() -> TurnInput {
        TurnInput { stream: None }
    }

    /// Whether pushes can arrive.
    pub fn is_live(&self) -> bool {
        self.stream.is_some()
    }

    /// Everything received since the last call, without waiting.
    pub fn take(&mut self) -> Vec<SteeredMessage> {
        let mut out = Vec::new();
        while let Some(stream) = self.stream.as_mut() {
            let stream = stream
                .get_mut()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            match stream.next().now_or_never() {
                Some(Some(message)) => out.push(message),
                Some(None) => self.stream = None,
                None => break,
            }
        }
        out
    }
}

/// The runner's view of the bus. Every method is bounded by its implementation's timeouts.
pub trait TurnPorts: Send + Sync {
    /// The most recently written checkpoint of `turn_id` under `owner`, read fenced as delivery
    /// `attempt`: `Ok(None)` when the turn has none; `conflict` when a newer attempt of the turn
    /// has already read or written (this one is stale). After it returns, no older attempt can
    /// save.
    fn turn_checkpoint(
        &self,
        owner: &str,
        turn_id: &str,
        attempt: u32,
    ) -> impl Future<Output = Result<Option<Checkpoint>, ErrorBody>> + Send;

    /// Saves one checkpoint; `conflict` means a newer attempt of the turn has written.
    fn save_checkpoint(
        &self,
        checkpoint: Checkpoint,
    ) -> impl Future<Output = Result<(), ErrorBody>> + Send;

    /// Subscribes to what the orchestrator pushes to `turn_id` (`cyrene.turn.input.<turn_id>`).
    /// Called before the delivery's first steer, so nothing claimed after that steer's read can
    /// miss the subscription.
    fn turn_input(&self, turn_id: &str) -> impl Future<Output = TurnInput> + Send;

    /// Claims and returns steered messages; `conflict` means this attempt is fenced off.
    fn steer(
        &self,
        request: SteerRequest,
    ) -> impl Future<Output = Result<SteerResponse, ErrorBody>> + Send;

    /// Whether the model that answers `persona_id` takes images itself (the first step of its
    /// chain, `cyrene.model.route`).
    fn main_model_vision(
        &self,
        persona_id: &str,
    ) -> impl Future<Output = Result<bool, ErrorBody>> + Send;

    /// One model call through the gateway.
    fn complete(
        &self,
        request: ModelRequest,
    ) -> impl Future<Output = Result<ModelResponse, ErrorBody>> + Send;

    /// One model call whose answer text is published as `delta` events tagged `tag` while it is
    /// produced (docs/loop-worker.md, "Deltas"), continuing the turn's held `view` where a
    /// replica holds it (crate::deltas); the response is the one [`TurnPorts::complete`] gives.
    /// The default publishes nothing and sends every view whole.
    fn complete_streamed(
        &self,
        mut request: ModelRequest,
        tag: crate::deltas::DeltaTag,
        view: &mut crate::deltas::SentView,
    ) -> impl Future<Output = Result<ModelResponse, ErrorBody>> + Send {
        let _ = tag;
        view.whole(&mut request);
        self.complete(request)
    }

    /// The tools offered to the model: every built-in and discovered tool, only those in
    /// `allowed` when there is a list.
    fn tool_specs(&self, allowed: Option<&[String]>) -> Vec<ToolSpec>;

    /// How `name` may be run again when a started call's result was lost; the default (and any
    /// tool that declares nothing) is [`Idempotence::NotIdempotent`].
    fn tool_idempotence(&self, _name: &str) -> Idempotence {
        Idempotence::NotIdempotent
    }

    /// Whether the tool itself asks for a person's approval of every call (its metadata
    /// `cyrene.tool.approval` = `required`); the default is no.
    fn tool_approval(&self, _name: &str) -> bool {
        false
    }

    /// Runs one tool call (never fails: a failure is an `is_error` output). A call outside
    /// `context.allowed` or to a tool neither built in nor discovered is refused with an
    /// `is_error` output without being made.
    fn call_tool(
        &self,
        context: &ToolContext,
        call: &ToolCall,
    ) -> impl Future<Output = ToolOutput> + Send;

    /// A stored document of `session_id`, read from the document service by its server-issued
    /// `cyrene-doc://` reference (docs/documents.md); `forbidden` for another session's
    /// document. Never fetches any other URL. The default has no document service.
    fn document(
        &self,
        _session_id: &str,
        _url: &str,
    ) -> impl Future<Output = Result<FetchedDocument, ErrorBody>> + Send {
        async {
            Err(ErrorBody::new(
                cyrene_protocol::ErrorCode::NotFound,
                "no document service",
            ))
        }
    }

    /// Records that stored document `name` is about to be extracted (crate::extractions):
    /// [`Start::Poison`](crate::extractions::Start::Poison) when earlier extractions of it never
    /// ended, and it must not be tried again. The default records nothing.
    fn extraction_start(
        &self,
        _name: &str,
    ) -> impl Future<Output = crate::extractions::Start> + Send {
        async { crate::extractions::Start::Go }
    }

    /// Records that the extraction of `name` ended. The default records nothing.
    fn extraction_end(&self, _name: &str) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// The persona's memory for a session (`cyrene.memory.read`, docs/memory.md). The default
    /// has no memory.
    fn memory(
        &self,
        _persona_id: &str,
        _session_id: &str,
    ) -> impl Future<Output = Result<MemoryReadResponse, ErrorBody>> + Send {
        async { Ok(MemoryReadResponse::default()) }
    }

    /// Sends one guard request (`payload`, a JSON [`cyrene_protocol::guard::GuardRequest`]) to
    /// `subject` and returns the reply's bytes, waiting at most `timeout` (docs/loop-worker.md,
    /// "Guardrails"). Nobody listening, no reply in time and an error envelope are errors; the
    /// caller decides what the bytes mean. The default has no guard service.
    fn guard(
        &self,
        _subject: &str,
        _payload: Vec<u8>,
        _timeout: std::time::Duration,
    ) -> impl Future<Output = Result<Vec<u8>, ErrorBody>> + Send {
        async {
            Err(ErrorBody::new(
                cyrene_protocol::ErrorCode::Unavailable,
                "no guard service",
            ))
        }
    }

    /// Publishes a live session event (fire and forget).
    fn publish(&self, event: SessionEvent) -> impl Future<Output = ()> + Send;
}
