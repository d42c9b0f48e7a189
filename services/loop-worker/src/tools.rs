//! Tools a turn can call: the built-ins and the external tools discovered on the bus
//! (docs/architecture.md §9).
//!
//! An external tool is a NATS micro endpoint on `cyrene.tool.<name>` whose endpoint metadata holds
//! `cyrene.tool.description`, `cyrene.tool.parameters` (a JSON-schema string) and optionally
//! `cyrene.tool.idempotent` (`true`: it may run again under the same call id; anything else: it
//! must not run twice) and `cyrene.tool.approval` (`required`: every call waits for a person's
//! decision, docs/reliability.md, "Approval"). The request body is the args object, header `Cyrene-Tool-Call-Id` carries
//! the call id (an idempotency key: an idempotent call in flight at a crash runs again under the
//! same id); the reply is `{"text":"…","is_error":false}` or a micro error, which becomes an
//! `is_error` result; no reply within the timeout is marked [`ToolOutput::unanswered`].
//!
//! # Invariants
//! - A tool never fails the turn: timeouts, missing responders and micro errors are results.
//! - Built-in names win over discovered ones with the same name.
//! - Only what may be offered is called: a call naming a tool outside the turn's allow-list
//!   ([`ToolContext::allowed`], the persona's `tools`), or neither built in nor discovered (after
//!   one bounded rediscovery), gets an `is_error` result and nothing is sent — a model cannot
//!   reach an arbitrary `cyrene.tool.*` subject by naming it.

use crate::ports::{Idempotence, ToolContext, ToolOutput};
use async_nats::{Client, HeaderMap};
use cyrene_bus::request::request_raw;
use cyrene_bus::{RequestError, trace};
use cyrene_comm::{AskOptions, Probe};
use cyrene_protocol::message::ToolCall;
use cyrene_protocol::model::ToolSpec;
use cyrene_protocol::{ids, subjects};
use serde::Deserialize;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

/// The header carrying the tool-call id.
pub const TOOL_CALL_ID_HEADER: &str = "Cyrene-Tool-Call-Id";
/// Endpoint metadata key of a tool's description.
pub const META_DESCRIPTION: &str = "cyrene.tool.description";
/// Endpoint metadata key of a tool's JSON-schema parameters (a JSON string).
pub const META_PARAMETERS: &str = "cyrene.tool.parameters";
/// Endpoint metadata key of whether a tool may run again under the same call id: `true` or
/// `false`; anything else, or nothing, is `false` (docs/tools.md, "Semantics").
pub const META_IDEMPOTENT: &str = "cyrene.tool.idempotent";

/// Endpoint metadata key by which a tool asks for a person's approval of every call: only the
/// exact value `required` does.
pub const META_APPROVAL: &str = cyrene_protocol::approval::TOOL_APPROVAL_METADATA;

const BUILTIN_ASK_AGENT: &str = "ask_agent";
const BUILTIN_EMIT_EVENT: &str = "emit_event";
const BUILTIN_CURRENT_TIME: &str = "current_time";

/// What the built-ins declare: `current_time` reads a clock; `ask_agent` makes another agent
/// answer a turn and `emit_event` delivers an event, each once per run, so neither may run twice.
pub(crate) fn builtin_idempotence(name: &str) -> Option<Idempotence> {
    match name {
        BUILTIN_CURRENT_TIME => Some(Idempotence::ReadOnly),
        BUILTIN_ASK_AGENT | BUILTIN_EMIT_EVENT => Some(Idempotence::NotIdempotent),
        _ => None,
    }
}

/// A discovered tool's declaration: only the exact string `true` makes it idempotent.
fn declared_idempotence(meta: &BTreeMap<String, String>) -> Idempotence {
    match meta.get(META_IDEMPOTENT).map(String::as_str) {
        Some("true") => Idempotence::Idempotent,
        _ => Idempotence::NotIdempotent,
    }
}

