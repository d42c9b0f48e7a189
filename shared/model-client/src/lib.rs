//! Typed NATS client of the Cyrene model gateway (docs/model-gateway.md), beside
//! `cyrene-checkpoint-client`: the plain call ([`complete`], `cyrene.model.complete`) and the
//! caller's side of the streamed call (`cyrene.model.complete.stream`, "Streaming"): a fresh
//! inbox, the request published with it as the reply subject, deltas handed to the caller in
//! `seq` order, and the end marker's response returned ([`complete_stream`], [`StreamInbox`]).
//!
//! # Invariants
//! - A gap in `seq` (a delta lost to a slow subscription) is an error of the call, never silently
//!   skipped: the caller would show text with a hole in it.
//! - The subscription is dropped (unsubscribed) when the call returns, however it returns.
//! - A [`StreamInbox`] made [`StreamInbox::with_heartbeat`] asks the gateway for heartbeats and
//!   gives up on a call that hears nothing for [`SILENT_BEATS`] intervals
//!   ([`RequestError::Vanished`]), or that hears nothing at all (a gateway's first heartbeat is
//!   due one interval after it took the call) within [`FIRST_BEAT_BEATS`] intervals: a replica
//!   that died mid-call, or
//!   after NATS handed it the request but before it read it, is noticed in about a second, not at
//!   the call's timeout. So a caller asking for heartbeats needs gateways that send them (every
//!   gateway since issue 29; docs/operations.md says to upgrade gateways before workers).
//!   Heartbeats take a `seq` like any message and are skipped.
//! - [`StreamInbox`] serves many calls from one wildcard subscription (`<inbox>.*`, one token a
//!   call), so a call costs no SUB/UNSUB on the server; a call's route is removed when it
//!   returns, however it returns, and what arrives for a finished call is dropped.

use async_nats::Client;
use async_nats::StatusCode;
use cyrene_bus::request::{self, RequestError};
use cyrene_bus::{service, trace};
use cyrene_protocol::model::{ModelRequest, ModelResponse};
use cyrene_protocol::stream::{DELTAS_HEADER, Delta, DeltaKinds, HEARTBEAT_HEADER, StreamChunk};
use cyrene_protocol::subjects;
use futures::{Stream, StreamExt};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OnceCell, mpsc};
use tokio::time::Instant;

/// One plain model call: `request` on `cyrene.model.complete`, its [`ModelResponse`] or the
/// gateway's error, waiting at most `timeout` (give the gateway's own `total_timeout_ms` a
/// little less).
pub async fn complete(
    client: &Client,
    request: &ModelRequest,
    timeout: Duration,
) -> Result<ModelResponse, RequestError> {
    cyrene_bus::request_json(client, subjects::MODEL_COMPLETE, request, timeout).await
}

/// How many heartbeat intervals of silence make a call's responder count as gone.
pub const SILENT_BEATS: u32 = 5;

/// How many heartbeat intervals a call waits for its first message before its responder counts
/// as gone: longer than [`SILENT_BEATS`], since the gateway decodes the request (a whole view,
/// perhaps) before its call starts, and sends its first heartbeat one interval after that
/// (none when the call answers sooner).
pub const FIRST_BEAT_BEATS: u32 = 10;

/// Streams `request` through the gateway, calling `on_delta` for each delta in order, and
/// returns the whole response, all within `timeout`. One subscription of its own for the call;
/// a caller making many calls keeps a [`StreamInbox`].
pub async fn complete_stream(
    client: &Client,
    request: &ModelRequest,
    timeout: Duration,
    on_delta: impl FnMut(u64, Delta),
) -> Result<ModelResponse, RequestError> {
    let payload = encode(client, request)?;
    let inbox = client.new_inbox();
    let replies = client.subscribe(inbox.clone()).await.map_err(transport)?;
    let subject = subjects::MODEL_COMPLETE_STREAM;
    let (response, _) = exchange(
        client,
        subject,
        payload,
        inbox,
        replies,
        timeout,
        Options::default(),
        on_delta,
    )
    .await?;
    Ok(response)
}

/// One wildcard reply subscription shared by every streamed call of a client: calls are told
/// apart by the last token of their reply subject. Subscribes on first use (and again after a
/// failed try); the subscription ends when the `StreamInbox` is dropped.
#[derive(Debug)]
pub struct StreamInbox {
    client: Client,
    prefix: String,
    routes: Routes,
    next: AtomicU64,
    closed: Arc<AtomicBool>,
    router: OnceCell<RouterTask>,
    /// The heartbeat interval asked of the gateway for every call, if any.
    heartbeat: Option<Duration>,
}

