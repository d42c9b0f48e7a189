//! Provider streaming against real HTTP mock upstreams (wiremock serving `text/event-stream`):
//! both dialects' events put back into the same response as the non-streamed call, the deltas in
//! order, fallback only before the first delta — and the streamed variant over a real
//! nats-server (`cyrene.model.complete.stream`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use common::{bodies, call_records, hits};
use cyrene_bus::RequestError;
use cyrene_bus::service::ServeOptions;
use cyrene_model_client::complete_stream;
use cyrene_model_gateway::Gateway;
use cyrene_model_gateway::config::{ModelsConfig, Secrets};
use cyrene_model_gateway::providers::DeltaSink;
use cyrene_protocol::message::{Message, Part, ReasoningFamily, Role};
use cyrene_protocol::model::{CallRecord, ModelRequest, ModelResponse, ViewRef};
use cyrene_protocol::stream::{Delta, StreamChunk};
use cyrene_protocol::subjects::{self, MODEL_COMPLETE_STREAM};
use cyrene_protocol::{ErrorBody, ErrorCode};
use cyrene_test_support::NatsServer;
use futures::StreamExt;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

const WAIT: Duration = Duration::from_secs(10);

fn gateway(config: Value) -> Gateway {
    let models: ModelsConfig = serde_json::from_value(config).unwrap();
    Gateway::new(
        models,
        &Secrets::default(),
        cyrene_model_gateway::http_client().unwrap(),
    )
    .unwrap()
}

fn ask(text: &str) -> ModelRequest {
    ModelRequest {
        messages: vec![Message::text(Role::User, text)],
        ..Default::default()
    }
}

/// An SSE body: one `data:` event per value (strings verbatim, e.g. `[DONE]`).
fn sse(events: &[Value]) -> String {
    events
        .iter()
        .map(|e| match e {
            Value::String(s) => format!("data: {s}\n\n"),
            other => format!("data: {other}\n\n"),
        })
        .collect()
}

/// Anthropic's form: `event:` lines too.
fn sse_named(events: &[Value]) -> String {
    events
        .iter()
        .map(|e| format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap()))
        .collect()
}

/// A mock openai-protocol upstream that streams `chunks` on every `/chat/completions` call.
async fn openai_streaming(chunks: &[Value]) -> MockServer {
    streaming("/chat/completions", sse(chunks)).await
}

/// A mock upstream that streams `body` (server-sent events) on every POST to `route`.
async fn streaming(route: &str, body: String) -> MockServer {
    let server = MockServer::start().await;
    streams(&server, route, body).await;
    server
}

async fn streams(server: &MockServer, route: &str, body: String) {
    Mock::given(method("POST"))
        .and(path(route))
        .respond_with(ResponseTemplate::new(200).set_body_raw(body, "text/event-stream"))
        .mount(server)
        .await;
}

fn openai(server: &MockServer) -> Value {
    json!({"protocol":"openai","base_url":server.uri(),"vendor":"deepseek","models":{"m":{}}})
}

fn chain(providers: &[(&str, Value, &str)]) -> Value {
    let mut map = serde_json::Map::new();
    let mut steps = Vec::new();
    for (name, p, model) in providers {
        map.insert((*name).to_owned(), p.clone());
        steps.push(json!({"provider":name,"model":model}));
    }
    json!({"providers":map,"groups":{"g":steps},"active_group":"g"})
}

/// Runs a streamed call, collecting every delta.
async fn stream_call(
    gw: &Gateway,
    req: &ModelRequest,
) -> (Result<ModelResponse, ErrorBody>, Vec<Delta>) {
    let (sink, mut rx) = DeltaSink::new();
    let result = gw.complete_stream(req, &sink).await;
    drop(sink);
    let mut deltas = Vec::new();
    while let Some(d) = rx.recv().await {
        deltas.push(d);
    }
    (result, deltas)
}

