//! [`TurnPorts`] over NATS: the gateway, the checkpoint store, the orchestrator, the tools.

use crate::deltas::{DeltaTag, SentView};
use crate::documents::MAX_FETCH_BYTES;
use crate::ports::{FetchedDocument, Idempotence, ToolContext, ToolOutput, TurnInput, TurnPorts};
use crate::tools::Tools;
use async_nats::Client;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use cyrene_bus::request_json;
use cyrene_checkpoint_client::{CheckpointClient, Error as CheckpointError};
use cyrene_model_client::StreamInbox;
use cyrene_protocol::checkpoint::Checkpoint;
use cyrene_protocol::document::{self, ReadRequest, ReadResponse};
use cyrene_protocol::memory::{self, MemoryReadRequest, MemoryReadResponse};
use cyrene_protocol::message::ToolCall;
use cyrene_protocol::model::{ModelRequest, ModelResponse, RouteRequest, RouteResponse, ToolSpec};
use cyrene_protocol::session::SessionEvent;
use cyrene_protocol::stream::{Delta, DeltaKinds};
use cyrene_protocol::turn::{SteerRequest, SteerResponse, SteeredMessage};
use cyrene_protocol::{ErrorBody, ErrorCode, subjects};
use futures::StreamExt;
use std::time::Duration;

/// Timeouts of the worker's requests.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    pub model: Duration,
    pub checkpoint: Duration,
    pub steer: Duration,
}

/// The production ports.
#[derive(Debug, Clone)]
pub struct NatsPorts {
    client: Client,
    checkpoints: CheckpointClient,
    /// Every streamed model call's replies arrive on this one subscription (no SUB/UNSUB a call).
    streams: std::sync::Arc<StreamInbox>,
    tools: Tools,
    timeouts: Timeouts,
    /// The record of PDF extractions in progress (the poison-document rule); `None` records
    /// nothing.
    extractions: Option<crate::extractions::Extractions>,
}

impl NatsPorts {
    pub fn new(client: Client, tools: Tools, timeouts: Timeouts) -> NatsPorts {
        let checkpoints = CheckpointClient::new(client.clone(), timeouts.checkpoint);
        NatsPorts {
            streams: std::sync::Arc::new(
                StreamInbox::new(client.clone()).with_heartbeat(GATEWAY_HEARTBEAT),
            ),
            client,
            checkpoints,
            tools,
            timeouts,
            extractions: None,
        }
    }

    /// These ports with PDF extractions recorded in `extractions`.
    pub fn with_extractions(mut self, extractions: crate::extractions::Extractions) -> NatsPorts {
        self.extractions = Some(extractions);
        self
    }

    /// One short request to another service (steer, route, document chunk, memory), bounded by
    /// the worker's control-request timeout; a failure is the error body the turn reports.
    async fn ask<Req: serde::Serialize, Resp: serde::de::DeserializeOwned>(
        &self,
        subject: &str,
        request: &Req,
    ) -> Result<Resp, ErrorBody> {
        request_json(&self.client, subject, request, self.timeouts.steer)
            .await
            .map_err(|e| e.to_body())
    }
}

/// A failed model call as the turn sees it: no gateway on the bus (`internal` from the bus) is a
/// passing outage, `unavailable` (retried), not a bad request.
fn model_error(err: cyrene_bus::RequestError) -> ErrorBody {
    let body = err.to_body();
    if body.code == ErrorCode::Internal {
        ErrorBody::new(ErrorCode::Unavailable, body.message)
    } else {
        body
    }
}

/// The heartbeat a streamed model call asks of the gateway; [`cyrene_model_client`] gives
/// up on a replica silent for five of them (one second).
pub const GATEWAY_HEARTBEAT: Duration = Duration::from_millis(200);

/// How many times one step's streamed call is sent again after the replica serving it went
/// silent mid-call; then the failure is the step's (`unavailable`, the job is redelivered).
pub const GATEWAY_RETRIES: u32 = 2;

fn gateway_vanished(tag: &DeltaTag, err: &cyrene_bus::RequestError) {
    tracing::warn!(turn = %tag.turn_id, step = tag.step, error = %err,
        "the gateway replica serving the step's model call went silent; asking another");
    metrics::counter!("cyrene_model_call_retries_total", "why" => "gateway_vanished").increment(1);
}

fn checkpoint_error(err: CheckpointError) -> ErrorBody {
    ErrorBody::new(err.code(), err.to_string())
}

impl TurnPorts for NatsPorts {
    async fn turn_checkpoint(
        &self,
        owner: &str,
        turn_id: &str,
        attempt: u32,
    ) -> Result<Option<Checkpoint>, ErrorBody> {
        let read = self
            .checkpoints
            .latest_of_turn(owner, turn_id, Some(attempt));
        match read.await {
            Ok(checkpoint) => Ok(Some(checkpoint)),
            Err(CheckpointError::NotFound(_)) => Ok(None),
            Err(err) => Err(checkpoint_error(err)),
        }
    }

    async fn save_checkpoint(&self, checkpoint: Checkpoint) -> Result<(), ErrorBody> {
        self.checkpoints
            .save(&checkpoint)
            .await
            .map(|_| ())
            .map_err(checkpoint_error)
    }