type Routes = Arc<Mutex<HashMap<u64, mpsc::UnboundedSender<async_nats::Message>>>>;

/// The task handing each reply to its call; aborted with the `StreamInbox`.
#[derive(Debug)]
struct RouterTask(tokio::task::JoinHandle<()>);

impl Drop for RouterTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A call's route, removed when the call returns however it returns.
struct Route<'a> {
    routes: &'a Routes,
    token: u64,
}

impl Drop for Route<'_> {
    fn drop(&mut self) {
        lock(self.routes).remove(&self.token);
    }
}

fn lock(
    routes: &Routes,
) -> std::sync::MutexGuard<'_, HashMap<u64, mpsc::UnboundedSender<async_nats::Message>>> {
    routes
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl StreamInbox {
    pub fn new(client: Client) -> StreamInbox {
        let prefix = client.new_inbox();
        StreamInbox {
            client,
            prefix,
            routes: Routes::default(),
            next: AtomicU64::new(0),
            closed: Arc::new(AtomicBool::new(false)),
            router: OnceCell::new(),
            heartbeat: None,
        }
    }

    /// The same inbox, asking the gateway for a heartbeat every `every` on each call; a call that
    /// hears nothing for [`SILENT_BEATS`] × `every` fails with [`RequestError::Vanished`].
    pub fn with_heartbeat(mut self, every: Duration) -> StreamInbox {
        self.heartbeat = Some(every);
        self
    }

    async fn start(&self) -> Result<RouterTask, RequestError> {
        let mut replies = self
            .client
            .subscribe(format!("{}.*", self.prefix))
            .await
            .map_err(transport)?;
        let (routes, closed) = (self.routes.clone(), self.closed.clone());
        Ok(RouterTask(tokio::spawn(async move {
            while let Some(message) = replies.next().await {
                let token = message
                    .subject
                    .rsplit('.')
                    .next()
                    .and_then(|t| t.parse().ok());
                let route = token.and_then(|t: u64| lock(&routes).get(&t).cloned());
                if let Some(route) = route {
                    let _ = route.send(message);
                }
            }
            // The client is gone: every waiting call hears it at once, later ones are refused.
            closed.store(true, Ordering::SeqCst);
            lock(&routes).clear();
        })))
    }

    /// [`complete_stream`] through the shared subscription.
    pub async fn complete_stream(
        &self,
        request: &ModelRequest,
        timeout: Duration,
        on_delta: impl FnMut(u64, Delta),
    ) -> Result<ModelResponse, RequestError> {
        let subject = subjects::MODEL_COMPLETE_STREAM;
        let (response, _) = self
            .complete_stream_at(subject, request, timeout, on_delta)
            .await?;
        Ok(response)
    }

    /// [`StreamInbox::complete_stream`] sent to `subject` (the gateways' queue subject, or one
    /// replica's), also giving back the replica the end marker names as holding the request's
    /// view (docs/model-gateway.md, "Held views").
    pub async fn complete_stream_at(
        &self,
        subject: &str,
        request: &ModelRequest,
        timeout: Duration,
        on_delta: impl FnMut(u64, Delta),
    ) -> Result<(ModelResponse, Option<String>), RequestError> {
        self.complete_stream_wanting(subject, request, timeout, DeltaKinds::ALL, on_delta)
            .await
    }

    /// [`StreamInbox::complete_stream_at`] asking the gateway for deltas of `kinds` only
    /// ([`DELTAS_HEADER`]): `on_delta` hears no other kind, and the bus carries none.
    pub async fn complete_stream_wanting(
        &self,
        subject: &str,
        request: &ModelRequest,
        timeout: Duration,
        kinds: DeltaKinds,
        on_delta: impl FnMut(u64, Delta),
    ) -> Result<(ModelResponse, Option<String>), RequestError> {
        let payload = encode(&self.client, request)?;
        self.router.get_or_try_init(|| self.start()).await?;
        let token = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        lock(&self.routes).insert(token, tx);
        let _route = Route {
            routes: &self.routes,
            token,
        };
        if self.closed.load(Ordering::SeqCst) {
            return Err(transport("the reply subscription closed"));
        }
        let replies = futures::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|message| (message, rx))
        });
        let inbox = format!("{}.{token}", self.prefix);
        exchange(
            &self.client,
            subject,
            payload,
            inbox,
            replies,
            timeout,
            Options {
                heartbeat: self.heartbeat,
                kinds,
            },
            on_delta,
        )
        .await
    }
}