/// A discovered tool's declaration: only the exact string `required` asks for approval.
fn declared_approval(meta: &BTreeMap<String, String>) -> bool {
    meta.get(META_APPROVAL).map(String::as_str)
        == Some(cyrene_protocol::approval::TOOL_APPROVAL_REQUIRED)
}

/// How long a call naming an unknown tool waits for one rediscovery before it is refused.
const REDISCOVER_WAIT: Duration = Duration::from_millis(300);

/// The built-in tools' specs.
pub fn builtin_specs() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: BUILTIN_ASK_AGENT.to_owned(),
            description: "Ask another agent a question and wait for its answer.".to_owned(),
            parameters: json!({"type":"object","properties":{
                "agent":{"type":"string","description":"the agent id to ask"},
                "question":{"type":"string"},
                "data":{"description":"optional structured payload sent with the question"}},
                "required":["agent","question"]}),
        },
        ToolSpec {
            name: BUILTIN_EMIT_EVENT.to_owned(),
            description: "Notify another agent (or every agent, without `to`) of an event."
                .to_owned(),
            parameters: json!({"type":"object","properties":{
                "name":{"type":"string","description":"event name, e.g. task.progress"},
                "to":{"type":"string","description":"the agent id; omit to broadcast"},
                "data":{"type":"object"}},"required":["name"]}),
        },
        ToolSpec {
            name: BUILTIN_CURRENT_TIME.to_owned(),
            description: "The current date and time (UTC, RFC 3339).".to_owned(),
            parameters: json!({"type":"object","properties":{}}),
        },
    ]
}

/// A tool found on the bus: what is offered to the model and what it declares.
#[derive(Debug, Clone)]
struct Discovered {
    spec: ToolSpec,
    idempotence: Idempotence,
    /// Every call waits for a person's decision.
    approval: bool,
}

/// The tool set: built-ins plus what the last discovery found.
#[derive(Debug, Clone)]
pub struct Tools {
    client: Client,
    /// Built once: the specs are offered at every step.
    builtins: Arc<Vec<ToolSpec>>,
    discovered: Arc<RwLock<BTreeMap<String, Discovered>>>,
    timeout: Duration,
    ask_timeout: Duration,
}

impl Tools {
    pub fn new(client: Client, timeout: Duration, ask_timeout: Duration) -> Tools {
        Tools {
            client,
            builtins: Arc::new(builtin_specs()),
            discovered: Arc::default(),
            timeout,
            ask_timeout,
        }
    }

    /// The specs offered to the model: built-ins and discovered tools, only those in `allowed`
    /// when there is a list.
    pub fn specs(&self, allowed: Option<&[String]>) -> Vec<ToolSpec> {
        let mut specs = (*self.builtins).clone();
        if let Ok(found) = self.discovered.read() {
            specs.extend(
                found
                    .values()
                    .filter(|d| !specs.iter().any(|b| b.name == d.spec.name))
                    .map(|d| d.spec.clone())
                    .collect::<Vec<_>>(),
            );
        }
        if let Some(allowed) = allowed {
            specs.retain(|s| allowed.contains(&s.name));
        }
        specs
    }

    fn known(&self, name: &str) -> bool {
        self.builtins.iter().any(|s| s.name == name)
            || self
                .discovered
                .read()
                .is_ok_and(|found| found.contains_key(name))
    }

    /// How `name` may be run again (built-ins first; unknown tools are not idempotent).
    pub fn idempotence(&self, name: &str) -> Idempotence {
        builtin_idempotence(name).unwrap_or_else(|| {
            self.discovered
                .read()
                .ok()
                .and_then(|found| found.get(name).map(|d| d.idempotence))
                .unwrap_or(Idempotence::NotIdempotent)
        })
    }

    /// Whether the tool asks for a person's approval of every call (built-ins never do).
    pub fn approval(&self, name: &str) -> bool {
        builtin_idempotence(name).is_none()
            && self
                .discovered
                .read()
                .is_ok_and(|found| found.get(name).is_some_and(|d| d.approval))
    }

