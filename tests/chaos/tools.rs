//! The external tools the mock model calls: micro endpoints `cyrene.tool.chaos_tool` (declared
//! idempotent), `cyrene.tool.chaos_once` (declared not idempotent) and `cyrene.tool.chaos_gated`
//! (not idempotent, every call approved first) with the metadata the loop workers discover, recording every execution by tool, `Cyrene-Tool-Call-Id` and logical key,
//! with start and finish times and the caller's inbox (which worker asked).

use crate::provider::{GATED_TOOL, ONCE_TOOL, TOOL};
use cyrene_test_support::micro::{add_tool_declaring, start_described_service};
use futures::StreamExt;
use serde_json::{Value, json};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One execution of the tool.
#[derive(Debug, Clone)]
pub struct Execution {
    /// Which tool ran.
    pub tool: &'static str,
    pub key: String,
    pub call_id: String,
    /// The caller's request inbox (`_INBOX_<service>.<id>`): one per worker connection.
    pub inbox: String,
    pub started: Instant,
    pub finished: Option<Instant>,
}

/// The running tool service.
#[derive(Debug, Clone)]
pub struct ToolService {
    executions: Arc<Mutex<Vec<Execution>>>,
    _service: Arc<async_nats::service::Service>,
}

/// `_INBOX_x.<id>` of a reply subject `_INBOX_x.<id>.<token>`.
pub fn inbox_of(reply: &str) -> String {
    let mut parts = reply.splitn(3, '.');
    match (parts.next(), parts.next()) {
        (Some(a), Some(b)) => format!("{a}.{b}"),
        _ => reply.to_owned(),
    }
}

impl ToolService {
    pub async fn start(client: &async_nats::Client) -> ToolService {
        let service = start_described_service(
            client,
            "chaos-tools",
            "0.0.0",
            "chaos suite: the tool the mock model calls",
        )
        .await;
        let description = "Looks something up (chaos suite; counts its executions)";
        let parameters = json!({"type": "object", "properties": {"key": {"type": "string"},
            "ms": {"type": "integer"}}});
        let executions: Arc<Mutex<Vec<Execution>>> = Arc::default();
        for (tool, idempotent, approval) in [
            (TOOL, "true", ""),
            (ONCE_TOOL, "false", ""),
            (GATED_TOOL, "false", "required"),
        ] {
            let mut declared = vec![("cyrene.tool.idempotent", idempotent)];
            if !approval.is_empty() {
                declared.push(("cyrene.tool.approval", approval));
            }
            let mut endpoint = add_tool_declaring(
                &service,
                tool,
                description,
                &parameters.to_string(),
                &declared,
            )
            .await;
            let log = executions.clone();
            tokio::spawn(async move {
                while let Some(request) = endpoint.next().await {
                    tokio::spawn(execute(tool, request, log.clone()));
                }
            });
        }
        client.flush().await.unwrap();
        ToolService {
            executions,
            _service: Arc::new(service),
        }
    }

    /// Every execution so far, in start order.
    pub fn executions(&self) -> Vec<Execution> {
        self.executions.lock().unwrap().clone()
    }
}

/// Runs one request: records it, waits the `ms` it asks for, answers `done <key>`.
async fn execute(
    tool: &'static str,
    request: async_nats::service::Request,
    log: Arc<Mutex<Vec<Execution>>>,
) {
    let args: Value = serde_json::from_slice(&request.message.payload).unwrap_or(Value::Null);
    let key = args["key"].as_str().unwrap_or_default().to_owned();
    let ms = args["ms"].as_u64().unwrap_or(0);
    let call_id = request
        .message
        .headers
        .as_ref()
        .and_then(|h| h.get("Cyrene-Tool-Call-Id"))
        .map(|v| v.as_str().to_owned())
        .unwrap_or_default();
    let inbox = request
        .message
        .reply
        .as_ref()
        .map(|r| inbox_of(r.as_str()))
        .unwrap_or_default();
    let index = {
        let mut log = log.lock().unwrap();
        log.push(Execution {
            tool,
            key: key.clone(),
            call_id,
            inbox,
            started: Instant::now(),
            finished: None,
        });
        log.len() - 1
    };
    tokio::time::sleep(Duration::from_millis(ms)).await;
    log.lock().unwrap()[index].finished = Some(Instant::now());
    let reply = json!({"text": format!("done {key}"), "is_error": false});
    let _ = request.respond(Ok(reply.to_string().into())).await;
}
