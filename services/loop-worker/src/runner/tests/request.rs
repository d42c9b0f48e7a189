//! A step's request (`super::request`) against the in-memory bus: the view's blocks and notice,
//! documents and images.

use super::*;

#[tokio::test]
async fn every_view_opens_with_the_instructions_then_the_time_block() {
    let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("noon")]);
    let _ = run_turn(&fake, &job(), 1, &CFG).await;
    let requests = fake.requests.lock().unwrap();
    assert_eq!(requests.len(), 2);
    let first_block = requests[0].messages[1].clone();
    for request in requests.iter() {
        assert_eq!(request.messages[0].text_content(), "You are Cyrene.");
        assert_eq!(request.messages[1].role, Role::System);
        assert!(
            request.messages[1]
                .text_content()
                .starts_with(crate::assemble::TIME_BLOCK_MARKER),
            "{:?}",
            request.messages[1]
        );
        // One stamp per attempt: the prefix stays the same from step to step.
        assert_eq!(request.messages[1], first_block);
    }
    // A view block, never in the window.
    for cp in fake.saved.lock().unwrap().iter() {
        assert!(state(cp).messages.iter().all(|m| m.role != Role::System));
    }
}

#[tokio::test]
async fn the_parallel_notice_is_the_last_view_message_and_never_checkpointed() {
    let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("x")]);
    let mut j = job();
    j.leg_id = "leg2".into();
    j.notice = Some(ParallelNotice {
        step: 3,
        ..Default::default()
    });
    let _ = run_turn(&fake, &j, 1, &CFG).await;
    for request in fake.requests.lock().unwrap().iter() {
        let last = request.messages.last().unwrap();
        assert_eq!(last.role, Role::System);
        assert!(last.text_content().starts_with(PARALLEL_NOTICE_HEADER));
    }
    for cp in fake.saved.lock().unwrap().iter() {
        assert_eq!(cp.agent_id, "s1#leg2");
        assert!(state(cp).messages.iter().all(|m| m.role != Role::System));
    }
}

/// A job whose message carries a text document.
fn job_with_a_document() -> TurnJob {
    let mut job = job();
    let message = job.messages.last_mut().unwrap();
    message.content.push(Part::Document {
        name: "d-1".into(),
        mime: "text/plain".into(),
        url: "cyrene-doc://d-1".into(),
        size: 5,
    });
    job
}

fn stored_document() -> crate::ports::FetchedDocument {
    crate::ports::FetchedDocument {
        name: "d-1".into(),
        mime: "text/plain".into(),
        size: 5,
        title: String::new(),
        bytes: b"hello".to_vec(),
    }
}

