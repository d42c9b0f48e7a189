//! A recording mock of an OpenAI-compatible provider (`POST /v1/chat/completions`) served from
//! the test process; the real gateway binary reaches it through its models config.
//!
//! It behaves like a model that follows `script`: tool calls get fresh random ids on every
//! response, tool arguments are the stable logical keys of the step, the final answer names
//! the markers it answers. Every request is recorded with its arrival time. Each response waits
//! a random 30–250 ms, so kills land mid-call; one (primary marker, round) can be held until the
//! test releases it.
//!
//! # Pitfalls
//! - The HTTP/1.1 server is minimal: `Content-Length` bodies only (what reqwest sends), keep-alive.

use crate::script::{self, Rng, ViewMessage};
use serde_json::{Value, json};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};

/// The name of the external tool the model calls: idempotent (`cyrene.tool.idempotent` = `true`).
pub const TOOL: &str = "chaos_tool";
/// The tool that must not run twice (`cyrene.tool.idempotent` = `false`), called for one step
/// in three ([`script::calls_once_tool`]).
pub const ONCE_TOOL: &str = "chaos_once";
/// The tool each call of which waits for a person's approval (`cyrene.tool.approval` =
/// `required`; not idempotent either), called for one step in six
/// ([`script::calls_gated_tool`]); the auto-approver decides (crate::approver).
pub const GATED_TOOL: &str = "chaos_gated";

/// One request the provider answered.
#[derive(Debug, Clone)]
pub struct ModelCall {
    pub at: Instant,
    pub primary: String,
    pub round: usize,
    /// Tool calls it answered with (0 for the final answer).
    pub tool_calls: usize,
}

/// A request held until released: the one for `round` of the turn whose primary is `primary`.
#[derive(Debug)]
struct Hold {
    primary: String,
    round: usize,
    reached: watch::Sender<bool>,
    release: Arc<Notify>,
    released: watch::Sender<bool>,
}

#[derive(Debug)]
struct State {
    calls: Mutex<Vec<ModelCall>>,
    rng: Mutex<Rng>,
    hold: Mutex<Option<Hold>>,
}

/// The running mock provider; stops with the test process.
#[derive(Debug, Clone)]
pub struct MockProvider {
    pub base_url: String,
    state: Arc<State>,
}

/// A handle on a held request.
#[derive(Debug)]
pub struct HoldHandle {
    reached: watch::Receiver<bool>,
    release: Arc<Notify>,
    released: watch::Sender<bool>,
}

impl HoldHandle {
    /// Waits (bounded) until the held request arrived.
    pub async fn reached(&mut self, within: Duration) -> bool {
        tokio::time::timeout(within, self.reached.wait_for(|r| *r))
            .await
            .is_ok_and(|r| r.is_ok())
    }

    /// Lets the held request (and any later one for the same step) through.
    pub fn release(&self) {
        let _ = self.released.send(true);
        self.release.notify_waiters();
    }
}

impl MockProvider {
    pub async fn start(seed: u64) -> MockProvider {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(State {
            calls: Mutex::new(Vec::new()),
            rng: Mutex::new(Rng::new(seed)),
            hold: Mutex::new(None),
        });
        let s = state.clone();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(serve_connection(stream, s.clone()));
            }
        });
        MockProvider {
            base_url: format!("http://127.0.0.1:{port}/v1"),
            state,
        }
    }

    /// The gateway's models config pointing at this provider.
    pub fn models_config(&self) -> Value {
        json!({
            "providers": {"mock": {"protocol": "openai", "base_url": self.base_url,
                "models": {"mock-model": {}}, "timeout_ms": 120_000}},
            "groups": {"default": [{"provider": "mock", "model": "mock-model"}]},
            "active_group": "default",
            "default_timeout_ms": 120_000
        })
    }

    /// Holds the request for `round` of the turn whose primary marker is `primary`.
    pub fn hold(&self, primary: &str, round: usize) -> HoldHandle {
        let (reached, reached_rx) = watch::channel(false);
        let (released, _) = watch::channel(false);
        let release = Arc::new(Notify::new());
        *self.state.hold.lock().unwrap() = Some(Hold {
            primary: primary.to_owned(),
            round,
            reached,
            release: release.clone(),
            released: released.clone(),
        });
        HoldHandle {
            reached: reached_rx,
            release,
            released,
        }
    }

    /// Every request answered so far, in arrival order.
    pub fn calls(&self) -> Vec<ModelCall> {
        self.state.calls.lock().unwrap().clone()
    }
}