    async fn turn_input(&self, turn_id: &str) -> TurnInput {
        let subscribed = match subjects::turn_input(turn_id) {
            Ok(subject) => self
                .client
                .subscribe(subject)
                .await
                .map_err(|e| e.to_string()),
            Err(err) => Err(err.to_string()),
        };
        match subscribed {
            Ok(subscriber) => TurnInput::new(subscriber.filter_map(|message| async move {
                match serde_json::from_slice::<SteeredMessage>(&message.payload) {
                    Ok(steered) => {
                        metrics::counter!("cyrene_steer_pushed_messages_total").increment(1);
                        Some(steered)
                    }
                    Err(err) => {
                        tracing::warn!(error = %err, "undecodable push on a turn's input dropped");
                        None
                    }
                }
            })),
            Err(err) => {
                tracing::warn!(turn = %turn_id, error = %err,
                    "cannot subscribe to the turn's input; asking at every boundary");
                TurnInput::none()
            }
        }
    }

    async fn steer(&self, request: SteerRequest) -> Result<SteerResponse, ErrorBody> {
        let response: SteerResponse = self.ask(subjects::TURN_STEER, &request).await?;
        metrics::counter!("cyrene_steer_claims_total").increment(1);
        metrics::counter!("cyrene_steered_messages_total")
            .increment(response.messages.len() as u64);
        Ok(response)
    }

    async fn main_model_vision(&self, persona_id: &str) -> Result<bool, ErrorBody> {
        let request = RouteRequest {
            persona_id: persona_id.to_owned(),
            ..Default::default()
        };
        let route: RouteResponse = self.ask(subjects::MODEL_ROUTE, &request).await?;
        Ok(route.main_has_vision())
    }

    async fn complete(&self, mut request: ModelRequest) -> Result<ModelResponse, ErrorBody> {
        let timeout = self.timeouts.model;
        // The worker's model timeout bounds the whole fallback chain (each HTTP call keeps the
        // provider's own timeout); the gateway gets it in the request, and this waits a little
        // longer for its answer.
        request
            .total_timeout_ms
            .get_or_insert(timeout.as_millis() as u64);
        let wait = timeout + Duration::from_secs(1);
        cyrene_model_client::complete(&self.client, &request, wait)
            .await
            .map_err(model_error)
    }

    async fn complete_streamed(
        &self,
        mut request: ModelRequest,
        tag: DeltaTag,
        view: &mut SentView,
    ) -> Result<ModelResponse, ErrorBody> {
        let timeout = self.timeouts.model;
        request
            .total_timeout_ms
            .get_or_insert(timeout.as_millis() as u64);
        let deadline = tokio::time::Instant::now() + timeout + Duration::from_secs(1);
        // The gateway's deltas go through a channel to a publisher running beside the call, so
        // a slow publish never holds up reading the stream. Each text carries the call's retry.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(u32, String)>();
        let tag = &tag;
        // A guarded turn's text is not previewed: nothing of it reaches the session before the
        // guard has allowed the answer.
        let preview = tag.preview;
        // Only answer text is published (docs/loop-worker.md, "Deltas"): the gateway sends no
        // other kind, and none at all when nothing is previewed.
        let kinds = match preview {
            true => DeltaKinds::TEXT,
            false => DeltaKinds::NONE,
        };
        let call = async move {
            let result = async {
                let on_delta = |tx: &tokio::sync::mpsc::UnboundedSender<(u32, String)>,
                                retry: u32| {
                    let tx = tx.clone();
                    move |_, delta| {
                        if let Delta::Text { text } = delta
                            && preview
                        {
                            let _ = tx.send((retry, text));
                        }
                    }
                };
                let left = || deadline.saturating_duration_since(tokio::time::Instant::now());
                let mut retry = 0u32;
                // What the step added, to the replica holding the rest of the view.
                if let Some((subject, continued)) = view.continued(&mut request) {
                    let sent = self
                        .streams
                        .complete_stream_wanting(
                            &subject,
                            &continued,
                            left(),
                            kinds,
                            on_delta(&tx, retry),
                        )
                        .await;
                    match sent {
                        Ok((response, replica)) => {
                            metrics::counter!("cyrene_model_views_total", "sent" => "continued")
                                .increment(1);
                            view.answered(continued.messages, replica);
                            return Ok(response);
                        }
                        // The replica is gone, or holds the view no longer: send it whole.
                        Err(cyrene_bus::RequestError::NoResponders { .. }) => {}
                        Err(cyrene_bus::RequestError::Remote(body))
                            if body.code == ErrorCode::NotFound => {}
                        // It died mid-call: another replica answers, as a new try of the call.
                        Err(err @ cyrene_bus::RequestError::Vanished { .. }) => {
                            gateway_vanished(tag, &err);
                            retry += 1;
                        }
                        Err(err) => {
                            view.forget();
                            return Err(model_error(err));
                        }
                    }
                    request.messages = continued.messages;
                }
                metrics::counter!("cyrene_model_views_total", "sent" => "whole").increment(1);
                request.view = Some(view.whole(&mut request));
                let subject = subjects::MODEL_COMPLETE_STREAM;
                loop {
                    let sent = self
                        .streams
                        .complete_stream_wanting(
                            subject,
                            &request,
                            left(),
                            kinds,
                            on_delta(&tx, retry),
                        )
                        .await;
                    match sent {
                        Ok((response, replica)) => {
                            view.answered(std::mem::take(&mut request.messages), replica);
                            return Ok(response);
                        }
                        // The replica serving the call died mid-call: the queue group hands the
                        // same request to a live one (the dead one's subscription went with it).
                        Err(err @ cyrene_bus::RequestError::Vanished { .. })
                            if retry < GATEWAY_RETRIES =>
                        {
                            gateway_vanished(tag, &err);
                            retry += 1;
                        }
                        // A gateway from before streaming (a rolling upgrade) has no stream
                        // endpoint: the plain call still answers, without deltas.
                        Err(cyrene_bus::RequestError::NoResponders { .. }) => {
                            view.forget();
                            request.view = None;
                            return self.complete(request).await;
                        }
                        Err(err) => {
                            view.forget();
                            return Err(model_error(err));
                        }
                    }
                }
            }
            .await;
            // The publisher below ends once every delta of the call is out.
            drop(tx);
            result
        };
        let publish = async {
            let (mut seq, mut current) = (0u64, 0u32);
            while let Some((retry, text)) = rx.recv().await {
                if retry != current {
                    // A new try of the call streams its text again from the start.
                    (seq, current) = (0, retry);
                }
                self.publish(tag.event_of_retry(retry, seq, text)).await;
                seq += 1;
            }
        };
        let (result, ()) = tokio::join!(call, publish);
        result
    }