    /// Asks every micro service for its endpoints (`$SRV.INFO`) and keeps the `cyrene.tool.*`
    /// ones. Bounded by `wait`; returns how many tools were found.
    pub async fn discover(&self, wait: Duration) -> usize {
        let found = match discover(&self.client, wait).await {
            Ok(found) => found,
            Err(err) => {
                tracing::warn!(error = %err, "tool discovery failed; keeping the last list");
                return self.discovered.read().map(|d| d.len()).unwrap_or(0);
            }
        };
        let n = found.len();
        if let Ok(mut discovered) = self.discovered.write() {
            *discovered = found;
        }
        n
    }

    /// Runs one call, if the turn may make it (see the module invariants).
    /// Calls `call.name`, recorded in `cyrene_tool_call_duration_seconds{tool, outcome}` and
    /// `cyrene_tool_calls_total{tool, outcome}` (a name that was never discovered is labelled
    /// `unknown`: the model chooses names, the metrics' cardinality must not follow it).
    pub async fn call(&self, context: &ToolContext, call: &ToolCall) -> ToolOutput {
        let started = std::time::Instant::now();
        let output = self.call_unrecorded(context, call).await;
        let tool = if self.known(&call.name) {
            call.name.clone()
        } else {
            "unknown".to_owned()
        };
        let outcome = if output.is_error { "error" } else { "ok" };
        metrics::histogram!("cyrene_tool_call_duration_seconds", "tool" => tool.clone(), "outcome" => outcome)
            .record(started.elapsed().as_secs_f64());
        metrics::counter!("cyrene_tool_calls_total", "tool" => tool, "outcome" => outcome)
            .increment(1);
        output
    }

    async fn call_unrecorded(&self, context: &ToolContext, call: &ToolCall) -> ToolOutput {
        let name = call.name.as_str();
        if let Some(allowed) = &context.allowed
            && !allowed.iter().any(|a| a == name)
        {
            return ToolOutput::error(format!(
                "tool {name:?} is not allowed in this turn; it was not called"
            ));
        }
        // A tool registered since the last periodic discovery is found by one bounded refresh.
        if !self.known(name) {
            self.discover(REDISCOVER_WAIT).await;
            if !self.known(name) {
                return ToolOutput::error(format!(
                    "tool {name:?} is not available (no such tool was discovered); it was not called"
                ));
            }
        }
        match call.name.as_str() {
            BUILTIN_CURRENT_TIME => ToolOutput::ok(chrono::Utc::now().to_rfc3339()),
            BUILTIN_ASK_AGENT => self.ask_agent(context, call).await,
            BUILTIN_EMIT_EVENT => self.emit_event(context, call).await,
            name => self.call_external(name, call).await,
        }
    }

    async fn ask_agent(&self, context: &ToolContext, call: &ToolCall) -> ToolOutput {
        let (Some(agent), Some(question)) = (
            call.args.get("agent").and_then(Value::as_str),
            call.args.get("question").and_then(Value::as_str),
        ) else {
            return ToolOutput::error("ask_agent needs string arguments `agent` and `question`");
        };
        let probe = Probe::new(self.client.clone(), context.agent_id.clone());
        let options = AskOptions {
            timeout: Some(self.ask_timeout),
            data: call.args.get("data").cloned().unwrap_or(Value::Null),
            chain: context.ask_chain.clone(),
            ..Default::default()
        };
        match probe.ask_with(agent, question, options).await {
            Ok(reply) => ToolOutput::ok(reply.text),
            Err(err) => ToolOutput::error(err.to_string()),
        }
    }

    async fn emit_event(&self, context: &ToolContext, call: &ToolCall) -> ToolOutput {
        let Some(name) = call.args.get("name").and_then(Value::as_str) else {
            return ToolOutput::error("emit_event needs a string argument `name`");
        };
        let data = call.args.get("data").cloned().unwrap_or(Value::Null);
        let probe = Probe::new(self.client.clone(), context.agent_id.clone());
        let sent = match call.args.get("to").and_then(Value::as_str) {
            Some(to) => probe.emit(to, name, data).await,
            None => probe.broadcast(name, data).await,
        };
        match sent {
            Ok(()) => ToolOutput::ok(format!("event {name} sent")),
            Err(err) => ToolOutput::error(err.to_string()),
        }
    }

