//! Both dialects against real HTTP mock upstreams (wiremock): the exact outgoing JSON, the
//! normalised response, and routing/fallback/cooldown/timeout behaviour of the gateway.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{bodies, hits};
use cyrene_model_gateway::Gateway;
use cyrene_model_gateway::config::{ModelsConfig, Secrets};
use cyrene_protocol::ErrorCode;
use cyrene_protocol::message::{Message, Part, ReasoningFamily, Role, ToolCall};
use cyrene_protocol::model::{ModelRequest, ModelResponse, Thinking, ToolSpec};
use serde_json::{Map, Value, json};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::instrument::WithSubscriber;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

const OPENAI_KEY: &str = "sk-test-openai-0123456789";
const ANTHROPIC_KEY: &str = "sk-ant-test-0123456789";

fn gateway(config: Value) -> Gateway {
    let models: ModelsConfig = serde_json::from_value(config).unwrap();
    let secrets =
        Secrets::from_pairs([("OPENAI_KEY", OPENAI_KEY), ("ANTHROPIC_KEY", ANTHROPIC_KEY)]);
    Gateway::new(
        models,
        &secrets,
        cyrene_model_gateway::http_client().unwrap(),
    )
    .unwrap()
}

/// One openai-protocol provider `p` with model `m` (and any extra fields).
fn openai_provider(server: &MockServer, extra: Value) -> Value {
    let mut p = json!({"protocol":"openai","base_url":server.uri(),"api_key_env":"OPENAI_KEY",
                       "models":{"m":{}}});
    merge(&mut p, extra);
    p
}

fn anthropic_provider(server: &MockServer, extra: Value) -> Value {
    let mut p = json!({"protocol":"anthropic","base_url":server.uri(),
                       "api_key_env":"ANTHROPIC_KEY","models":{"claude":{"vision":true}}});
    merge(&mut p, extra);
    p
}

fn merge(into: &mut Value, extra: Value) {
    if let (Value::Object(a), Value::Object(b)) = (into, extra) {
        for (k, v) in b {
            a.insert(k, v);
        }
    }
}

fn single(provider: Value, model: &str) -> Value {
    json!({"providers":{"p":provider},"groups":{"g":[{"provider":"p","model":model}]},
           "active_group":"g"})
}

async fn reply_with(server: &MockServer, route: &str, body: Value) {
    Mock::given(method("POST"))
        .and(path(route))
        .respond_with(ResponseTemplate::new(200).set_body_json(body))
        .mount(server)
        .await;
}

/// A mock upstream that answers every POST on `route` with `body`.
async fn answering(route: &str, body: Value) -> MockServer {
    let server = MockServer::start().await;
    reply_with(&server, route, body).await;
    server
}

/// A gateway with one openai-protocol provider on `server` (and `extra` fields), model `m`.
fn openai_gateway(server: &MockServer, extra: Value) -> Gateway {
    gateway(single(openai_provider(server, extra), "m"))
}

/// A gateway with one anthropic-protocol provider on `server` (and `extra` fields), `model`.
fn anthropic_gateway(server: &MockServer, extra: Value, model: &str) -> Gateway {
    gateway(single(anthropic_provider(server, extra), model))
}

/// A thinking request: `budget` tokens (None = unset), switched on or off.
fn thinking(budget: Option<u32>, enable: bool) -> Option<Thinking> {
    Some(Thinking {
        budget_tokens: budget,
        enable: Some(enable),
    })
}

/// A mock openai upstream that answers only after 5 s.
async fn slow_upstream() -> MockServer {
    let slow = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_body_json(openai_text_reply("late"))
                .set_delay(Duration::from_secs(5)),
        )
        .mount(&slow)
        .await;
    slow
}

/// Asserts that an error `message` names `cause`.
fn assert_names(message: &str, cause: &str) {
    assert!(message.contains(cause), "{message}");
}

fn ask(messages: Vec<Message>) -> ModelRequest {
    ModelRequest {
        messages,
        ..Default::default()
    }
}

fn user(text: &str) -> Message {
    Message::text(Role::User, text)
}

fn obj(v: Value) -> Map<String, Value> {
    v.as_object().unwrap().clone()
}

/// A `Write` into a shared buffer, for capturing log lines.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Completes `req` (which must succeed) and returns the WARN lines logged meanwhile.
async fn warnings_completing(gw: &Gateway, req: &ModelRequest) -> String {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::WARN)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let result = gw.complete(req).with_subscriber(subscriber).await;
    result.unwrap();
    String::from_utf8(captured.0.lock().unwrap().clone()).unwrap()
}

