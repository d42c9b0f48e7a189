//! A step's model request (docs/semantics.md, "View order"; docs/loop-worker.md, "What a worker
//! does with it"). Owns [`ViewState`]: what the view is built from besides the window and the
//! steered messages (context blocks, speakers and names, images, documents), and the view a
//! gateway replica holds for this turn (crate::deltas).
//!
//! # Invariants
//! - **Window vs view.** The view is rebuilt at every step from the window, the steered messages,
//!   the blocks and the notice; nothing here is ever checkpointed.
//! - **The time block is stamped once per attempt**, so every step shows the same block and a
//!   provider's prompt cache keeps matching the prefix.
//! - **Each document is read once per turn** and images are described once per turn
//!   (crate::documents, crate::images); a document service that stays unreachable hands the
//!   job back ([`Exit::Retry`]), never answers with "could not extract".
//! - **A held view is only extended** when the new view provably appends to it and holds no more
//!   images than a request keeps ([`images::MAX_VIEW_IMAGES`]: past it the whole view shows an
//!   older image as omitted where the held one has it); otherwise the whole view is sent
//!   (crate::deltas).

use super::{Exit, RunnerConfig, Turn};
use crate::assemble::{self, ContextBlocks, ViewInputs};
use crate::attribution::{PersonaNames, SpeakerEnv};
use crate::deltas::SentView;
use crate::documents::DocumentTexts;
use crate::images::{self, ImageResolver};
use crate::memory;
use crate::ports::TurnPorts;
use cyrene_protocol::message::{Message, Part, Role};
use cyrene_protocol::model::{ModelRequest, ModelResponse};
use cyrene_protocol::turn::TurnJob;

/// What a turn's views are built from besides its window and steered messages.
pub(super) struct ViewState {
    blocks: ContextBlocks,
    speakers: SpeakerEnv,
    names: PersonaNames,
    /// The main model's vision and the image descriptions made so far in this turn.
    images: ImageResolver,
    /// Document URL → its text in the view, so each document is read once per turn.
    documents: DocumentTexts,
    /// The view the steps' model calls sent, held by a gateway replica (crate::deltas).
    pub sent: SentView,
}

impl ViewState {
    /// The view state of `job` at the start of an attempt (memory blocks still empty).
    pub fn new(job: &TurnJob) -> ViewState {
        let mut names = PersonaNames::new();
        for (id, name) in &job.persona_names {
            names.insert(id.clone(), name.clone());
        }
        ViewState {
            blocks: ContextBlocks {
                instructions: job.instructions.clone(),
                // Stamped once per attempt: every step of it shows the same block, so a
                // provider's prompt cache keeps matching the prefix.
                time: assemble::time_block(chrono::Utc::now()),
                ..Default::default()
            },
            speakers: SpeakerEnv::new(job.env.restricted, job.env.persona.clone()),
            names,
            images: ImageResolver::default(),
            documents: DocumentTexts::default(),
            sent: SentView::default(),
        }
    }
}

impl<P: TurnPorts> Turn<'_, P> {
    fn view_inputs(&self) -> ViewInputs<'_> {
        let view = &self.view;
        ViewInputs {
            blocks: &view.blocks,
            window: &self.window,
            speakers: &view.speakers,
            names: &view.names,
            steered: &self.steering.steered,
            notice: self.job.notice.as_ref(),
        }
    }

    /// The request of the whole view.
    pub(super) fn request(&self, config: &RunnerConfig) -> ModelRequest {
        let view = assemble::assemble_view(&self.view_inputs(), &self.view.documents);
        self.request_of(view, config)
    }

    /// A step's request: only what its view appends to the view a gateway replica holds when it
    /// is such an extension, else the whole view; staged on the held view (crate::deltas).
    pub(super) fn step_request(&mut self, config: &RunnerConfig) -> ModelRequest {
        let inputs = self.view_inputs();
        let documents = &self.view.documents;
        // A request keeps only its newest images: past that limit the whole view shows an
        // older image as omitted where the held view still has it, so it goes whole.
        let extended = self
            .view
            .sent
            .shape()
            .and_then(|shape| assemble::extend_view(&inputs, documents, shape))
            .filter(|(_, shape)| shape.images() <= images::MAX_VIEW_IMAGES);
        let (messages, shape, added) = match extended {
            Some((added, shape)) => (added, shape, true),
            None => {
                let (whole, shape) = assemble::assemble_shaped(&inputs, documents);
                (whole, shape, false)
            }
        };
        self.view.sent.stage(shape, added);
        self.request_of(messages, config)
    }

    fn request_of(&self, messages: Vec<Message>, config: &RunnerConfig) -> ModelRequest {
        ModelRequest {
            messages,
            purpose: config.purpose.clone(),
            persona_id: self.job.env.persona.clone(),
            tools: self.ports.tool_specs(self.job.tools.as_deref()),
            ..Default::default()
        }
    }

    /// Fills the working-memory and memory blocks from the persona's memory (docs/memory.md);
    /// when memory cannot be read the blocks stay empty and the turn goes on.
    pub(super) async fn load_memory(&mut self) {
        let persona = &self.job.env.persona;
        match self.ports.memory(persona, &self.job.session_id).await {
            Ok(read) => {
                let blocks = &mut self.view.blocks;
                blocks.working_memory =
                    memory::block(memory::WORKING_MEMORY_HEADER, &read.working_memory);
                blocks.memory = memory::block(memory::MEMORY_HEADER, &read.memory);
            }
            Err(err) => {
                tracing::warn!(turn = %self.job.turn_id, error = %err, "memory unavailable; the turn goes on without it");
            }
        }
    }

    /// Reads and extracts every document of the window and the steered messages not read yet
    /// this turn (docs/loop-worker.md, "Documents"). A document service that stays unreachable
    /// is a retryable exit: the job is handed back, never answered with "could not extract".
    pub(super) async fn resolve_documents(&mut self) -> Result<(), Exit> {
        let messages = self
            .window
            .iter()
            .chain(self.steering.steered.iter().map(|s| &s.message));
        self.view
            .documents
            .fill(self.ports, &self.job.session_id, messages)
            .await
            .map_err(Exit::Retry)
    }

    /// The view's images, described for a main model without vision (crate::images).
    pub(super) async fn resolve_images(&mut self, request: ModelRequest) -> ModelRequest {
        self.view
            .images
            .resolve(self.ports, &self.job.env.persona, request)
            .await
    }

    /// The assistant message of a reply, labelled with the answering persona (its lane), and
    /// holding its tool calls even if the gateway put them only in `tool_calls`.
    pub(super) fn assistant_message(&self, response: &ModelResponse) -> Message {
        let mut message = response.message.clone();
        message.role = Role::Assistant;
        let has_calls = message
            .content
            .iter()
            .any(|p| matches!(p, Part::ToolCall { .. }));
        if !response.tool_calls.is_empty() && !has_calls {
            let calls = Message::assistant_tool_calls(&response.tool_calls);
            message.content.extend(calls.content);
        }
        if message.content.is_empty() && !response.content.is_empty() {
            message.content.push(Part::text(response.content.clone()));
        }
        message.sender_name = self.job.env.persona.clone();
        message
    }
}