    async fn call_external(&self, name: &str, call: &ToolCall) -> ToolOutput {
        let subject = match subjects::tool(name) {
            Ok(s) => s,
            Err(err) => return ToolOutput::error(format!("no such tool {name:?}: {err}")),
        };
        let mut headers = HeaderMap::new();
        // The id is the model's text: one with a line break cannot be sent as a header.
        if let Err(err) = cyrene_bus::headers::insert(&mut headers, TOOL_CALL_ID_HEADER, &call.id) {
            return ToolOutput::error(format!("tool {name} was not called: {err}"));
        }
        trace::inject_current(&mut headers);
        let payload = serde_json::to_vec(&call.args).unwrap_or_else(|_| b"{}".to_vec());
        match request_raw(&self.client, &subject, headers, payload, self.timeout).await {
            Ok(message) => match serde_json::from_slice::<ToolReply>(&message.payload) {
                Ok(reply) => match tool_images(reply.images) {
                    Ok(images) => ToolOutput {
                        text: reply.text,
                        is_error: reply.is_error,
                        images,
                        unanswered: false,
                    },
                    Err(why) => {
                        ToolOutput::error(format!("tool {name} sent an invalid reply: {why}"))
                    }
                },
                Err(err) => ToolOutput::error(format!("tool {name} sent an invalid reply: {err}")),
            },
            Err(RequestError::NoResponders { .. }) => {
                ToolOutput::error(format!("tool {name} is not available"))
            }
            // The request went out: the tool may have run (docs/reliability.md).
            Err(err @ RequestError::Timeout { .. }) => ToolOutput {
                unanswered: true,
                ..ToolOutput::error(format!("tool {name} failed: {err}"))
            },
            Err(err) => ToolOutput::error(format!("tool {name} failed: {err}")),
        }
    }
}

#[derive(Deserialize)]
struct ToolReply {
    #[serde(default)]
    text: String,
    #[serde(default)]
    is_error: bool,
    /// Images as `data:image/<type>;base64,…` URIs (docs/tools.md, "Results").
    #[serde(default)]
    images: Vec<String>,
}

/// The most images one tool result may carry.
pub const MAX_TOOL_IMAGES: usize = 4;

/// The most image URI bytes one tool result may carry, all its images together (the MCP
/// bridge's own cap; a checkpoint and every later view of the turn hold them).
pub const MAX_TOOL_IMAGE_BYTES: usize = 512 << 10;

/// A tool's images, if each is an image `data:` URI within the bounds.
fn tool_images(images: Vec<String>) -> Result<Vec<String>, String> {
    if images.len() > MAX_TOOL_IMAGES {
        return Err(format!(
            "{} images, more than the {MAX_TOOL_IMAGES} a result may carry",
            images.len()
        ));
    }
    for (i, uri) in images.iter().enumerate() {
        let Some(rest) = uri.strip_prefix("data:image/") else {
            return Err(format!("images[{i}] is not a data:image/… URI"));
        };
        let Some((kind, data)) = rest.split_once(";base64,") else {
            return Err(format!("images[{i}] is not base64"));
        };
        if kind.is_empty()
            || !kind
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c))
        {
            return Err(format!("images[{i}] has no image type"));
        }

        if data.is_empty()
            || !data
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b))
        {
            return Err(format!("images[{i}] is not base64"));
        }
    }
    let total: usize = images.iter().map(String::len).sum();
    if total > MAX_TOOL_IMAGE_BYTES {
        return Err(format!(
            "its images take {total} bytes, more than the {MAX_TOOL_IMAGE_BYTES} a result may carry"
        ));
    }
    Ok(images)
}

#[derive(Deserialize)]
struct ServiceInfo {
    #[serde(default)]
    endpoints: Vec<EndpointInfo>,
}