fn openai_text_reply(text: &str) -> Value {
    json!({"id":"x","object":"chat.completion","model":"m",
           "choices":[{"index":0,"message":{"role":"assistant","content":text},
                       "finish_reason":"stop"}],
           "usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5}})
}

fn anthropic_text_reply(text: &str) -> Value {
    json!({"id":"msg_1","type":"message","role":"assistant","model":"claude",
           "content":[{"type":"text","text":text}],"stop_reason":"end_turn",
           "usage":{"input_tokens":3,"output_tokens":2}})
}

// ---------------------------------------------------------------- OpenAI-compatible dialect

#[tokio::test]
async fn openai_text_is_sent_natively_and_normalised() {
    let server = answering("/chat/completions", openai_text_reply("hello")).await;
    let gw = openai_gateway(&server, json!({}));
    let mut req = ask(vec![
        Message::text(Role::System, "be brief"),
        Message::text(Role::User, "hi").sender("阿明"),
    ]);
    req.temperature = Some(0.3);
    req.max_tokens = Some(64);
    let resp = gw.complete(&req).await.unwrap();

    let received = server.received_requests().await.unwrap();
    assert_eq!(
        received[0].headers.get("authorization").unwrap(),
        &format!("Bearer {OPENAI_KEY}")
    );
    assert_eq!(
        received[0].body_json::<Value>().unwrap(),
        json!({"model":"m","temperature":0.3,"max_tokens":64,"messages":[
            {"role":"system","content":"be brief"},
            {"role":"user","content":"hi"}]})
    );
    assert_eq!(
        serde_json::to_value(&resp).unwrap(),
        json!({"model":"m","content":"hello",
               "message":{"role":"assistant","content":[{"type":"text","text":"hello"}]},
               "stop_reason":"stop","prompt_tokens":3,"completion_tokens":2,"total_tokens":5,
               "cache_hit_tokens":0,"cache_miss_tokens":0,"reasoning_tokens":0,"provider":"p"})
    );
}

#[tokio::test]
async fn openai_several_tool_calls_in_one_reply_decode_their_arguments() {
    let server = answering("/chat/completions", json!({"model":"m","choices":[{"message":{"role":"assistant","content":null,
            "tool_calls":[
              {"id":"c1","type":"function","function":{"name":"get_time","arguments":"{\"tz\":\"UTC\"}"}},
              {"id":"c2","type":"function","function":{"name":"ping","arguments":""}},
              {"id":"c3","type":"function","function":{"name":"broken","arguments":"{\"a\":"}}]},
            "finish_reason":"tool_calls"}]})).await;
    let gw = openai_gateway(&server, json!({}));
    let mut req = ask(vec![user("what time is it?")]);
    req.tools = vec![
        ToolSpec {
            name: "get_time".into(),
            description: "now".into(),
            parameters: json!({"type":"object","properties":{"tz":{"type":"string"}}}),
        },
        ToolSpec {
            name: "ping".into(),
            description: String::new(),
            parameters: json!({"type":"object"}),
        },
    ];
    req.tool_choice = Some(json!({"type":"auto"}));
    let resp = gw.complete(&req).await.unwrap();

    assert_eq!(
        bodies(&server).await[0],
        json!({"model":"m","messages":[{"role":"user","content":"what time is it?"}],
            "tools":[
              {"type":"function","function":{"name":"get_time","description":"now",
                 "parameters":{"type":"object","properties":{"tz":{"type":"string"}}}}},
              {"type":"function","function":{"name":"ping","parameters":{"type":"object"}}}],
            "tool_choice":"auto"})
    );
    assert_eq!(resp.stop_reason, "tool_calls");
    assert_eq!(resp.content, "");
    assert_eq!(resp.tool_calls.len(), 3);
    assert_eq!(resp.tool_calls[0].args, obj(json!({"tz":"UTC"})));
    assert_eq!(resp.tool_calls[1].args, Map::new());
    assert!(resp.tool_calls[1].args_error.is_none());
    assert_eq!(resp.tool_calls[2].args, Map::new());
    assert!(
        resp.tool_calls[2]
            .args_error
            .as_deref()
            .unwrap()
            .contains("not valid JSON")
    );
    assert_eq!(
        serde_json::to_value(&resp.message).unwrap()["content"],
        json!([{"type":"tool_call","id":"c1","name":"get_time","args":{"tz":"UTC"}},
               {"type":"tool_call","id":"c2","name":"ping","args":{}},
               {"type":"tool_call","id":"c3","name":"broken","args":{},
                "args_error":resp.tool_calls[2].args_error}])
    );
}

/// A user message with `text`, the inline image `data_url` and the linked image `url`.
fn two_images(text: &str, data_url: &str, url: &str) -> Message {
    let mut msg = Message::image(Role::User, text, data_url);
    msg.content.push(Part::ImageUrl {
        image_url: url.into(),
    });
    msg
}

/// The next step of a `time?` turn: `assistant` (the first reply, as the worker keeps it) and
/// the result of its `get_time` call `call_id`; returns the assistant message as sent upstream.
async fn assistant_sent_back(
    gw: &Gateway,
    server: &MockServer,
    assistant: Message,
    call_id: &str,
) -> Value {
    let result = Message::tool_result(call_id, "get_time", "12:00", false);
    gw.complete(&ask(vec![user("time?"), assistant, result]))
        .await
        .unwrap();
    bodies(server).await[1]["messages"][1].clone()
}

fn tool_history() -> Vec<Message> {
    let calls = [
        ToolCall {
            id: "c1".into(),
            name: "get_time".into(),
            args: obj(json!({"tz":"UTC"})),
            args_error: None,
        },
        ToolCall {
            id: "c2".into(),
            name: "read".into(),
            args: Map::new(),
            args_error: None,
        },
    ];
    vec![
        user("time and file?"),
        Message::assistant_tool_calls(&calls),
        Message::tool_result("c1", "get_time", "12:00", false),
        Message::tool_result("c2", "read", "no such file", true),
    ]
}

#[tokio::test]
async fn openai_tool_results_keep_their_text_and_ids() {
    let server = answering("/chat/completions", openai_text_reply("noon; no file")).await;
    let gw = openai_gateway(&server, json!({}));
    gw.complete(&ask(tool_history())).await.unwrap();
    assert_eq!(
        bodies(&server).await[0]["messages"],
        json!([{"role":"user","content":"time and file?"},
               {"role":"assistant","content":null,"tool_calls":[
                  {"id":"c1","type":"function","function":{"name":"get_time","arguments":"{\"tz\":\"UTC\"}"}},
                  {"id":"c2","type":"function","function":{"name":"read","arguments":"{}"}}]},
               {"role":"tool","tool_call_id":"c1","content":"12:00"},
               {"role":"tool","tool_call_id":"c2","content":"no such file"}])
    );
}

#[tokio::test]
async fn openai_images_go_as_image_url_parts() {
    let server = answering("/chat/completions", openai_text_reply("a cat")).await;
    let gw = openai_gateway(&server, json!({"models":{"m":{"vision":true}}}));
    let inline = "data:image/png;base64,iVBORw0KGgo=";
    let msg = two_images("what is this?", inline, "https://example.invalid/cat.jpg");
    gw.complete(&ask(vec![msg])).await.unwrap();
    assert_eq!(
        bodies(&server).await[0]["messages"],
        json!([{"role":"user","content":[
            {"type":"text","text":"what is this?"},
            {"type":"image_url","image_url":{"url":"data:image/png;base64,iVBORw0KGgo="}},
            {"type":"image_url","image_url":{"url":"https://example.invalid/cat.jpg"}}]}])
    );
}

#[tokio::test]
async fn deepseek_reasoning_and_cache_tokens_round_trip() {
    let server = answering(
        "/chat/completions",
        json!({"model":"deepseek-chat","choices":[{"message":{"role":"assistant",
              "content":"","reasoning_content":"need the time",
              "tool_calls":[{"id":"c1","type":"function",
                  "function":{"name":"get_time","arguments":"{}"}}]},
              "finish_reason":"tool_calls"}],
              "usage":{"prompt_tokens":100,"completion_tokens":20,"total_tokens":120,
                       "prompt_cache_hit_tokens":80,"prompt_cache_miss_tokens":20,
                       "completion_tokens_details":{"reasoning_tokens":12}}}),
    )
    .await;
    let gw = openai_gateway(&server, json!({"vendor":"deepseek"}));
    let first = gw.complete(&ask(vec![user("time?")])).await.unwrap();
    assert_eq!(first.model, "deepseek-chat");
    assert_eq!(
        (
            first.cache_hit_tokens,
            first.cache_miss_tokens,
            first.reasoning_tokens
        ),
        (80, 20, 12)
    );
    assert!((first.cache_hit_rate() - 0.8).abs() < 1e-9);
    assert_eq!(
        first.message.content[0],
        Part::Reasoning {
            family: ReasoningFamily::Openai,
            text: "need the time".into(),
            signature: None,
            redacted: None
        }
    );

    // The next step sends the reasoning back; an Anthropic reasoning part is dropped.
    let mut assistant = first.message.clone();
    assistant.content.push(Part::Reasoning {
        family: ReasoningFamily::Anthropic,
        text: "foreign".into(),
        signature: Some("sig".into()),
        redacted: None,
    });
    assert_eq!(
        assistant_sent_back(&gw, &server, assistant, "c1").await,
        json!({"role":"assistant","content":null,"reasoning_content":"need the time",
               "tool_calls":[{"id":"c1","type":"function",
                              "function":{"name":"get_time","arguments":"{}"}}]})
    );
}

#[tokio::test]
async fn openai_cached_tokens_count_as_hits_and_the_rest_as_misses() {
    let server = answering(
        "/chat/completions",
        json!({"model":"gpt-4o","choices":[{"message":{"content":"ok"},"finish_reason":"stop"}],
               "usage":{"prompt_tokens":2000,"completion_tokens":10,"total_tokens":2010,
                        "prompt_tokens_details":{"cached_tokens":1536},
                        "completion_tokens_details":{"reasoning_tokens":0}}}),
    )
    .await;
    let gw = openai_gateway(&server, json!({}));
    let resp = gw.complete(&ask(vec![user("x")])).await.unwrap();
    assert_eq!(
        (
            resp.prompt_tokens,
            resp.cache_hit_tokens,
            resp.cache_miss_tokens
        ),
        (2000, 1536, 464)
    );
    assert_eq!(resp.total_tokens, 2010);
}

#[tokio::test]
async fn deepseek_thinking_switch_and_effort_aliases_map_natively() {
    let server = answering("/chat/completions", openai_text_reply("ok")).await;
    let gw = openai_gateway(&server, json!({"vendor":"deepseek"}));
    let mut req = ask(vec![user("x")]);
    req.thinking = thinking(None, false);
    req.reasoning_effort = "medium".into();
    gw.complete(&req).await.unwrap();
    req.thinking = thinking(None, true);
    req.reasoning_effort = "ultra".into();
    gw.complete(&req).await.unwrap();
    req.thinking = None;
    req.reasoning_effort = "extreme".into(); // unknown: dropped, not replaced
    gw.complete(&req).await.unwrap();
    let sent = bodies(&server).await;
    let user_only = json!([{"role":"user","content":"x"}]);
    assert_eq!(
        sent[0],
        json!({"model":"m","messages":user_only,"thinking":{"type":"disabled"},
               "reasoning_effort":"high"})
    );
    assert_eq!(
        sent[1],
        json!({"model":"m","messages":user_only,"thinking":{"type":"enabled"},
               "reasoning_effort":"max"})
    );
    assert_eq!(sent[2], json!({"model":"m","messages":user_only}));
}

#[tokio::test]
async fn openai_effort_whitelist_and_max_completion_tokens() {
    let server = answering("/chat/completions", openai_text_reply("ok")).await;
    let gw = openai_gateway(&server, json!({"vendor":"openai"}));
    let mut req = ask(vec![user("x")]);
    req.reasoning_effort = "minimal".into();
    req.max_tokens = Some(100);
    req.thinking = thinking(Some(2048), true);
    gw.complete(&req).await.unwrap();
    req.reasoning_effort = "max".into(); // DeepSeek's level, not OpenAI's: dropped
    gw.complete(&req).await.unwrap();
    let sent = bodies(&server).await;
    assert_eq!(
        sent[0],
        json!({"model":"m","messages":[{"role":"user","content":"x"}],
               "max_completion_tokens":100,"reasoning_effort":"minimal"})
    );
    assert!(sent[1].get("reasoning_effort").is_none());
}

#[tokio::test]
async fn effort_is_matched_as_given_and_sent_unchecked_without_a_declared_whitelist() {
    let deepseek = answering("/chat/completions", openai_text_reply("ok")).await;
    let gw = openai_gateway(&deepseek, json!({"vendor":"deepseek"}));
    let mut req = ask(vec![user("x")]);
    req.reasoning_effort = "HIGH".into(); // not "high" (docs/semantics.md#model-vocabulary)
    let logs = warnings_completing(&gw, &req).await;
    assert_eq!(
        bodies(&deepseek).await[0],
        json!({"model":"m","messages":[{"role":"user","content":"x"}]})
    );
    assert!(logs.contains("dropped (not replaced)"), "{logs}");

    // A local server (vendor generic) declares no whitelist: the value goes as given, with a
    // WARN, instead of being checked against a guessed list.
    let local = answering("/chat/completions", openai_text_reply("ok")).await;
    let gw = openai_gateway(&local, json!({}));
    req.reasoning_effort = "xhigh".into();
    let logs = warnings_completing(&gw, &req).await;
    assert_eq!(
        bodies(&local).await[0],
        json!({"model":"m","messages":[{"role":"user","content":"x"}],"reasoning_effort":"xhigh"})
    );
    assert!(
        logs.contains("declares no reasoning_effort whitelist"),
        "{logs}"
    );

    // A configured whitelist is a declared one.
    let checked = answering("/chat/completions", openai_text_reply("ok")).await;
    let gw = openai_gateway(&checked, json!({"reasoning_efforts":["low","high"]}));
    gw.complete(&req).await.unwrap();
    assert!(bodies(&checked).await[0].get("reasoning_effort").is_none());
}

#[tokio::test]
async fn dashscope_zero_thinking_budget_is_the_provider_default() {
    let server = answering("/chat/completions", openai_text_reply("ok")).await;
    let gw = openai_gateway(&server, json!({"vendor":"dashscope"}));
    let mut req = ask(vec![user("x")]);
    req.thinking = thinking(Some(0), true);
    gw.complete(&req).await.unwrap();
    req.thinking = thinking(Some(2048), true);
    gw.complete(&req).await.unwrap();
    let sent = bodies(&server).await;
    let user_only = json!([{"role":"user","content":"x"}]);
    assert_eq!(
        sent[0],
        json!({"model":"m","messages":user_only,"enable_thinking":true})
    );
    assert_eq!(
        sent[1],
        json!({"model":"m","messages":user_only,"enable_thinking":true,"thinking_budget":2048})
    );
}

// ------------------------------------------------------------------------ Anthropic dialect

#[tokio::test]
async fn anthropic_text_is_sent_natively_and_normalised() {
    let server = answering("/v1/messages", anthropic_text_reply("hello")).await;
    let gw = anthropic_gateway(&server, json!({}), "claude");
    let mut req = ask(vec![
        Message::text(Role::System, "be brief"),
        user("hi"),
        Message::text(Role::Assistant, "hello"),
        user("again"),
    ]);
    req.temperature = Some(0.5);
    let resp = gw.complete(&req).await.unwrap();
    let received = server.received_requests().await.unwrap();
    assert_eq!(received[0].headers.get("x-api-key").unwrap(), ANTHROPIC_KEY);
    assert_eq!(
        received[0].headers.get("anthropic-version").unwrap(),
        "2023-06-01"
    );
    assert!(received[0].headers.get("authorization").is_none());
    assert_eq!(
        received[0].body_json::<Value>().unwrap(),
        json!({"model":"claude","max_tokens":4096,"system":"be brief","temperature":0.5,
               "messages":[
                 {"role":"user","content":[{"type":"text","text":"hi"}]},
                 {"role":"assistant","content":[{"type":"text","text":"hello"}]},
                 {"role":"user","content":[{"type":"text","text":"again"}]}]})
    );
    assert_eq!(
        serde_json::to_value(&resp).unwrap(),
        json!({"model":"claude","content":"hello",
               "message":{"role":"assistant","content":[{"type":"text","text":"hello"}]},
               "stop_reason":"end_turn","prompt_tokens":3,"completion_tokens":2,
               "total_tokens":5,"cache_hit_tokens":0,"cache_miss_tokens":3,
               "reasoning_tokens":0,"provider":"p"})
    );
}

#[tokio::test]
async fn anthropic_several_tool_uses_and_tool_results_with_is_error() {
    let server = answering(
        "/v1/messages",
        json!({"model":"claude","stop_reason":"tool_use","content":[
            {"type":"text","text":"Let me check."},
            {"type":"tool_use","id":"toolu_1","name":"get_time","input":{"tz":"UTC"}},
            {"type":"tool_use","id":"toolu_2","name":"read","input":{}}],
            "usage":{"input_tokens":10,"output_tokens":5}}),
    )
    .await;
    let gw = anthropic_gateway(&server, json!({}), "claude");
    let mut req = ask(tool_history());
    req.tools = vec![ToolSpec {
        name: "get_time".into(),
        description: "now".into(),
        parameters: json!({"type":"object"}),
    }];
    req.tool_choice = Some(json!({"type":"tool","name":"get_time"}));
    let resp = gw.complete(&req).await.unwrap();
    assert_eq!(
        bodies(&server).await[0],
        json!({"model":"claude","max_tokens":4096,
            "tools":[{"name":"get_time","description":"now","input_schema":{"type":"object"}}],
            "tool_choice":{"type":"tool","name":"get_time"},
            "messages":[
              {"role":"user","content":[{"type":"text","text":"time and file?"}]},
              {"role":"assistant","content":[
                 {"type":"tool_use","id":"c1","name":"get_time","input":{"tz":"UTC"}},
                 {"type":"tool_use","id":"c2","name":"read","input":{}}]},
              {"role":"user","content":[
                 {"type":"tool_result","tool_use_id":"c1","content":"12:00"},
                 {"type":"tool_result","tool_use_id":"c2","content":"no such file",
                  "is_error":true}]}]})
    );
    assert_eq!(resp.stop_reason, "tool_use");
    assert_eq!(resp.content, "Let me check.");
    assert_eq!(
        serde_json::to_value(&resp.tool_calls).unwrap(),
        json!([{"id":"toolu_1","name":"get_time","args":{"tz":"UTC"}},
               {"id":"toolu_2","name":"read","args":{}}])
    );
    assert_eq!(resp.message.content.len(), 3);
}

#[tokio::test]
async fn anthropic_images_use_base64_and_url_sources() {
    let server = answering("/v1/messages", anthropic_text_reply("a cat")).await;
    let gw = anthropic_gateway(&server, json!({}), "claude");
    let inline = "data:image/jpeg;base64,/9j/4AAQ";
    let images = ask(vec![two_images(
        "what?",
        inline,
        "https://example.invalid/cat.png",
    )]);
    gw.complete(&images).await.unwrap();
    let sent = bodies(&server).await;
    assert_eq!(
        sent[0]["messages"],
        json!([{"role":"user","content":[
            {"type":"text","text":"what?"},
            {"type":"image","source":{"type":"base64","media_type":"image/jpeg","data":"/9j/4AAQ"}},
            {"type":"image","source":{"type":"url","url":"https://example.invalid/cat.png"}}]}])
    );
}

#[tokio::test]
async fn anthropic_thinking_blocks_round_trip_with_signatures() {
    let server = answering(
        "/v1/messages",
        json!({"model":"claude","stop_reason":"tool_use","content":[
            {"type":"thinking","thinking":"I should look","signature":"sig-1"},
            {"type":"redacted_thinking","data":"opaque"},
            {"type":"tool_use","id":"toolu_1","name":"get_time","input":{}}],
            "usage":{"input_tokens":10,"output_tokens":5}}),
    )
    .await;
    let gw = anthropic_gateway(&server, json!({}), "claude");
    let first = gw.complete(&ask(vec![user("time?")])).await.unwrap();
    assert_eq!(
        serde_json::to_value(&first.message.content).unwrap(),
        json!([{"type":"reasoning","family":"anthropic","text":"I should look","signature":"sig-1"},
               {"type":"reasoning","family":"anthropic","redacted":"opaque"},
               {"type":"tool_call","id":"toolu_1","name":"get_time","args":{}}])
    );
    let mut assistant = first.message.clone();
    assistant.content.insert(
        0,
        Part::Reasoning {
            family: ReasoningFamily::Openai,
            text: "deepseek thoughts".into(),
            signature: None,
            redacted: None,
        },
    );
    assert_eq!(
        assistant_sent_back(&gw, &server, assistant, "toolu_1").await,
        json!({"role":"assistant","content":[
            {"type":"thinking","thinking":"I should look","signature":"sig-1"},
            {"type":"redacted_thinking","data":"opaque"},
            {"type":"tool_use","id":"toolu_1","name":"get_time","input":{}}]})
    );
}

#[tokio::test]
async fn anthropic_cache_read_and_creation_tokens_normalise() {
    let server = answering(
        "/v1/messages",
        json!({"model":"claude","stop_reason":"end_turn","content":[{"type":"text","text":"ok"}],
               "usage":{"input_tokens":50,"output_tokens":7,"cache_read_input_tokens":900,
                        "cache_creation_input_tokens":50}}),
    )
    .await;
    let gw = anthropic_gateway(&server, json!({}), "claude");
    let resp = gw.complete(&ask(vec![user("x")])).await.unwrap();
    assert_eq!(
        (
            resp.cache_hit_tokens,
            resp.cache_miss_tokens,
            resp.prompt_tokens,
            resp.completion_tokens,
            resp.total_tokens
        ),
        (900, 100, 1000, 7, 1007)
    );
    assert!((resp.cache_hit_rate() - 0.9).abs() < 1e-9);
}

#[tokio::test]
async fn anthropic_thinking_budget_adaptive_and_effort_map_per_model() {
    let server = answering("/v1/messages", anthropic_text_reply("ok")).await;
    let gw = anthropic_gateway(
        &server,
        json!({"models":{"claude":{},"claude-new":{"thinking":"adaptive"}}}),
        "claude",
    );
    let mut req = ask(vec![user("x")]);
    req.thinking = thinking(Some(8000), true);
    req.reasoning_effort = "high".into();
    gw.complete(&req).await.unwrap();
    req.model = "claude-new".into();
    req.reasoning_effort = "ultra".into(); // unknown here: dropped
    gw.complete(&req).await.unwrap();
    req.thinking = thinking(None, false);
    req.max_tokens = Some(100);
    req.reasoning_effort = String::new();
    gw.complete(&req).await.unwrap();
    let sent = bodies(&server).await;
    let msgs = json!([{"role":"user","content":[{"type":"text","text":"x"}]}]);
    assert_eq!(
        sent[0],
        json!({"model":"claude","max_tokens":12096,"messages":msgs,
               "thinking":{"type":"enabled","budget_tokens":8000},
               "output_config":{"effort":"high"}})
    );
    assert_eq!(
        sent[1],
        json!({"model":"claude-new","max_tokens":4096,"messages":msgs,
               "thinking":{"type":"adaptive"}})
    );
    assert_eq!(
        sent[2],
        json!({"model":"claude-new","max_tokens":100,"messages":msgs,
               "thinking":{"type":"disabled"}})
    );
}

#[tokio::test]
async fn anthropic_zero_thinking_budget_is_the_default_budget() {
    let server = answering("/v1/messages", anthropic_text_reply("ok")).await;
    let gw = anthropic_gateway(&server, json!({}), "claude");
    let mut req = ask(vec![user("x")]);
    req.thinking = thinking(Some(0), true);
    gw.complete(&req).await.unwrap();
    assert_eq!(
        bodies(&server).await[0],
        json!({"model":"claude","max_tokens":4096,
               "messages":[{"role":"user","content":[{"type":"text","text":"x"}]}],
               "thinking":{"type":"enabled","budget_tokens":1024}})
    );
}

#[tokio::test]
async fn anthropic_thinking_budgets_it_cannot_send_are_warned_about() {
    let server = answering("/v1/messages", anthropic_text_reply("ok")).await;
    let gw = anthropic_gateway(
        &server,
        json!({"models":{"claude-new":{"thinking":"adaptive"}}}),
        "claude-new",
    );
    let mut req = ask(vec![user("x")]);
    req.thinking = thinking(Some(3000), true);
    let logs = warnings_completing(&gw, &req).await;
    assert_eq!(
        bodies(&server).await[0]["thinking"],
        json!({"type":"adaptive"})
    );
    assert!(logs.contains("WARN"), "{logs}");
    assert!(
        logs.contains("budget_tokens not sent: this model thinks adaptively"),
        "{logs}"
    );

    req.thinking = thinking(Some(3000), false);
    let logs = warnings_completing(&gw, &req).await;
    assert_eq!(
        bodies(&server).await[1]["thinking"],
        json!({"type":"disabled"})
    );
    assert!(
        logs.contains("budget_tokens not sent: thinking is disabled"),
        "{logs}"
    );

    // Nothing dropped, nothing to warn about.
    req.thinking = thinking(None, true);
    let logs = warnings_completing(&gw, &req).await;
    assert!(!logs.contains("budget_tokens"), "{logs}");
}

#[tokio::test]
async fn anthropic_tool_choice_is_sent_exactly_as_given() {
    let server = answering("/v1/messages", anthropic_text_reply("ok")).await;
    let gw = anthropic_gateway(&server, json!({}), "claude");
    let mut req = ask(vec![user("x")]);
    req.tools = vec![ToolSpec {
        name: "get_time".into(),
        description: String::new(),
        parameters: json!({"type":"object"}),
    }];
    let choices = [
        json!({"type":"any"}),
        json!({"type":"tool","name":"get_time","disable_parallel_tool_use":true}),
        // Not this dialect's forms: still sent as given (docs/semantics.md#model-vocabulary), for
        // the provider to judge.
        json!("required"),
        json!({"type":"function","function":{"name":"get_time"}}),
    ];
    for choice in &choices {
        req.tool_choice = Some(choice.clone());
        gw.complete(&req).await.unwrap();
    }
    let sent = bodies(&server).await;
    for (body, choice) in sent.iter().zip(&choices) {
        assert_eq!(&body["tool_choice"], choice);
    }
}

#[tokio::test]
async fn anthropic_system_messages_inside_the_conversation_keep_their_position() {
    let server = answering("/v1/messages", anthropic_text_reply("ok")).await;
    let gw = anthropic_gateway(&server, json!({}), "claude");
    let lead = "[会话角色] 你正以「cyrene」的身份对话。";
    let to_owner =
        "[发言归属] 以下发言来自主人（管理员账户）本人，不是你说的，也不是本会话里的第三方人员。";
    let to_hoshi = "[发言归属] 以下发言来自「hoshi」，不是你说的。";
    let to_ming = "[发言归属] 以下发言来自「阿明」——本会话里的第三方人员（非管理员账户），不是主人，也不是你说的。";
    let req = ask(vec![
        Message::text(Role::System, "instructions"),
        Message::text(Role::System, lead),
        Message::text(Role::System, to_owner),
        user("hello"),
        Message::text(Role::System, to_hoshi),
        Message::text(Role::Assistant, "hi, hoshi here").sender("hoshi"),
        Message::text(Role::System, to_ming),
        Message::text(Role::User, "hey all").sender("阿明"),
        Message::text(Role::System, to_owner),
        user("who spoke last?"),
    ]);
    gw.complete(&req).await.unwrap();
    let text = |t: &str| json!({"type":"text","text":t});
    assert_eq!(
        bodies(&server).await[0],
        json!({"model":"claude","max_tokens":4096,
               // Every note keeps its place, the first one too: it opens the conversation
               // (issue 30, H1), so no message can come after it unannounced.
               "system":format!("instructions\n\n{lead}"),
               "messages":[
                 {"role":"user","content":[text(to_owner), text("hello"), text(to_hoshi)]},
                 {"role":"assistant","content":[text("hi, hoshi here")]},
                 {"role":"user","content":[text(to_ming), text("hey all"), text(to_owner),
                                           text("who spoke last?")]}]})
    );
}

// ------------------------------------------------------------------------ routing and fallback

async fn failing(status: u16, body: Value, retry_after: Option<&str>) -> MockServer {
    let server = MockServer::start().await;
    let mut template = ResponseTemplate::new(status).set_body_json(body);
    if let Some(after) = retry_after {
        template = template.insert_header("retry-after", after);
    }
    Mock::given(method("POST"))
        .respond_with(template)
        .mount(&server)
        .await;
    server
}

/// An openai provider (the whole active chain) and an anthropic one, named as given, with
/// `extra` top-level fields (a vision chain, persona chains).
fn openai_and_anthropic(
    (openai, openai_server): (&str, &MockServer),
    (anthropic, anthropic_server): (&str, &MockServer),
    extra: Value,
) -> Value {
    let mut config = json!({
        "providers":{openai:openai_provider(openai_server, json!({})),
                     anthropic:anthropic_provider(anthropic_server, json!({}))},
        "groups":{"g":[{"provider":openai,"model":"m"}]},
        "active_group":"g"});
    merge(&mut config, extra);
    config
}

fn chain_of(servers: &[(&str, &MockServer)], extra: Value) -> Value {
    let mut providers = Map::new();
    let mut chain = Vec::new();
    for (name, server) in servers {
        providers.insert((*name).into(), openai_provider(server, extra.clone()));
        chain.push(json!({"provider":name,"model":"m"}));
    }
    json!({"providers":providers,"groups":{"g":chain},"active_group":"g"})
}

#[tokio::test]
async fn fallback_tries_the_chain_in_order_on_5xx_and_429() {
    let a = failing(500, json!({"error":{"message":"boom"}}), None).await;
    let b = failing(429, json!({"error":{"message":"slow down"}}), None).await;
    let c = answering("/chat/completions", openai_text_reply("from c")).await;
    let gw = gateway(chain_of(&[("a", &a), ("b", &b), ("c", &c)], json!({})));
    let resp = gw.complete(&ask(vec![user("x")])).await.unwrap();
    assert_eq!(resp.provider, "c");
    assert_eq!(resp.content, "from c");
    assert_eq!((hits(&a).await, hits(&b).await, hits(&c).await), (1, 1, 1));
}

#[tokio::test]
async fn every_step_failing_is_unavailable_with_each_cause() {
    let a = failing(503, json!({"error":{"message":"overloaded"}}), None).await;
    let b = failing(502, json!({"error":{"message":"bad gateway"}}), None).await;
    let gw = gateway(chain_of(&[("a", &a), ("b", &b)], json!({})));
    let err = gw.complete(&ask(vec![user("x")])).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Unavailable);
    assert_names(&err.message, "a/m: HTTP 503: overloaded");
    assert_names(&err.message, "b/m: HTTP 502: bad gateway");
}

#[tokio::test]
async fn a_400_is_returned_at_once_with_the_provider_message() {
    let a = failing(
        400,
        json!({"error":{"message":"messages: tool result without call","type":"invalid_request_error"}}),
        None,
    )
    .await;
    let b = answering("/chat/completions", openai_text_reply("never")).await;
    let gw = gateway(chain_of(&[("a", &a), ("b", &b)], json!({})));
    let err = gw.complete(&ask(vec![user("x")])).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Upstream);
    assert_names(
        &err.message,
        "HTTP 400: invalid_request_error: messages: tool result without call",
    );
    assert_eq!(hits(&b).await, 0);
}

