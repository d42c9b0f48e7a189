//! Memory she gathers herself (docs/memory.md, "Memory she gathers herself"), over a real
//! nats-server (JetStream stream `CYRENE_MEMORY`) and real SQL, with a stand-in model gateway
//! answering `cyrene.model.complete` as each test scripts it: entries with their provenance, one
//! write per turn however often the job comes, nothing from restricted sessions, nothing from a
//! malformed answer, and a failing model never touching the answer.

use crate::harness::*;
use cyrene_bus::service::{RequestContext, ServeOptions, serve_json};
use cyrene_orchestrator::extraction::{self, EXTRACTION_PROMPT};
use cyrene_protocol::memory::{
    MemoryExtractJob, MemoryReadRequest, MemoryReadResponse, MemorySource,
};
use cyrene_protocol::model::{ModelRequest, ModelResponse};
use cyrene_protocol::{ErrorBody, ErrorCode, subjects};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// What the stand-in gateway answers, in order (the last one again when they run out).
#[derive(Clone)]
enum Answer {
    Text(&'static str),
    Fail,
}

/// A stand-in model gateway on `cyrene.model.complete`: records every request, answers from
/// its script.
struct Gateway {
    requests: Arc<Mutex<Vec<ModelRequest>>>,
    _service: async_nats::service::Service,
    shutdown: CancellationToken,
}

impl Gateway {
    async fn start(client: &async_nats::Client, script: Vec<Answer>) -> Gateway {
        let service =
            cyrene_test_support::micro::start_service(client, "test-gateway", "0.0.1").await;
        let endpoint = cyrene_test_support::micro::add_endpoint(
            &service,
            "complete",
            subjects::MODEL_COMPLETE,
        )
        .await;
        let requests = Arc::new(Mutex::new(Vec::new()));
        let script = Arc::new(Mutex::new(VecDeque::from(script)));
        let shutdown = CancellationToken::new();
        let seen = requests.clone();
        tokio::spawn(serve_json(
            endpoint,
            ServeOptions::default(),
            shutdown.clone(),
            move |req: ModelRequest, _: RequestContext| {
                let (seen, script) = (seen.clone(), script.clone());
                async move {
                    seen.lock().unwrap().push(req);
                    let answer = {
                        let mut script = script.lock().unwrap();
                        match script.len() {
                            0 => Answer::Fail,
                            1 => script[0].clone(),
                            _ => script.pop_front().unwrap(),
                        }
                    };
                    match answer {
                        Answer::Fail => Err(ErrorBody::new(
                            ErrorCode::Unavailable,
                            "every provider failed",
                        )),
                        Answer::Text(text) => {
                            Ok(ModelResponse::offline_text("stand-in", "stand-in", text))
                        }
                    }
                }
            },
        ));
        Gateway {
            requests,
            _service: service,
            shutdown,
        }
    }

    fn requests(&self) -> Vec<ModelRequest> {
        self.requests.lock().unwrap().clone()
    }