/// What a call asks of the gateway besides its request.
#[derive(Debug, Clone, Copy)]
struct Options {
    /// The heartbeat interval, if any.
    heartbeat: Option<Duration>,
    /// The deltas wanted; every kind sends no header.
    kinds: DeltaKinds,
}

impl Default for Options {
    fn default() -> Options {
        Options {
            heartbeat: None,
            kinds: DeltaKinds::ALL,
        }
    }
}

fn encode(client: &Client, request: &ModelRequest) -> Result<Vec<u8>, RequestError> {
    let payload = serde_json::to_vec(request).map_err(RequestError::Encode)?;
    request::check_outgoing(client, payload.len())?;
    Ok(payload)
}

fn transport(source: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> RequestError {
    RequestError::Transport {
        subject: subjects::MODEL_COMPLETE_STREAM.to_owned(),
        source: source.into(),
    }
}

/// Publishes the request to `subject` with `inbox` as its reply subject and reads `replies` to
/// the end marker: the response and the replica holding the request's view, if any. With a
/// heartbeat, asks for heartbeats and gives up after [`SILENT_BEATS`] silent intervals; with
/// fewer than every kind of delta, names the kinds wanted.
#[allow(clippy::too_many_arguments)]
async fn exchange(
    client: &Client,
    subject: &str,
    payload: Vec<u8>,
    inbox: String,
    replies: impl Stream<Item = async_nats::Message>,
    timeout: Duration,
    options: Options,
    mut on_delta: impl FnMut(u64, Delta),
) -> Result<(ModelResponse, Option<String>), RequestError> {
    let heartbeat = options.heartbeat;
    let mut replies = std::pin::pin!(replies);
    let deadline = Instant::now() + timeout;
    let mut headers = trace::current_headers();
    let silent = heartbeat.map(|every| every * SILENT_BEATS);
    let first = heartbeat.map(|every| every * FIRST_BEAT_BEATS);
    if let Some(every) = heartbeat {
        // A fixed name and digits: always a valid header.
        let _ = cyrene_bus::headers::insert(
            &mut headers,
            HEARTBEAT_HEADER,
            &every.as_millis().to_string(),
        );
    }
    if options.kinds != DeltaKinds::ALL {
        // Fixed names: always a valid header.
        let _ =
            cyrene_bus::headers::insert(&mut headers, DELTAS_HEADER, &options.kinds.header_value());
    }
    client
        .publish_with_reply_and_headers(subject.to_owned(), inbox, headers, payload.into())
        .await
        .map_err(transport)?;
    let mut expected = 0u64;
    // Until the first message (a delta, the end, or the gateway's first heartbeat one interval
    // into the call) the responder has longer: it decodes the request before the call starts.
    let mut heard = false;
    loop {
        let quiet = if heard { silent } else { first };
        let wait = match quiet {
            Some(quiet) => deadline.min(Instant::now() + quiet),
            None => deadline,
        };
        let message = match tokio::time::timeout_at(wait, replies.next()).await {
            Err(_) if wait < deadline => {
                return Err(RequestError::Vanished {
                    subject: subject.to_owned(),
                    silent: quiet.unwrap_or(timeout),
                });
            }
            Err(_) => {
                return Err(RequestError::Timeout {
                    subject: subject.to_owned(),
                    after: timeout,
                });
            }
            Ok(None) => return Err(transport("the reply subscription closed")),
            Ok(Some(message)) => message,
        };
        if message.status == Some(StatusCode::NO_RESPONDERS) {
            return Err(RequestError::NoResponders {
                subject: subject.to_owned(),
            });
        }
        let chunk: StreamChunk = match serde_json::from_slice(&message.payload) {
            Ok(chunk) => chunk,
            // A peer that answers with headers and no chunk body.
            Err(source) => match service::error_from_message(&message) {
                Some(body) => return Err(RequestError::Remote(body)),
                None => {
                    return Err(RequestError::Decode {
                        subject: subject.to_owned(),
                        source,
                    });
                }
            },
        };
        if chunk.seq != expected {
            return Err(transport(format!(
                "stream chunk {} arrived when {expected} was expected (a delta was lost)",
                chunk.seq
            )));
        }
        expected += 1;
        heard = true;
        if let Some(error) = chunk.error {
            return Err(RequestError::Remote(error));
        }
        if let Some(done) = chunk.done {
            return Ok((*done, chunk.replica));
        }
        if chunk.heartbeat == Some(true) {
            continue;
        }
        if let Some(delta) = chunk.delta {
            on_delta(chunk.seq, delta);
        }
    }
}