#[tokio::test]
async fn a_provider_cools_down_after_consecutive_failures() {
    let a = failing(500, json!({}), None).await;
    let b = answering("/chat/completions", openai_text_reply("b")).await;
    let gw = gateway(chain_of(
        &[("a", &a), ("b", &b)],
        json!({"cooldown":{"failures":2,"cooldown_ms":600000}}),
    ));
    for _ in 0..4 {
        assert_eq!(
            gw.complete(&ask(vec![user("x")])).await.unwrap().provider,
            "b"
        );
    }
    // Two failures start the cooldown; the next two requests skip `a`.
    assert_eq!(hits(&a).await, 2);
    assert_eq!(hits(&b).await, 4);
}

#[tokio::test]
async fn retry_after_starts_a_cooldown_at_once() {
    let a = failing(429, json!({"error":{"message":"rate"}}), Some("30")).await;
    let b = answering("/chat/completions", openai_text_reply("b")).await;
    let gw = gateway(chain_of(&[("a", &a), ("b", &b)], json!({})));
    for _ in 0..3 {
        assert_eq!(
            gw.complete(&ask(vec![user("x")])).await.unwrap().provider,
            "b"
        );
    }
    assert_eq!(hits(&a).await, 1);
}

#[tokio::test]
async fn a_chain_that_is_all_cooling_down_is_still_tried() {
    let a = failing(429, json!({"error":{"message":"rate"}}), Some("30")).await;
    let gw = gateway(chain_of(&[("a", &a)], json!({})));
    for _ in 0..2 {
        let err = gw.complete(&ask(vec![user("x")])).await.unwrap_err();
        assert_eq!(err.code, ErrorCode::Unavailable);
    }
    assert_eq!(hits(&a).await, 2);
}