async fn serve_connection(stream: TcpStream, state: Arc<State>) {
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    loop {
        let mut content_length = 0usize;
        let mut line = String::new();
        // Request line, then headers up to the empty line.
        match read.read_line(&mut line).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        loop {
            line.clear();
            match read.read_line(&mut line).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            let header = line.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((name, value)) = header.split_once(':')
                && name.eq_ignore_ascii_case("content-length")
            {
                content_length = value.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; content_length];
        if read.read_exact(&mut body).await.is_err() {
            return;
        }
        let reply = answer(&state, &body).await.to_string();
        let response = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{reply}",
            reply.len()
        );
        if write.write_all(response.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// The view of an OpenAI `messages` array.
fn view_of(request: &Value) -> Vec<ViewMessage> {
    let messages = request["messages"].as_array().cloned().unwrap_or_default();
    messages
        .iter()
        .map(|m| {
            let text = match &m["content"] {
                Value::String(s) => s.clone(),
                Value::Array(parts) => parts
                    .iter()
                    .filter_map(|p| p["text"].as_str())
                    .collect::<Vec<_>>()
                    .join("\n"),
                _ => String::new(),
            };
            ViewMessage {
                role: m["role"].as_str().unwrap_or_default().to_owned(),
                text,
                tool_calls: m["tool_calls"].as_array().map_or(0, Vec::len),
            }
        })
        .collect()
}

async fn answer(state: &State, body: &[u8]) -> Value {
    let at = Instant::now();
    let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let segment = script::segment(&view_of(&request));
    let primary = segment.primary().unwrap_or_default().to_owned();

    // A held step waits for the test (the request is recorded once it is let through).
    let held = {
        let hold = state.hold.lock().unwrap();
        hold.as_ref()
            .filter(|h| h.primary == primary && h.round == segment.round)
            .map(|h| {
                let _ = h.reached.send(true);
                (h.release.clone(), h.released.subscribe())
            })
    };
    if let Some((release, released)) = held {
        let notified = release.notified();
        if !*released.borrow() {
            notified.await;
        }
    }

    let delay = state
        .rng
        .lock()
        .unwrap()
        .between(Duration::from_millis(30), Duration::from_millis(250));
    tokio::time::sleep(delay).await;

    let wants_tools = !primary.is_empty() && segment.round < script::rounds_of(&primary);
    let calls: Vec<(String, String)> = if wants_tools {
        script::round_keys(&primary, segment.round)
            .into_iter()
            .map(|key| (format!("call_{}", cyrene_protocol::ids::new_id()), key))
            .collect()
    } else {
        Vec::new()
    };
    state.calls.lock().unwrap().push(ModelCall {
        at,
        primary: primary.clone(),
        round: segment.round,
        tool_calls: calls.len(),
    });
    let message = if calls.is_empty() {
        json!({"role": "assistant", "content": script::answer_text(&segment.markers)})
    } else {
        let tool_calls: Vec<Value> = calls
            .iter()
            .map(|(id, key)| {
                let ms = script::tool_duration(key).as_millis() as u64;
                let tool = if script::calls_gated_tool(key) {
                    GATED_TOOL
                } else if script::calls_once_tool(key) {
                    ONCE_TOOL
                } else {
                    TOOL
                };
                json!({"id": id, "type": "function", "function": {"name": tool,
                    "arguments": json!({"key": key, "ms": ms}).to_string()}})
            })
            .collect();
        json!({"role": "assistant", "content": null, "tool_calls": tool_calls})
    };
    json!({
        "id": format!("chatcmpl-{}", cyrene_protocol::ids::new_id()),
        "object": "chat.completion",
        "created": 0,
        "model": "mock-model",
        "choices": [{"index": 0, "message": message,
            "finish_reason": if calls.is_empty() { "stop" } else { "tool_calls" }}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    })
}