#[derive(Deserialize)]
struct EndpointInfo {
    #[serde(default)]
    subject: String,
    #[serde(default)]
    metadata: Option<BTreeMap<String, String>>,
}

async fn discover(
    client: &Client,
    wait: Duration,
) -> Result<BTreeMap<String, Discovered>, async_nats::Error> {
    let answers =
        cyrene_bus::discovery::gather(client, cyrene_bus::discovery::Verb::Info, None, wait, None)
            .await?;
    let mut found = BTreeMap::new();
    for answer in answers {
        let Ok(info) = serde_json::from_value::<ServiceInfo>(answer) else {
            continue;
        };
        for ep in info.endpoints {
            let Some(name) = ep.subject.strip_prefix("cyrene.tool.") else {
                continue;
            };
            if ids::validate(ids::IdKind::Tool, name).is_err() {
                continue;
            }
            let meta = ep.metadata.unwrap_or_default();
            let parameters = meta
                .get(META_PARAMETERS)
                .and_then(|p| serde_json::from_str::<Value>(p).ok())
                .filter(Value::is_object)
                .unwrap_or_else(|| json!({"type":"object"}));
            let description = meta.get(META_DESCRIPTION).cloned().unwrap_or_default();
            found.insert(
                name.to_owned(),
                Discovered {
                    spec: ToolSpec {
                        name: name.to_owned(),
                        description,
                        parameters,
                    },
                    idempotence: declared_idempotence(&meta),
                    approval: declared_approval(&meta),
                },
            );
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_exact_required_asks_for_approval() {
        for (value, want) in [
            (Some("required"), true),
            (Some("Required"), false),
            (Some("true"), false),
            (None, false),
        ] {
            let mut m = BTreeMap::new();
            if let Some(v) = value {
                m.insert(META_APPROVAL.to_owned(), v.to_owned());
            }
            assert_eq!(declared_approval(&m), want, "{value:?}");
        }
    }

    #[test]
    fn only_an_exact_true_declares_a_tool_idempotent() {
        let meta = |v: Option<&str>| {
            let mut m = BTreeMap::new();
            if let Some(v) = v {
                m.insert(META_IDEMPOTENT.to_owned(), v.to_owned());
            }
            declared_idempotence(&m)
        };
        assert_eq!(meta(Some("true")), Idempotence::Idempotent);
        for other in [
            None,
            Some("false"),
            Some("TRUE"),
            Some("yes"),
            Some(""),
            Some("1"),
        ] {
            assert_eq!(meta(other), Idempotence::NotIdempotent, "{other:?}");
        }
        assert_eq!(
            builtin_idempotence(BUILTIN_CURRENT_TIME),
            Some(Idempotence::ReadOnly)
        );
        assert_eq!(
            builtin_idempotence(BUILTIN_ASK_AGENT),
            Some(Idempotence::NotIdempotent)
        );
        assert_eq!(
            builtin_idempotence(BUILTIN_EMIT_EVENT),
            Some(Idempotence::NotIdempotent)
        );
    }

    #[test]
    fn a_tools_images_must_be_a_few_bounded_base64_image_uris() {
        let png = "data:image/png;base64,iVBORw0K".to_owned();
        assert_eq!(tool_images(vec![png.clone()]), Ok(vec![png.clone()]));
        assert_eq!(tool_images(Vec::new()), Ok(Vec::new()));
        for bad in [
            "https://example.com/cat.png".to_owned(),
            "data:text/html;base64,PHNjcmlwdD4=".to_owned(),
            "data:image/png,raw".to_owned(),
            "data:image/;base64,AAAA".to_owned(),
            "data:image/png;base64,<script>".to_owned(),
            format!("data:image/png;base64,{}", "A".repeat(MAX_TOOL_IMAGE_BYTES)),
        ] {
            assert!(tool_images(vec![bad.clone()]).is_err(), "{bad}");
        }
        let err = tool_images(vec![png; MAX_TOOL_IMAGES + 1]).unwrap_err();
        assert!(err.contains("more than the 4"), "{err}");
    }
}