fn texts(deltas: &[Delta]) -> String {
    deltas
        .iter()
        .filter_map(|d| match d {
            Delta::Text { text } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

fn openai_chunk(delta: Value, finish: Option<&str>) -> Value {
    json!({"id":"c","model":"m-2025","choices":[{"index":0,"delta":delta,"finish_reason":finish}]})
}

#[tokio::test]
async fn openai_stream_asks_for_usage_and_adds_up_to_the_non_streamed_response() {
    let server = MockServer::start().await;
    let usage = json!({"prompt_tokens":100,"completion_tokens":7,"total_tokens":107,
                       "prompt_cache_hit_tokens":60,"prompt_cache_miss_tokens":40,
                       "completion_tokens_details":{"reasoning_tokens":3}});
    streams(
        &server,
        "/chat/completions",
        sse(&[
            openai_chunk(json!({"role":"assistant","content":""}), None),
            openai_chunk(json!({"reasoning_content":"think "}), None),
            openai_chunk(json!({"reasoning_content":"hard"}), None),
            openai_chunk(json!({"content":"Hel"}), None),
            openai_chunk(json!({"content":"lo, "}), None),
            openai_chunk(json!({"content":"world"}), Some("stop")),
            json!({"id":"c","model":"m-2025","choices":[],"usage":usage}),
            json!("[DONE]"),
        ]),
    )
    .await;
    let gw = gateway(chain(&[("p", openai(&server), "m")]));
    let (resp, deltas) = stream_call(&gw, &ask("hi")).await;
    let resp = resp.unwrap();
    assert_eq!(texts(&deltas), "Hello, world");
    assert_eq!(resp.content, "Hello, world");
    assert_eq!(
        deltas[0],
        Delta::Reasoning {
            text: "think ".into()
        },
        "the empty role chunk is no delta"
    );
    // The same response the non-streamed reply with these totals decodes to.
    let whole = cyrene_model_gateway::providers::openai::decode(
        &json!({"model":"m-2025","choices":[{"message":{
            "content":"Hello, world","reasoning_content":"think hard"},"finish_reason":"stop"}],
            "usage":usage}),
        "m",
    )
    .unwrap();
    assert_eq!(
        ModelResponse {
            provider: String::new(),
            ..resp.clone()
        },
        whole
    );
    assert_eq!((resp.cache_hit_tokens, resp.cache_miss_tokens), (60, 40));
    assert_eq!(resp.reasoning_tokens, 3);
    assert_eq!(resp.provider, "p");
    let sent = &bodies(&server).await[0];
    assert_eq!(sent["stream"], json!(true));
    assert_eq!(sent["stream_options"], json!({"include_usage":true}));
}

#[tokio::test]
async fn openai_streamed_tool_call_arguments_are_assembled_and_decoded() {
    let server = MockServer::start().await;
    let call = |index: u64, id: Option<&str>, name: Option<&str>, args: &str| {
        let mut c = json!({"index":index,"function":{"arguments":args}});
        if let Some(id) = id {
            c["id"] = json!(id);
            c["type"] = json!("function");
        }
        if let Some(name) = name {
            c["function"]["name"] = json!(name);
        }
        openai_chunk(json!({"tool_calls":[c]}), None)
    };
    streams(
        &server,
        "/chat/completions",
        sse(&[
            call(0, Some("call_a"), Some("get_time"), ""),
            call(0, None, None, "{\"tz\":"),
            call(0, None, None, "\"UTC\"}"),
            call(
                1,
                Some("call_b"),
                Some("get_weather"),
                "{\"city\":\"Oslo\"}",
            ),
            call(2, Some("call_c"), Some("broken"), "{\"x\":"),
            openai_chunk(json!({}), Some("tool_calls")),
            json!("[DONE]"),
        ]),
    )
    .await;
    let gw = gateway(chain(&[("p", openai(&server), "m")]));
    let (resp, deltas) = stream_call(&gw, &ask("time?")).await;
    let resp = resp.unwrap();
    assert_eq!(resp.stop_reason, "tool_calls");
    assert_eq!(resp.tool_calls.len(), 3);
    assert_eq!(resp.tool_calls[0].id, "call_a");
    assert_eq!(resp.tool_calls[0].args["tz"], "UTC");
    assert_eq!(resp.tool_calls[1].args["city"], "Oslo");
    assert!(resp.tool_calls[2].args_error.is_some());
    assert_eq!(
        deltas[1],
        Delta::ToolCall {
            index: 0,
            id: String::new(),
            name: String::new(),
            args: "{\"tz\":".into()
        }
    );
}

#[tokio::test]
async fn anthropic_stream_keeps_thinking_signatures_tool_input_and_usage() {
    let server = MockServer::start().await;
    let ev = |v: Value| v;
    streams(
        &server,
        "/v1/messages",
        sse_named(&[
            ev(json!({"type":"message_start","message":{"id":"msg","model":"claude-x","content":[],
                "usage":{"input_tokens":10,"cache_read_input_tokens":50,"cache_creation_input_tokens":5,"output_tokens":1}}})),
            ev(json!({"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}})),
            ev(json!({"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"Let me "}})),
            ev(json!({"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"see."}})),
            ev(json!({"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"SIG"}})),
            ev(json!({"type":"content_block_stop","index":0})),
            ev(json!({"type":"ping"})),
            ev(json!({"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}})),
            ev(json!({"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"Checking "}})),
            ev(json!({"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"now."}})),
            ev(json!({"type":"content_block_stop","index":1})),
            ev(json!({"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"toolu_1","name":"get_time","input":{}}})),
            ev(json!({"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":""}})),
            ev(json!({"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\"tz\": \"U"}})),
            ev(json!({"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"TC\"}"}})),
            ev(json!({"type":"content_block_stop","index":2})),
            ev(json!({"type":"message_delta","delta":{"stop_reason":"tool_use"},"usage":{"output_tokens":42}})),
            ev(json!({"type":"message_stop"})),
        ]),
    )
    .await;
    let p = json!({"protocol":"anthropic","base_url":server.uri(),"models":{"claude":{}}});
    let gw = gateway(chain(&[("a", p, "claude")]));
    let (resp, deltas) = stream_call(&gw, &ask("time?")).await;
    let resp = resp.unwrap();
    assert_eq!(texts(&deltas), "Checking now.");
    assert_eq!(resp.content, "Checking now.");
    assert_eq!(resp.model, "claude-x");
    assert_eq!(resp.stop_reason, "tool_use");
    assert_eq!(
        resp.message.content[0],
        Part::Reasoning {
            family: ReasoningFamily::Anthropic,
            text: "Let me see.".into(),
            signature: Some("SIG".into()),
            redacted: None
        }
    );
    assert_eq!(resp.tool_calls[0].id, "toolu_1");
    assert_eq!(resp.tool_calls[0].args["tz"], "UTC");
    // hits = cache reads; misses = input + cache creation; completion from message_delta.
    assert_eq!((resp.cache_hit_tokens, resp.cache_miss_tokens), (50, 15));
    assert_eq!((resp.prompt_tokens, resp.completion_tokens), (65, 42));
    assert!(deltas.contains(&Delta::Reasoning {
        text: "Let me ".into()
    }));
    assert!(deltas.contains(&Delta::ToolCall {
        index: 0,
        id: "toolu_1".into(),
        name: "get_time".into(),
        args: String::new()
    }));
    assert_eq!(bodies(&server).await[0]["stream"], json!(true));
}

#[tokio::test]
async fn a_provider_failing_after_its_first_delta_is_an_error_not_a_fallback() {
    // The stream stops after one delta (no finish_reason, no [DONE]): a connection cut mid-way.
    let cut = openai_streaming(&[openai_chunk(json!({"content":"Half an"}), None)]).await;
    // The provider reports an error inside the stream after some text.
    let erroring = openai_streaming(&[
        openai_chunk(json!({"content":"Half"}), None),
        json!({"error":{"message":"overloaded","type":"server_error"}}),
    ])
    .await;
    for broken in [&cut, &erroring] {
        let backup = openai_streaming(&[
            openai_chunk(json!({"content":"whole"}), Some("stop")),
            json!("[DONE]"),
        ])
        .await;
        let gw = gateway(chain(&[
            ("a", openai(broken), "m"),
            ("b", openai(&backup), "m"),
        ]));
        let (resp, deltas) = stream_call(&gw, &ask("hi")).await;
        let err = resp.unwrap_err();
        assert_eq!(err.code, ErrorCode::Unavailable, "{}", err.message);
        assert!(
            err.message.contains("after its output started"),
            "{}",
            err.message
        );
        assert_eq!(hits(&backup).await, 0, "no fallback once output went out");
        assert!(texts(&deltas).starts_with("Half"));
    }
}

#[tokio::test]
async fn a_provider_failing_before_its_first_delta_falls_back() {
    let down = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(503).set_body_json(json!({"error":{"message":"busy"}})))
        .mount(&down)
        .await;
    // Only the role chunk arrives, then the stream ends: no output yet, so the next step runs.
    let silent = openai_streaming(&[openai_chunk(json!({"role":"assistant"}), None)]).await;
    let backup = openai_streaming(&[
        openai_chunk(json!({"content":"from b"}), Some("stop")),
        json!("[DONE]"),
    ])
    .await;
    let gw = gateway(chain(&[
        ("a", openai(&down), "m"),
        ("b", openai(&silent), "m"),
        ("c", openai(&backup), "m"),
    ]));
    let (resp, deltas) = stream_call(&gw, &ask("hi")).await;
    let resp = resp.unwrap();
    assert_eq!(resp.provider, "c");
    assert_eq!(texts(&deltas), "from b");
    assert_eq!(
        (hits(&down).await, hits(&silent).await, hits(&backup).await),
        (1, 1, 1)
    );
}

#[tokio::test]
async fn a_server_that_ignores_stream_true_is_read_as_a_whole_reply() {
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(ResponseTemplate::new(200).set_body_json(json!({
            "model":"m","choices":[{"message":{"role":"assistant","content":"all at once"},
                                    "finish_reason":"stop"}],
            "usage":{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7}})))
        .mount(&server)
        .await;
    let gw = gateway(chain(&[("p", openai(&server), "m")]));
    let (resp, deltas) = stream_call(&gw, &ask("hi")).await;
    let resp = resp.unwrap();
    assert_eq!(resp.content, "all at once");
    assert_eq!(resp.total_tokens, 7);
    assert_eq!(texts(&deltas), "all at once");
}

// ------------------------------------------------------------------------ over a real nats-server

struct Running {
    log: cyrene_model_gateway::providers::scripted::RequestLog,
    _server: NatsServer,
    _upstream: MockServer,
    client: async_nats::Client,
    shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

async fn start_bus() -> Running {
    let upstream = openai_streaming(&[
        openai_chunk(json!({"content":"one "}), None),
        openai_chunk(json!({"content":"two "}), None),
        openai_chunk(json!({"content":"three"}), Some("stop")),
        json!({"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6,
            "prompt_tokens_details":{"cached_tokens":2}}}),
        json!("[DONE]"),
    ])
    .await;
    let gw = Arc::new(gateway(json!({
        "providers":{
          "offline":{"protocol":"scripted","models":{"scripted":{}}},
          "http":{"protocol":"openai","base_url":upstream.uri(),"models":{"m":{}}}},
        "groups":{"g":[{"provider":"offline","model":"scripted"}]},
        "active_group":"g"})));
    let log = gw.request_log("offline").unwrap();
    let server = NatsServer::start();
    let client = server.connect().await;
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let (client, shutdown) = (client.clone(), shutdown.clone());
        async move {
            cyrene_model_gateway::serve(gw, client, ServeOptions::default(), shutdown)
                .await
                .unwrap();
        }
    });
    // Ready once the stream endpoint answers (an empty object is a bad request).
    for _ in 0..100 {
        let r = complete_stream(
            &client,
            &ModelRequest::default(),
            Duration::from_millis(500),
            |_, _| {},
        )
        .await;
        if matches!(r, Err(RequestError::Remote(_))) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Running {
        log,
        _server: server,
        _upstream: upstream,
        client,
        shutdown,
        task,
    }
}

#[tokio::test]
async fn the_streamed_endpoint_publishes_ordered_deltas_then_the_response_and_a_call_record() {
    let bus = start_bus().await;
    let mut records = call_records(&bus.client).await;
    let mut req = ask("hi");
    req.model = "m".into();
    req.purpose = "chat".into();
    let mut seen = Vec::new();
    let resp = complete_stream(&bus.client, &req, WAIT, |seq, d| seen.push((seq, d)))
        .await
        .unwrap();
    // In order from 0 without gaps; deltas that were waiting together may go out as one.
    let seqs: Vec<u64> = seen.iter().map(|(s, _)| *s).collect();
    assert!(!seqs.is_empty() && seqs.len() <= 3, "{seqs:?}");
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
    let joined: String = seen
        .iter()
        .map(|(_, d)| match d {
            Delta::Text { text } => text.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(joined, "one two three");
    assert_eq!(resp.content, joined);
    assert_eq!(resp.total_tokens, 6);
    let record = tokio::time::timeout(WAIT, records.next())
        .await
        .unwrap()
        .unwrap();
    let record: CallRecord = serde_json::from_slice(&record.payload).unwrap();
    assert_eq!(
        (
            record.provider.as_str(),
            record.purpose.as_str(),
            record.tokens,
            record.cache_hit_tokens
        ),
        // the provider's cached prompt tokens go into the record (issue 32: the operator view)
        ("http", "chat", 6, 2)
    );

    // The scripted provider streams word by word; the words add up to its reply.
    let mut words = String::new();
    let resp = complete_stream(&bus.client, &ask("hello there"), WAIT, |_, d| {
        if let Delta::Text { text } = d {
            words.push_str(&text);
        }
    })
    .await
    .unwrap();
    assert!(resp.offline);
    assert_eq!(words, resp.content);
    bus.shutdown.cancel();
    tokio::time::timeout(WAIT, bus.task).await.unwrap().unwrap();
}

/// Issue 30, M7: a reply of 150,000 words once went out as 150,000 delta messages, more than
/// a caller's reply permission allows (`allow_responses: {max: 100000}`), so its end marker was
/// refused and the call never ended. Deltas are coalesced and bounded: the stream ends, and
/// what it showed adds up to the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_of_more_deltas_than_a_reply_permission_allows_still_ends() {
    let bus = start_bus().await;
    let words = "a ".repeat(150_000);
    let mut messages = 0u64;
    let mut shown = String::new();
    let resp = complete_stream(
        &bus.client,
        &ask(&words),
        Duration::from_secs(60),
        |_, d| {
            messages += 1;
            if let Delta::Text { text } = d {
                shown.push_str(&text);
            }
        },
    )
    .await
    .expect("the end marker arrives");
    assert!(resp.content.len() > 300_000, "{}", resp.content.len());
    assert!(
        messages <= cyrene_model_gateway::stream::MAX_DELTA_MESSAGES,
        "{messages} delta messages"
    );
    assert!(messages < 100_000, "{messages} delta messages");
    assert_eq!(shown, resp.content);
    bus.shutdown.cancel();
    tokio::time::timeout(WAIT, bus.task).await.unwrap().unwrap();
}

#[tokio::test]
async fn hostile_streamed_requests_get_one_error_end_marker() {
    let bus = start_bus().await;
    for payload in [
        &b"{"[..],
        b"[]",
        b"{\"messages\":[],\"top_p\":1}",
        b"\xff\xfe",
    ] {
        let inbox = bus.client.new_inbox();
        let mut sub = bus.client.subscribe(inbox.clone()).await.unwrap();
        bus.client
            .publish_with_reply(MODEL_COMPLETE_STREAM, inbox, payload.to_vec().into())
            .await
            .unwrap();
        let msg = tokio::time::timeout(WAIT, sub.next())
            .await
            .unwrap()
            .unwrap();
        let chunk: StreamChunk = serde_json::from_slice(&msg.payload).unwrap();
        assert_eq!(chunk.seq, 0);
        assert_eq!(chunk.error.unwrap().code, ErrorCode::BadRequest);
        assert!(
            msg.headers
                .unwrap()
                .get("Nats-Service-Error-Code")
                .is_some()
        );
    }
    // An unknown model is refused before any delta.
    let mut req = ask("x");
    req.model = "nope".into();
    let err = complete_stream(&bus.client, &req, WAIT, |_, _| panic!("no delta"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::BadRequest);
    bus.shutdown.cancel();
    tokio::time::timeout(WAIT, bus.task).await.unwrap().unwrap();
}

#[tokio::test]
async fn a_held_view_continues_on_its_replica_with_only_what_was_added() {
    let bus = start_bus().await;
    let inbox = cyrene_model_client::StreamInbox::new(bus.client.clone());
    let id = "0123456789abcdef0123";
    let view = |base| {
        Some(ViewRef {
            id: id.into(),
            base,
        })
    };
    let texts = |r: &ModelRequest| -> Vec<String> {
        r.messages.iter().map(Message::text_content).collect()
    };

    let mut first = ask("hello there");
    first
        .messages
        .insert(0, Message::text(Role::System, "be brief"));
    first.view = view(0);
    let (_, replica) = inbox
        .complete_stream_at(MODEL_COMPLETE_STREAM, &first, WAIT, |_, _| {})
        .await
        .unwrap();
    let replica = replica.expect("the end marker names the replica holding the view");
    let at = subjects::model_complete_stream_at(&replica);

    // The next call sends only its new message, to the replica: the model sees the whole view.
    let mut next = ask("and then");
    next.view = view(2);
    let (response, again) = inbox
        .complete_stream_at(&at, &next, WAIT, |_, _| {})
        .await
        .unwrap();
    assert_eq!(again.as_deref(), Some(replica.as_str()));
    assert!(
        response.content.ends_with("and then"),
        "{}",
        response.content
    );
    let seen = bus.log.snapshot().pop().unwrap();
    assert_eq!(texts(&seen), ["be brief", "hello there", "and then"]);
    assert_eq!(seen.view, None, "a provider never sees the view's name");

    // A base the replica does not hold: not_found, and no model is called.
    let calls = bus.log.len();
    let err = inbox
        .complete_stream_at(&at, &next, WAIT, |_, _| panic!("no delta"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::NotFound);
    assert_eq!(bus.log.len(), calls);
    // The plain endpoint holds no views, and a request naming none is answered as ever.
    let err = cyrene_bus::request_json::<_, ModelResponse>(
        &bus.client,
        subjects::MODEL_COMPLETE,
        &next,
        WAIT,
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), ErrorCode::BadRequest);
    let (_, none) = inbox
        .complete_stream_at(MODEL_COMPLETE_STREAM, &ask("plain"), WAIT, |_, _| {})
        .await
        .unwrap();
    assert_eq!(none, None);
    bus.shutdown.cancel();
}

#[tokio::test]
async fn calls_sharing_one_stream_inbox_each_get_their_own_deltas_and_end() {
    let bus = start_bus().await;
    let inbox = cyrene_model_client::StreamInbox::new(bus.client.clone());
    let texts = [
        "alpha beta gamma",
        "one two",
        "a longer sentence of six words",
    ];
    // Concurrent calls on the one subscription: each call's deltas add up to its own reply.
    let calls = texts.iter().map(|text| {
        let inbox = &inbox;
        async move {
            let mut seqs = Vec::new();
            let mut words = String::new();
            let resp = inbox
                .complete_stream(&ask(text), WAIT, |seq, d| {
                    seqs.push(seq);
                    if let Delta::Text { text } = d {
                        words.push_str(&text);
                    }
                })
                .await
                .unwrap();
            (resp, words, seqs)
        }
    });
    let plain = futures::future::join_all(texts.iter().map(|text| {
        let client = &bus.client;
        async move {
            complete_stream(client, &ask(text), WAIT, |_, _| {})
                .await
                .unwrap()
        }
    }))
    .await;
    for ((resp, words, seqs), alone) in futures::future::join_all(calls)
        .await
        .into_iter()
        .zip(plain)
    {
        assert_eq!(words, resp.content);
        assert_eq!(
            resp.content, alone.content,
            "the same reply as its own subscription gives"
        );
        assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>());
        assert!(!seqs.is_empty());
    }
    // An error end marker reaches its own call, and the inbox keeps serving after it.
    let mut req = ask("x");
    req.model = "nope".into();
    let err = inbox
        .complete_stream(&req, WAIT, |_, _| panic!("no delta"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), ErrorCode::BadRequest);
    let again = inbox
        .complete_stream(&ask("still there"), WAIT, |_, _| {})
        .await
        .unwrap();
    assert!(again.offline);
    // With no gateway on the bus the shared inbox hears "no responders", as a call's own does.
    bus.shutdown.cancel();
    tokio::time::timeout(WAIT, bus.task).await.unwrap().unwrap();
    let err = inbox
        .complete_stream(&ask("anyone?"), WAIT, |_, _| {})
        .await
        .unwrap_err();
    assert!(matches!(err, RequestError::NoResponders { .. }), "{err:?}");
}

/// The chunks published on a fresh inbox for `request` sent with `headers`, up to its end.
async fn wire(
    client: &async_nats::Client,
    request: &ModelRequest,
    headers: async_nats::HeaderMap,
) -> Vec<StreamChunk> {
    let reply = client.new_inbox();
    let mut seen = client.subscribe(reply.clone()).await.unwrap();
    let payload = serde_json::to_vec(request).unwrap();
    client
        .publish_with_reply_and_headers(MODEL_COMPLETE_STREAM, reply, headers, payload.into())
        .await
        .unwrap();
    let mut chunks = Vec::new();
    loop {
        let m = tokio::time::timeout(WAIT, seen.next())
            .await
            .unwrap()
            .unwrap();
        let chunk: StreamChunk = serde_json::from_slice(&m.payload).unwrap();
        let end = chunk.is_end();
        chunks.push(chunk);
        if end {
            return chunks;
        }
    }
}

fn header(name: &str, value: &str) -> async_nats::HeaderMap {
    let mut headers = async_nats::HeaderMap::new();
    cyrene_bus::headers::insert(&mut headers, name, value).unwrap();
    headers
}

/// The first heartbeat is due one interval into the call, not as it starts: a call answered
/// sooner (the scripted model at once; the interval asked is 10 s) sends its deltas and its end
/// marker and nothing else. Each of a five-step turn's six calls once paid one message more.
#[tokio::test]
async fn a_call_answered_within_one_heartbeat_interval_sends_no_heartbeat() {
    let bus = start_bus().await;
    let beat = header(cyrene_protocol::stream::HEARTBEAT_HEADER, "10000");
    let chunks = wire(&bus.client, &ask("hello there"), beat).await;
    assert!(chunks.iter().all(|c| c.heartbeat.is_none()), "{chunks:?}");
    assert!(chunks.iter().any(|c| c.delta.is_some()), "{chunks:?}");
    assert!(chunks.last().unwrap().done.is_some(), "{chunks:?}");
    let seqs: Vec<u64> = chunks.iter().map(|c| c.seq).collect();
    assert_eq!(seqs, (0..chunks.len() as u64).collect::<Vec<_>>());
    bus.shutdown.cancel();
    tokio::time::timeout(WAIT, bus.task).await.unwrap().unwrap();
}

/// A caller that names the deltas it wants (`Cyrene-Stream-Deltas`) gets only those kinds, in
/// `seq` order without gaps, and the whole response at the end; with `none`, only the end
/// marker. Without the header every kind comes, as before.
#[tokio::test]
async fn a_caller_gets_only_the_kinds_of_delta_it_names() {
    let gw = Arc::new(gateway(json!({
        "providers":{"offline":{"protocol":"scripted","models":{"scripted":{}},
            "script":{"rules":[{"contains":"look it up",
                "tool_calls":[{"name":"lookup","args":{"q":"x"}}]}]}}},
        "groups":{"g":[{"provider":"offline","model":"scripted"}]},
        "active_group":"g"})));
    let server = NatsServer::start();
    let client = server.connect().await;
    let shutdown = CancellationToken::new();
    tokio::spawn(cyrene_model_gateway::serve(
        gw,
        client.clone(),
        ServeOptions::default(),
        shutdown.clone(),
    ));
    cyrene_bus::discovery::wait_for(
        &client,
        "cyrene-model-gateway",
        WAIT,
        Duration::from_millis(50),
    )
    .await;
    // The deltas of a call's chunks; the end marker is whole whatever was asked.
    let deltas = |chunks: &[StreamChunk], calls: usize| -> Vec<Delta> {
        let seqs: Vec<u64> = chunks.iter().map(|c| c.seq).collect();
        assert_eq!(seqs, (0..chunks.len() as u64).collect::<Vec<_>>());
        let done = chunks.last().unwrap().done.as_ref().unwrap();
        assert_eq!(done.tool_calls.len(), calls, "{done:?}");
        assert_eq!(done.content.is_empty(), calls > 0, "{done:?}");
        chunks.iter().filter_map(|c| c.delta.clone()).collect()
    };
    let (call, hello) = (ask("please look it up"), ask("hello there"));
    let kinds = cyrene_protocol::stream::DELTAS_HEADER;
    let all = deltas(&wire(&client, &call, async_nats::HeaderMap::new()).await, 1);
    assert!(
        matches!(all.as_slice(), [Delta::ToolCall { .. }]),
        "{all:?}"
    );
    let text = deltas(&wire(&client, &call, header(kinds, "text")).await, 1);
    assert!(text.is_empty(), "{text:?}");
    let text = deltas(&wire(&client, &hello, header(kinds, "text")).await, 0);
    assert!(!texts(&text).is_empty(), "{text:?}");
    assert!(
        text.iter().all(|d| matches!(d, Delta::Text { .. })),
        "{text:?}"
    );
    let none = deltas(&wire(&client, &hello, header(kinds, "none")).await, 0);
    assert!(none.is_empty(), "{none:?}");

    // Through the client: `on_delta` hears text only, and the text adds up to the answer.
    let inbox = cyrene_model_client::StreamInbox::new(client.clone());
    for (request, calls) in [(&call, 1), (&hello, 0)] {
        let mut heard = Vec::new();
        let (resp, _) = inbox
            .complete_stream_wanting(
                MODEL_COMPLETE_STREAM,
                request,
                WAIT,
                cyrene_protocol::stream::DeltaKinds::TEXT,
                |_, d| heard.push(d),
            )
            .await
            .unwrap();
        assert_eq!(resp.tool_calls.len(), calls);
        assert_eq!(texts(&heard), resp.content);
        assert!(
            heard.iter().all(|d| matches!(d, Delta::Text { .. })),
            "{heard:?}"
        );
    }
    shutdown.cancel();
}

/// Issue 29, item 4: a caller that asks for heartbeats gets them while a slow provider thinks,
/// so a call far longer than the silence limit still ends with its answer; a responder that
/// takes the call and then says nothing is given up on after five silent intervals
/// (`Vanished`), not at the call's timeout; so is one that never says it took the call.
#[tokio::test]
async fn heartbeats_keep_a_slow_call_alive_and_silence_means_the_replica_is_gone() {
    let upstream = MockServer::start().await;
    Mock::given(method("POST"))
        .respond_with(
            ResponseTemplate::new(200)
                .set_delay(Duration::from_millis(800))
                .set_body_json(
                    json!({"model":"m","choices":[{"message":{"role":"assistant",
                    "content":"slow but sure"},"finish_reason":"stop"}],
                    "usage":{"prompt_tokens":1,"completion_tokens":3,"total_tokens":4}}),
                ),
        )
        .mount(&upstream)
        .await;
    let gw = Arc::new(gateway(chain(&[("p", openai(&upstream), "m")])));
    let server = NatsServer::start();
    let client = server.connect().await;
    let shutdown = CancellationToken::new();
    tokio::spawn(cyrene_model_gateway::serve(
        gw,
        client.clone(),
        ServeOptions::default(),
        shutdown.clone(),
    ));
    cyrene_bus::discovery::wait_for(
        &client,
        "cyrene-model-gateway",
        WAIT,
        Duration::from_millis(50),
    )
    .await;
    let every = Duration::from_millis(50);
    let inbox = cyrene_model_client::StreamInbox::new(client.clone()).with_heartbeat(every);
    let mut texts = String::new();
    let resp = inbox
        .complete_stream(&ask("take your time"), WAIT, |_, d| {
            if let Delta::Text { text } = d {
                texts.push_str(&text);
            }
        })
        .await
        .unwrap();
    assert_eq!(
        (resp.content.as_str(), texts.as_str()),
        ("slow but sure", "slow but sure")
    );

    // On the wire: heartbeats with their own seq, then the deltas and the end marker.
    let reply = client.new_inbox();
    let mut seen = client.subscribe(reply.clone()).await.unwrap();
    let mut headers = async_nats::HeaderMap::new();
    cyrene_bus::headers::insert(
        &mut headers,
        cyrene_protocol::stream::HEARTBEAT_HEADER,
        "50",
    )
    .unwrap();
    let payload = serde_json::to_vec(&ask("again")).unwrap();
    client
        .publish_with_reply_and_headers(MODEL_COMPLETE_STREAM, reply, headers, payload.into())
        .await
        .unwrap();
    let mut chunks = Vec::new();
    loop {
        let m = tokio::time::timeout(WAIT, seen.next())
            .await
            .unwrap()
            .unwrap();
        let chunk: StreamChunk = serde_json::from_slice(&m.payload).unwrap();
        let end = chunk.is_end();
        chunks.push(chunk);
        if end {
            break;
        }
    }
    assert!(chunks[0].heartbeat == Some(true), "{chunks:?}");
    let seqs: Vec<u64> = chunks.iter().map(|c| c.seq).collect();
    assert_eq!(seqs, (0..chunks.len() as u64).collect::<Vec<_>>());

    // A "replica" that takes the call, says so with a heartbeat and dies: silence, then
    // `Vanished` well before the timeout.
    let call_timeout = Duration::from_secs(60);
    let mut sink = client.subscribe("test.silent").await.unwrap();
    let replier = client.clone();
    tokio::spawn(async move {
        while let Some(request) = sink.next().await {
            let beat = serde_json::to_vec(&StreamChunk::heartbeat(0)).unwrap();
            let reply = request.reply.unwrap();
            replier.publish(reply, beat.into()).await.unwrap();
        }
    });
    client.flush().await.unwrap();
    let err = inbox
        .complete_stream_at("test.silent", &ask("hello?"), call_timeout, |_, _| {})
        .await
        .unwrap_err();
    assert!(matches!(err, RequestError::Vanished { .. }), "{err:?}");
    assert_eq!(err.code(), ErrorCode::Unavailable);

    // A replica that NATS handed the call to but that died before reading it (or never says it
    // took it): no first heartbeat, and `Vanished` well before the timeout, not at it.
    let _swallow = client.subscribe("test.swallowed").await.unwrap();
    client.flush().await.unwrap();
    let err = inbox
        .complete_stream_at(
            "test.swallowed",
            &ask("anyone there?"),
            call_timeout,
            |_, _| {},
        )
        .await
        .unwrap_err();
    match err {
        RequestError::Vanished { silent, .. } => assert_eq!(
            silent,
            every * cyrene_model_client::FIRST_BEAT_BEATS,
            "the first heartbeat's grace, not the call's timeout"
        ),
        other => panic!("{other:?}"),
    }
    shutdown.cancel();
}