#[tokio::test]
async fn image_requests_go_to_a_vision_step_or_the_vision_chain() {
    let text = answering("/chat/completions", openai_text_reply("text")).await;
    let eyes = answering("/v1/messages", anthropic_text_reply("eyes")).await;
    let vision = json!({"vision":[{"provider":"eyes","model":"claude"}]});
    let gw = gateway(openai_and_anthropic(
        ("text", &text),
        ("eyes", &eyes),
        vision,
    ));
    let plain = gw.complete(&ask(vec![user("hi")])).await.unwrap();
    assert_eq!(plain.provider, "text");
    let img = Message::image(Role::User, "see", "https://example.invalid/a.png");
    let seen = gw.complete(&ask(vec![img])).await.unwrap();
    assert_eq!(seen.provider, "eyes");
    assert_eq!(seen.content, "eyes");
    assert_eq!((hits(&text).await, hits(&eyes).await), (1, 1));
}

#[tokio::test]
async fn persona_chains_and_model_overrides_pick_their_providers() {
    let main = answering("/chat/completions", openai_text_reply("main")).await;
    let claude = answering("/v1/messages", anthropic_text_reply("claude")).await;
    let personas = json!({"persona_providers":{"hoshi":[{"provider":"claude","model":"claude"}]}});
    let gw = gateway(openai_and_anthropic(
        ("main", &main),
        ("claude", &claude),
        personas,
    ));
    let mut req = ask(vec![user("hi")]);
    assert_eq!(gw.complete(&req).await.unwrap().provider, "main");
    req.persona_id = "hoshi".into();
    assert_eq!(gw.complete(&req).await.unwrap().provider, "claude");
    req.persona_id = "someone-else".into();
    assert_eq!(gw.complete(&req).await.unwrap().provider, "main");
    req.model = "claude".into();
    assert_eq!(gw.complete(&req).await.unwrap().provider, "claude");
    req.model = "nope".into();
    assert_eq!(
        gw.complete(&req).await.unwrap_err().code,
        ErrorCode::BadRequest
    );
}