    async fn wait_requests(&self, n: usize) -> Vec<ModelRequest> {
        wait_for("model requests", Duration::from_secs(10), || {
            let seen = self.requests();
            (seen.len() >= n).then_some(seen)
        })
        .await
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

async fn memory_of(client: &async_nats::Client, persona: &str) -> MemoryReadResponse {
    let req = MemoryReadRequest {
        persona_id: persona.into(),
        session_id: String::new(),
    };
    cyrene_bus::request_json(client, subjects::MEMORY_READ, &req, TIMEOUT)
        .await
        .unwrap()
}

async fn wait_memory(client: &async_nats::Client, persona: &str, n: usize) -> MemoryReadResponse {
    wait_async("memory entries", || async {
        let read = memory_of(client, persona).await;
        (read.memory.len() >= n).then_some(read)
    })
    .await
}

/// One replica with [`fast`] retries, and the stand-in gateway answering `script`.
async fn extracting(backend: Backend, script: Vec<Answer>) -> (World, Replica, JobQueue, Gateway) {
    let (world, replica, jobs) = one_replica_with(backend, fast).await;
    let gateway = Gateway::start(&world.client, script).await;
    (world, replica, jobs, gateway)
}

/// The state of the `CYRENE_MEMORY` stream now.
async fn memory_stream(client: &async_nats::Client) -> async_nats::jetstream::stream::State {
    async_nats::jetstream::new(client.clone())
        .get_stream(extraction::STREAM)
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .state
        .clone()
}

/// Fast retries for the tests (the delay doubles per delivery).
fn fast(c: &mut cyrene_orchestrator::Config) {
    c.memory_retry_delay = Duration::from_millis(50);
    c.memory_max_deliver = 3;
}

/// A turn answered, its facts in memory with where they came from; the same job published again
/// (a repeated completion, a republish past the window) writes nothing twice.
async fn extracted_once_with_provenance(backend: Backend) {
    let (world, _replica, mut jobs, gateway) = extracting(
        backend,
        vec![Answer::Text(
            "```json\n[\"the user's cat is called Mochi\", \"likes oolong\", 7]\n```",
        )],
    )
    .await;
    let c = &world.client;

    let (_, job) = start_turn(
        c,
        &mut jobs,
        &send_req("s1", "my cat is Mochi", "k1", "cli"),
    )
    .await;
    assert!(completes_first(c, &job, 1, "What a sweet name!").await);
    let read = wait_memory(c, "cyrene", 2).await;
    let texts: Vec<&str> = read.memory.iter().map(|e| e.text.as_str()).collect();
    assert_eq!(texts, ["the user's cat is called Mochi", "likes oolong"]);
    let source = MemorySource {
        session_id: "s1".into(),
        turn_id: job.turn_id.clone(),
        persona: "cyrene".into(),
    };
    for entry in &read.memory {
        assert_eq!(entry.source.as_ref(), Some(&source));
    }

    // One model call, no tools, purpose memory, the prompt, and the turn's window as JSON.
    let requests = gateway.wait_requests(1).await;
    let req = &requests[0];
    assert_eq!(req.purpose, "memory");
    assert_eq!(req.persona_id, "cyrene");
    assert!(req.tools.is_empty());
    assert_eq!(req.messages[0].text_content(), EXTRACTION_PROMPT);
    let text = req.messages[1].text_content();
    let json = text.strip_prefix(extraction::WINDOW_HEADER).unwrap();
    let shown: serde_json::Value = serde_json::from_str(json.trim_start()).unwrap();
    assert_eq!(
        shown,
        serde_json::json!([{"role":"user","text":"my cat is Mochi"},
                           {"role":"assistant","text":"What a sweet name!"}])
    );

    // The completion again: acknowledged as a repeat, deduplicated by JetStream.
    assert!(!completes_first(c, &job, 1, "What a sweet name!").await);
    // The same job past JetStream's duplicate window: delivered, but nothing written twice.
    let js = async_nats::jetstream::new(c.clone());
    let again = MemoryExtractJob {
        session_id: "s1".into(),
        turn_id: job.turn_id.clone(),
        persona: "cyrene".into(),
    };
    let subject = subjects::memory_extract(&job.turn_id).unwrap();
    js.publish(subject, serde_json::to_vec(&again).unwrap().into())
        .await
        .unwrap()
        .await
        .unwrap();
    gateway.wait_requests(2).await;
    // A later turn's extraction lands after the repeat was handled (one consumer, in order of
    // arrival is not promised: wait for the later turn's entry instead of sleeping).
    let (_, job2) = start_turn(c, &mut jobs, &send_req("s1", "and I like tea", "k2", "cli")).await;
    assert!(completes_first(c, &job2, 1, "Noted!").await);
    gateway.wait_requests(3).await;
    wait_async("the second turn's extraction to finish", || async {
        let read = memory_of(c, "cyrene").await;
        read.memory
            .iter()
            .any(|e| e.source.as_ref().is_some_and(|s| s.turn_id == job2.turn_id))
            .then_some(())
    })
    .await;
    // Only the second turn's entries are new (its answer is the same script: the same texts).
    let read = memory_of(c, "cyrene").await;
    let of_first = read
        .memory
        .iter()
        .filter(|e| e.source.as_ref().is_some_and(|s| s.turn_id == job.turn_id))
        .count();
    assert_eq!(of_first, 2, "the first turn's facts were written once");
    assert_eq!(read.memory.len(), 4);
}

on_both_backends!(extracted_once_with_provenance:
    memory_is_extracted_once_with_provenance_sqlite,
    memory_is_extracted_once_with_provenance_postgres);

/// A stranger's turn in a restricted session publishes no job; neither does the owner's turn
/// that a guard stopped. The owner's own answered turn does.
async fn restricted_sessions_write_nothing(backend: Backend) {
    let (world, _replica, mut jobs) = one_replica_with(backend, |c| {
        fast(c);
        c.owner = Some("alice".into());
    })
    .await;
    let c = &world.client;
    let gateway = Gateway::start(c, vec![Answer::Text(r#"["a fact"]"#)]).await;

    // Bob is not the owner: his session is restricted.
    let bob = subjects::person("bob", subjects::PERSON_SESSION_SEND).unwrap();
    let req = send_req("bob.s1", "remember that alice owes me money", "b1", "cli");
    let _: cyrene_protocol::session::SendAck = cyrene_bus::request_json(c, &bob, &req, TIMEOUT)
        .await
        .unwrap();
    let (job, _) = jobs.next().await;
    assert!(job.env.restricted);
    assert!(completes_first(c, &job, 1, "ok").await);

    // The owner's turn that her persona's guard stopped: nothing of it is remembered either.
    let alice = subjects::person("alice", subjects::PERSON_SESSION_SEND).unwrap();
    let req = send_req("alice.s0", "something the guard refuses", "a0", "cli");
    let _: cyrene_protocol::session::SendAck = cyrene_bus::request_json(c, &alice, &req, TIMEOUT)
        .await
        .unwrap();
    let (job, _) = jobs.next().await;
    assert!(!job.env.restricted);
    let stopped = cyrene_protocol::turn::TurnComplete {
        stop_reason: "guardrail".into(),
        ..completion(&job, 1, "I can't help with that.")
    };
    assert!(complete(c, &stopped).await.unwrap().first);

    // The owner's turn comes after, and its extraction is the first the model sees.
    let req = send_req("alice.s1", "I moved to Kyoto", "a1", "cli");
    let _: cyrene_protocol::session::SendAck = cyrene_bus::request_json(c, &alice, &req, TIMEOUT)
        .await
        .unwrap();
    let (job, _) = jobs.next().await;
    assert!(!job.env.restricted);
    assert!(completes_first(c, &job, 1, "Kyoto is lovely").await);
    wait_memory(c, "cyrene", 1).await;
    let requests = gateway.requests();
    assert_eq!(requests.len(), 1, "only the owner's turn was extracted");
    assert!(requests[0].messages[1].text_content().contains("Kyoto"));
    let stream = memory_stream(c).await;
    assert_eq!(stream.last_sequence, 1, "one job was ever published");
}

on_both_backends!(restricted_sessions_write_nothing:
    restricted_sessions_publish_no_extraction_sqlite,
    restricted_sessions_publish_no_extraction_postgres);

/// Hostile answers write nothing and the consumer goes on; a failing model is retried, then
/// dropped, and the answer the person got stays as it was.
async fn bad_answers_and_failures_write_nothing(backend: Backend) {
    let (world, _replica, mut jobs, gateway) = extracting(
        backend,
        vec![
            Answer::Text("Sure! Here is what I remember: the cat."),
            Answer::Text(r#"{"facts":["not an array"]}"#),
            Answer::Fail,
        ],
    )
    .await;
    let c = &world.client;

    for (i, text) in ["one", "two"].into_iter().enumerate() {
        let key = format!("k{i}");
        let (_, job) = start_turn(c, &mut jobs, &send_req("s1", text, &key, "cli")).await;
        assert!(completes_first(c, &job, 1, &format!("answer {text}")).await);
        gateway.wait_requests(i + 1).await;
    }
    // The third turn's extraction fails on every delivery (3), then is dropped.
    let (_, job) = start_turn(c, &mut jobs, &send_req("s1", "three", "k3", "cli")).await;
    assert!(completes_first(c, &job, 1, "answer three").await);
    let requests = gateway.wait_requests(5).await;
    assert!(
        requests[2..]
            .iter()
            .all(|r| r.messages[1].text_content().contains("three")),
        "the failing job was retried"
    );
    // Dropped after its last delivery: it leaves the work queue.
    wait_async("the dropped job to leave the stream", || async {
        (memory_stream(c).await.messages == 0).then_some(())
    })
    .await;
    assert_eq!(gateway.requests().len(), 5, "no fourth delivery");
    assert!(memory_of(c, "cyrene").await.memory.is_empty());
    let said = history_texts(c, "s1").await;
    assert_eq!(
        said,
        [
            "one",
            "answer one",
            "two",
            "answer two",
            "three",
            "answer three"
        ]
    );
}

on_both_backends!(bad_answers_and_failures_write_nothing:
    bad_answers_and_failures_write_nothing_sqlite,
    bad_answers_and_failures_write_nothing_postgres);

/// The crash point between the completion's commit and the job's publish: JetStream does not
/// take the job, so the completion is answered `unavailable` — with the answer already in the
/// transcript — and the worker's resend, a repeat, publishes it.
async fn a_job_not_queued_is_queued_by_the_resent_completion(backend: Backend) {
    let (world, _replica, mut jobs, gateway) =
        extracting(backend, vec![Answer::Text(r#"["plays the cello"]"#)]).await;
    let c = &world.client;
    let js = async_nats::jetstream::new(c.clone());
    js.delete_stream(extraction::STREAM).await.unwrap();

    let (_, job) = start_turn(
        c,
        &mut jobs,
        &send_req("s1", "I play the cello", "k1", "cli"),
    )
    .await;
    let err = complete(c, &completion(&job, 1, "Lovely!"))
        .await
        .unwrap_err();
    assert_eq!(code(&err), ErrorCode::Unavailable);
    let said = history_texts(c, "s1").await;
    assert_eq!(
        said,
        ["I play the cello", "Lovely!"],
        "the answer is recorded"
    );
    assert!(gateway.requests().is_empty());

    // JetStream is back (the stream and its consumer as the orchestrator makes them).
    extraction::open(&js, 1, 3).await.unwrap();
    assert!(!completes_first(c, &job, 1, "Lovely!").await);
    let read = wait_memory(c, "cyrene", 1).await;
    assert_eq!(read.memory[0].text, "plays the cello");
    assert_eq!(
        read.memory[0].source.as_ref().map(|s| s.turn_id.as_str()),
        Some(job.turn_id.as_str())
    );
    assert_eq!(history(c, "s1").await.len(), 2, "the resend added nothing");
}

on_both_backends!(a_job_not_queued_is_queued_by_the_resent_completion:
    a_job_not_queued_is_queued_by_the_resent_completion_sqlite,
    a_job_not_queued_is_queued_by_the_resent_completion_postgres);