    fn tool_specs(&self, allowed: Option<&[String]>) -> Vec<ToolSpec> {
        self.tools.specs(allowed)
    }

    fn tool_idempotence(&self, name: &str) -> Idempotence {
        self.tools.idempotence(name)
    }
    fn tool_approval(&self, name: &str) -> bool {
        self.tools.approval(name)
    }

    async fn call_tool(&self, context: &ToolContext, call: &ToolCall) -> ToolOutput {
        self.tools.call(context, call).await
    }

    async fn extraction_start(&self, name: &str) -> crate::extractions::Start {
        match &self.extractions {
            Some(record) => record.start(name).await,
            None => crate::extractions::Start::Go,
        }
    }

    async fn extraction_end(&self, name: &str) {
        if let Some(record) = &self.extractions {
            record.end(name).await;
        }
    }

    async fn document(&self, session_id: &str, url: &str) -> Result<FetchedDocument, ErrorBody> {
        let mut bytes = Vec::new();
        loop {
            let request = ReadRequest {
                session_id: session_id.to_owned(),
                url: url.to_owned(),
                offset: bytes.len() as u64,
                max_bytes: 0,
            };
            let chunk: ReadResponse = self.ask(document::DOCUMENT_READ, &request).await?;
            if chunk.size > MAX_FETCH_BYTES {
                return Err(ErrorBody::new(
                    ErrorCode::TooLarge,
                    format!("the document is larger than {MAX_FETCH_BYTES} bytes"),
                ));
            }
            let data = BASE64
                .decode(chunk.data.as_bytes())
                .map_err(|e| ErrorBody::new(ErrorCode::Internal, format!("document chunk: {e}")))?;
            if data.is_empty() && !chunk.eof {
                return Err(ErrorBody::new(
                    ErrorCode::Internal,
                    "the document service sent an empty chunk before the end",
                ));
            }
            bytes.extend_from_slice(&data);
            if chunk.eof || bytes.len() as u64 >= chunk.size {
                return Ok(FetchedDocument {
                    name: chunk.name,
                    mime: chunk.mime,
                    size: chunk.size,
                    title: chunk.title,
                    bytes,
                });
            }
        }
    }

    async fn memory(
        &self,
        persona_id: &str,
        session_id: &str,
    ) -> Result<MemoryReadResponse, ErrorBody> {
        let request = MemoryReadRequest {
            persona_id: persona_id.to_owned(),
            session_id: session_id.to_owned(),
        };
        self.ask(memory::MEMORY_READ, &request).await
    }

    async fn guard(
        &self,
        subject: &str,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, ErrorBody> {
        let headers = cyrene_bus::trace::current_headers();
        cyrene_bus::request::request_raw(&self.client, subject, headers, payload, timeout)
            .await
            .map(|reply| reply.payload.to_vec())
            .map_err(|e| e.to_body())
    }

    async fn publish(&self, event: SessionEvent) {
        let Ok(subject) = subjects::session_events(&event.session_id) else {
            tracing::warn!(session = %event.session_id, "event for an invalid session id dropped");
            return;
        };
        let payload = match serde_json::to_vec(&event) {
            Ok(p) => p,
            Err(err) => {
                tracing::warn!(error = %err, "could not encode a session event");
                return;
            }
        };
        if let Err(err) = self.client.publish(subject, payload.into()).await {
            tracing::warn!(error = %err, "could not publish a session event");
        }
    }
}