#[tokio::test]
async fn a_slow_provider_times_out_and_the_next_step_answers() {
    let slow = slow_upstream().await;
    let fast = answering("/chat/completions", openai_text_reply("fast")).await;
    let mut config = chain_of(&[("slow", &slow), ("fast", &fast)], json!({}));
    config["providers"]["slow"]["timeout_ms"] = json!(200);
    let gw = gateway(config);
    let resp = gw.complete(&ask(vec![user("x")])).await.unwrap();
    assert_eq!(resp.provider, "fast");
}

#[tokio::test]
async fn the_request_deadline_bounds_the_whole_call() {
    let slow = slow_upstream().await;
    let never = answering("/chat/completions", openai_text_reply("never")).await;
    let gw = gateway(chain_of(&[("slow", &slow), ("never", &never)], json!({})));
    let mut req = ask(vec![user("x")]);
    req.total_timeout_ms = Some(200);
    let err = gw.complete(&req).await.unwrap_err();
    assert_eq!(err.code, ErrorCode::Timeout);
    assert_names(&err.message, "slow/m: no answer within");
    assert_names(&err.message, "never/m: not tried");
    assert_eq!(hits(&never).await, 0);
}

async fn slow_then_fast() -> (MockServer, MockServer) {
    let slow = slow_upstream().await;
    let fast = answering("/chat/completions", openai_text_reply("fast")).await;
    (slow, fast)
}