/// D23 (issue 34): a document service that fails for a passing reason is asked again; the
/// model sees the document's text, never "could not extract".
#[tokio::test(start_paused = true)]
async fn a_passing_document_service_failure_is_tried_again() {
    let fake = Fake::scripted([reply_text("read it")]);
    fake.documents.lock().unwrap().extend([
        Err(ErrorBody::new(ErrorCode::Unavailable, "no responders")),
        Err(ErrorBody::new(ErrorCode::Timeout, "slow")),
        Ok(stored_document()),
    ]);
    let done = completed(run_turn(&fake, &job_with_a_document(), 1, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Final);
    assert_eq!(*fake.document_reads.lock().unwrap(), 3);
    let requests = fake.requests.lock().unwrap();
    let user = requests[0]
        .messages
        .iter()
        .rev()
        .find(|m| m.role == Role::User)
        .unwrap()
        .text_content();
    assert!(
        user.contains("[文档] d-1（text/plain，5 字节）：\nhello"),
        "{user}"
    );
    assert!(!user.contains("未能提取文字内容"), "{user}");
}

/// D23: still failing after every try, the attempt hands its job back (the model is not
/// asked); a lasting answer (`not_found`) is the manifest line.
#[tokio::test(start_paused = true)]
async fn a_document_service_that_stays_down_hands_the_job_back() {
    let fake = Fake::scripted([reply_text("never")]);
    fake.documents.lock().unwrap().extend(
        (0..crate::documents::READ_TRIES)
            .map(|_| Err(ErrorBody::new(ErrorCode::Unavailable, "no responders"))),
    );
    let end = run_turn(&fake, &job_with_a_document(), 1, &CFG).await;
    assert_handed_back(&end, &fake);

    let gone = Fake::scripted([reply_text("answered")]);
    let done = completed(run_turn(&gone, &job_with_a_document(), 1, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Final);
    let requests = gone.requests.lock().unwrap();
    assert!(
        requests[0]
            .messages
            .iter()
            .any(|m| m.text_content().contains("未能提取文字内容")),
        "the manifest line"
    );
}

#[tokio::test]
async fn images_become_descriptions_for_a_main_model_without_vision() {
    let fake = Fake::scripted([reply_tools(&["c1"]), reply_text("a kite!")]);
    *fake.vision.lock().unwrap() = Some(false);
    let mut j = job();
    let photo = Message::image(Role::User, "look", "https://example.invalid/kite.png");
    j.messages = vec![photo.clone()];
    let _ = run_turn(&fake, &j, 1, &CFG).await;

    let requests = fake.requests.lock().unwrap();
    for request in requests.iter() {
        assert!(
            !request.messages.iter().any(Message::has_image),
            "an image reached the model"
        );
        let user = request
            .messages
            .iter()
            .find(|m| m.role == Role::User)
            .unwrap();
        assert_eq!(
            user.content[1],
            Part::text("[图片描述] a red kite over the sea")
        );
    }
    assert_eq!(*fake.vision_asks.lock().unwrap(), 1, "asked once per turn");
    // The window (checkpoints) keeps the image itself.
    assert_eq!(fake.saved_state(0).messages[0], photo);
}

#[tokio::test]
async fn images_pass_through_to_a_main_model_with_vision_or_when_unsure() {
    for vision in [Some(true), None] {
        let fake = Fake::scripted([reply_text("nice")]);
        *fake.vision.lock().unwrap() = vision;
        let mut j = job();
        j.messages = vec![Message::image(
            Role::User,
            "look",
            "https://example.invalid/k.png",
        )];
        let _ = run_turn(&fake, &j, 1, &CFG).await;
        assert!(
            fake.requests.lock().unwrap()[0]
                .messages
                .iter()
                .any(Message::has_image)
        );
    }
}

/// The loop bench's turn (benches/loop.rs): a session with history of the answering persona's
/// own answers, several tool rounds, then the answer. Only the first call sends the view whole;
/// every later step sends just what it appends (its tool call and result) to the replica
/// holding the rest, and the model sees exactly the view assembled whole.
#[tokio::test]
async fn every_step_after_the_first_continues_the_held_view_with_what_it_appends() {
    let fake = Fake::scripted(tool_steps_then(&["c1", "c2", "c3"], "done"));
    let mut j = job();
    let answer = |text: &str| Message {
        sender_name: "cyrene".into(),
        ..Message::text(Role::Assistant, text)
    };
    j.messages = vec![
        Message::text(Role::User, "earlier"),
        answer("an earlier answer"),
        Message::text(Role::User, "run the steps"),
    ];
    let done = completed(run_turn(&fake, &j, 1, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Final);
    assert_eq!(
        *fake.sent.lock().unwrap(),
        [None, Some(2), Some(2), Some(2)]
    );
    let requests = fake.requests.lock().unwrap();
    let window = fake.saved_state(3).messages;
    for (step, request) in requests.iter().enumerate() {
        // The blocks, then the window as it stood at the step: no lead, no note.
        let seen: Vec<&Message> = request.messages.iter().skip(2).collect();
        let expected: Vec<&Message> = window.iter().take(3 + 2 * step).collect();
        assert_eq!(seen, expected, "step {}", step + 1);
    }
}

/// A turn whose window holds one image fewer than a request keeps (vision on), and whose step 2
/// is steered a message of `n` more images: what each step's model saw, as (images shown,
/// images omitted), and how each step call was sent.
async fn a_turn_adding_images(n: usize) -> (Vec<(usize, usize)>, Vec<Option<usize>>) {
    use crate::images::{IMAGE_OMITTED, MAX_VIEW_IMAGES};
    let fake = Fake::scripted(tool_steps_then(&["c1", "c2"], "seen"));
    *fake.vision.lock().unwrap() = Some(true);
    let url = |name: String| format!("https://example.invalid/{name}.png");
    let mut j = job();
    j.messages = (0..MAX_VIEW_IMAGES - 1)
        .map(|i| Message::image(Role::User, "look", url(i.to_string())))
        .collect();
    let photos = (0..n)
        .map(|i| crate::fixtures::image(&url(format!("new-{i}"))))
        .collect();
    fake.then_steers(Ok(SteerResponse::default()));
    fake.then_steers(Ok(SteerResponse {
        messages: vec![SteeredMessage {
            id: "m2".into(),
            seq: 2,
            message: Message::with_parts(Role::User, photos),
        }],
    }));
    let done = completed(run_turn(&fake, &j, 1, &CFG).await);
    assert_eq!(done.outcome, TurnOutcome::Final);
    let images = |request: &ModelRequest| {
        let parts = request.messages.iter().flat_map(|m| &m.content);
        let shown = parts.clone().filter(|p| matches!(p, Part::ImageUrl { .. }));
        let omitted = parts.filter(|p| **p == Part::text(IMAGE_OMITTED));
        (shown.count(), omitted.count())
    };
    let seen = fake.requests.lock().unwrap().iter().map(images).collect();
    let sent = fake.sent.lock().unwrap().clone();
    (seen, sent)
}

/// A request keeps only its newest images (crate::images): a step whose appended images stay
/// within that continues the held view, but one that brings the view past it sends the view
/// whole, as the whole view then shows an older image as omitted where the held one has it.
#[tokio::test]
async fn a_step_that_brings_the_view_past_the_image_limit_sends_it_whole() {
    use crate::images::MAX_VIEW_IMAGES as MAX;
    let (seen, sent) = a_turn_adding_images(1).await;
    assert_eq!(seen, [(MAX - 1, 0), (MAX, 0), (MAX, 0)]);
    // Step 2 appended its tool call and result and the steered message. Step 3 goes whole as
    // every step after a steer does: its tool call and result come before the steered message.
    assert_eq!(sent, [None, Some(3), None]);

    let (seen, sent) = a_turn_adding_images(2).await;
    assert_eq!(seen, [(MAX - 1, 0), (MAX, 1), (MAX, 1)]);
    assert_eq!(sent, [None, None, None]);
}