#[tokio::test]
async fn the_request_timeout_bounds_one_call_and_each_step_gets_its_own() {
    let (slow, fast) = slow_then_fast().await;
    let gw = gateway(chain_of(&[("slow", &slow), ("fast", &fast)], json!({})));
    let mut req = ask(vec![user("x")]);
    req.timeout_ms = Some(300); // docs/semantics.md#model-vocabulary: one HTTP call, not the chain
    let resp = gw.complete(&req).await.unwrap();
    assert_eq!(resp.provider, "fast");
    assert_eq!((hits(&slow).await, hits(&fast).await), (1, 1));

    // It overrides the provider's own timeout for that call.
    let (slow, fast) = slow_then_fast().await;
    let mut config = chain_of(&[("slow", &slow), ("fast", &fast)], json!({}));
    config["providers"]["slow"]["timeout_ms"] = json!(60_000);
    let gw = gateway(config);
    let resp = gw.complete(&req).await.unwrap();
    assert_eq!(resp.provider, "fast");
}

#[tokio::test]
async fn a_zero_request_timeout_is_the_provider_default() {
    let (slow, fast) = slow_then_fast().await;
    let mut config = chain_of(&[("slow", &slow), ("fast", &fast)], json!({}));
    config["providers"]["slow"]["timeout_ms"] = json!(200);
    let gw = gateway(config);
    let mut req = ask(vec![user("x")]);
    req.timeout_ms = Some(0);
    req.total_timeout_ms = Some(0);
    let resp = gw.complete(&req).await.unwrap();
    assert_eq!(resp.provider, "fast");
}

#[tokio::test]
async fn a_connection_refused_falls_back() {
    // A port nobody listens on: bind, read the port, drop the listener.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let ok = answering("/chat/completions", openai_text_reply("ok")).await;
    let gw = gateway(json!({
        "providers":{"dead":{"protocol":"openai","base_url":format!("http://127.0.0.1:{port}"),
                             "models":{"m":{}}},
                     "ok":openai_provider(&ok, json!({}))},
        "groups":{"g":[{"provider":"dead","model":"m"},{"provider":"ok","model":"m"}]},
        "active_group":"g"}));
    let resp = gw.complete(&ask(vec![user("x")])).await.unwrap();
    assert_eq!(resp.provider, "ok");
}

#[tokio::test]
async fn api_keys_never_show_in_debug_output() {
    let server = MockServer::start().await;
    let gw = gateway(json!({
        "providers":{"a":openai_provider(&server, json!({})),
                     "b":anthropic_provider(&server, json!({}))},
        "groups":{"g":[{"provider":"a","model":"m"}]},"active_group":"g"}));
    let shown = format!("{gw:?}");
    assert!(shown.contains("<redacted>"));
    assert!(!shown.contains(OPENAI_KEY));
    assert!(!shown.contains(ANTHROPIC_KEY));
}

#[tokio::test]
async fn scripted_responses_are_marked_offline() {
    let gw = gateway(serde_json::to_value(ModelsConfig::offline()).unwrap());
    let log = gw.request_log("offline").unwrap();
    let resp: ModelResponse = gw.complete(&ask(vec![user("ping")])).await.unwrap();
    assert!(resp.offline);
    assert_eq!(resp.provider, "offline");
    assert_eq!(resp.content, "(offline scripted reply) You said: ping");
    assert_eq!(log.len(), 1);
}

/// `max_tokens: 0` is the provider's default (docs/semantics.md#model-vocabulary): OpenAI's
/// dialect sends no limit, Anthropic's the default it sends when none is given.
#[tokio::test]
async fn zero_max_tokens_is_the_providers_default_in_both_dialects() {
    let server = answering("/chat/completions", openai_text_reply("hello")).await;
    let gw = openai_gateway(&server, json!({}));
    let mut req = ask(vec![user("hi")]);
    req.max_tokens = Some(0);
    gw.complete(&req).await.unwrap();
    let sent = bodies(&server).await;
    assert_eq!(
        sent[0],
        json!({"model":"m","messages":[{"role":"user","content":"hi"}]})
    );

    let server = answering("/v1/messages", anthropic_text_reply("ok")).await;
    let gw = anthropic_gateway(&server, json!({}), "claude");
    gw.complete(&req).await.unwrap();
    let sent = bodies(&server).await;
    assert_eq!(sent[0]["max_tokens"], json!(4096));
}
