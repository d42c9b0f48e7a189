//! View assembly: the exact message list one model step sees (docs/architecture.md §5 step 1).
//!
//! Order, fixed:
//! 1. agent instructions (the first system message), then the time, working-memory and memory
//!    blocks in that order — each its own system message, each omitted when empty;
//! 2. the attribution lead (docs/semantics.md#attribution), when attribution renders at all;
//! 3. the conversation window, with attribution switch notes before the messages they announce;
//! 4. the steered messages claimed so far this turn, in claim order, attributed as a
//!    continuation of the window: a `[发言归属]` note holds from where it appears until the next
//!    one (docs/semantics.md#attribution), so a steered message whose speaker differs from the last
//!    attributed one gets its own note — a third party's message steered in never reads as the
//!    owner's;
//! 5. the parallel notice (docs/semantics.md#parallel-notice), last.
//!
//! Document parts are replaced here, in the conversation and in steered messages alike, by the
//! document's extracted text, or by a manifest line when no text could be extracted (see
//! [`manifest_line`]; docs/semantics.md#our-wording).
//!
//! # Invariants
//! - The **window** is only borrowed: steered messages, the notice, attribution notes and
//!   document replacements exist only in the returned **view**, so they never reach a checkpoint
//!   or memory extraction. A step's view is assembled whole, or — when it only appends to the
//!   last one ([`extend_view`]) — just what it appends; both give the same view.
//! - No `document` part survives into the view (providers never see one).
//! - Untrusted text stays where it came from: extracted document text replaces the part inside
//!   the same user message, never a system message.
//! - Untrusted text never reads as the runtime's: every conversation message is shown through
//!   [`attribution::defused`] (a `[发言归属]` a person typed is `［发言归属］` in the view), and a
//!   document's extracted text likewise (crate::documents::render).

use cyrene_protocol::message::{Message, Part, Role};

use crate::attribution::{self, PersonaNames, SpeakerEnv};
use crate::notice::{self, ParallelNotice};

/// The system blocks that open every view. An empty string means "no such block".
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ContextBlocks {
    /// The agent's instructions (persona system prompt): always the first system message.
    pub instructions: String,
    /// The current-time block.
    pub time: String,
    /// The working-memory block.
    pub working_memory: String,
    /// The long-term memory block.
    pub memory: String,
}

impl ContextBlocks {
    /// The non-empty blocks as system messages, in their fixed order.
    fn messages(&self) -> impl Iterator<Item = Message> + '_ {
        [
            &self.instructions,
            &self.time,
            &self.working_memory,
            &self.memory,
        ]
        .into_iter()
        .filter(|block| !block.is_empty())
        .map(|block| Message::text(Role::System, block.clone()))
    }
}

/// Opens the time block.
pub const TIME_BLOCK_MARKER: &str = "[当前时间] ";

/// The time block: `[当前时间] 2026-11-30 03:01（UTC，星期一）`, to the minute, in UTC. The
/// reference fixes only its place (after the instructions, before working memory and memory); this
/// wording is ours. It is a system message like the other blocks, so it never touches user text.
pub fn time_block(now: chrono::DateTime<chrono::Utc>) -> String {
    use chrono::{Datelike, Weekday};
    let weekday = match now.weekday() {
        Weekday::Mon => "星期一",
        Weekday::Tue => "星期二",
        Weekday::Wed => "星期三",
        Weekday::Thu => "星期四",
        Weekday::Fri => "星期五",
        Weekday::Sat => "星期六",
        Weekday::Sun => "星期日",
    };
    format!(
        "{TIME_BLOCK_MARKER}{}（UTC，{weekday}）",
        now.format("%Y-%m-%d %H:%M")
    )
}

/// A user message steered into the running turn at a boundary, with the orchestrator's server
/// id and per-session sequence number (the `cyrene.turn.steer` reply item).
pub use cyrene_protocol::turn::SteeredMessage;

/// Appends `incoming` to `steered` in order, skipping any message whose id is already there
/// (a steer reply repeats every message claimed by this turn after `after_seq`, and a resumed
/// turn gets its earlier ones back). Returns the ids newly appended, in order, for `steer_ack`.
pub fn merge_steered(
    steered: &mut Vec<SteeredMessage>,
    incoming: impl IntoIterator<Item = SteeredMessage>,
) -> Vec<String> {
    let mut added = Vec::new();
    for message in incoming {
        let duplicate =
            !message.id.is_empty() && steered.iter().any(|existing| existing.id == message.id);
        if duplicate {
            continue;
        }
        added.push(message.id.clone());
        steered.push(message);
    }
    added
}

/// The `after_seq` for the next steer call: the highest sequence number seen, 0 when none.
pub fn last_seq(steered: &[SteeredMessage]) -> u64 {
    steered.iter().map(|m| m.seq).max().unwrap_or(0)
}

/// A borrowed view of a `document` part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DocumentRef<'a> {
    /// Server-issued document name (`d-…`).
    pub name: &'a str,
    /// Byte-sniffed MIME type.
    pub mime: &'a str,
    /// Server-issued local URL (`cyrene-doc://…`).
    pub url: &'a str,
    /// Size in bytes.
    pub size: u64,
}

/// Supplies a document's extracted text at assembly. Any `Fn(DocumentRef<'_>) -> Option<String>`
/// is one.
pub trait DocumentExtractor {
    /// The document's text, or `None` when none could be extracted (unknown document,
    /// unsupported type, extraction failure).
    fn extract(&self, document: DocumentRef<'_>) -> Option<String>;
}

impl<F> DocumentExtractor for F
where
    F: Fn(DocumentRef<'_>) -> Option<String>,
{
    fn extract(&self, document: DocumentRef<'_>) -> Option<String> {
        self(document)
    }
}

/// An extractor that never has text: every document becomes its manifest line.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoExtraction;

impl DocumentExtractor for NoExtraction {
    fn extract(&self, _document: DocumentRef<'_>) -> Option<String> {
        None
    }
}

/// The line standing in for a document whose text could not be extracted:
/// `[文档] {name}（{mime}，{size} 字节）：未能提取文字内容。` It names the attachment (server-issued
/// name, sniffed MIME, size) so the model can say it received a file it cannot read, rather
/// than silently missing it. The wording is ours (docs/semantics.md#our-wording).
pub fn manifest_line(document: DocumentRef<'_>) -> String {
    format!(
        "[文档] {}（{}，{} 字节）：未能提取文字内容。",
        document.name, document.mime, document.size
    )
}

/// A copy of `message` with every document part replaced by a text part: the extracted text
/// verbatim, or the [`manifest_line`] when extraction gives nothing (or only whitespace).
/// Every other part is copied unchanged and in place.
pub fn replace_documents(message: &Message, extractor: &dyn DocumentExtractor) -> Message {
    let has_document = message
        .content
        .iter()
        .any(|p| matches!(p, Part::Document { .. }));
    if !has_document {
        return message.clone();
    }
    let content = message
        .content
        .iter()
        .map(|part| match part {
            Part::Document {
                name,
                mime,
                url,
                size,
            } => {
                let document = DocumentRef {
                    name,
                    mime,
                    url,
                    size: *size,
                };
                let text = extractor
                    .extract(document)
                    .filter(|text| !text.trim().is_empty())
                    .unwrap_or_else(|| manifest_line(document));
                Part::Text { text }
            }
            other => other.clone(),
        })
        .collect();
    Message {
        role: message.role,
        content,
        sender_name: message.sender_name.clone(),
        sender_kind: message.sender_kind,
        tool_call_id: message.tool_call_id.clone(),
        tool_call_name: message.tool_call_name.clone(),
    }
}

/// Everything one step's view is built from.
#[derive(Debug, Clone, Copy)]
pub struct ViewInputs<'a> {
    /// The opening system blocks.
    pub blocks: &'a ContextBlocks,
    /// The turn's window (seeded messages plus completed steps); borrowed, never changed.
    pub window: &'a [Message],
    /// Session facts for attribution.
    pub speakers: &'a SpeakerEnv,
    /// Persona display names for attribution labels.
    pub names: &'a PersonaNames,
    /// Messages steered into this turn so far.
    pub steered: &'a [SteeredMessage],
    /// The parallel-leg notice, when this leg runs beside another.
    pub notice: Option<&'a ParallelNotice>,
}

/// Builds one step's view in the order of the module docs. The window is left untouched.
pub fn assemble_view(inputs: &ViewInputs<'_>, documents: &dyn DocumentExtractor) -> Vec<Message> {
    assemble_shaped(inputs, documents).0
}

/// How a view was assembled: what [`extend_view`] needs to tell whether the next step's view
/// only appends to it, and to build what it appends.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ViewShape {
    blocks: ContextBlocks,
    window: usize,
    steered: usize,
    noticed: bool,
    attribution: attribution::PlanEnd,
    /// The image parts of the view (every one of its conversation's).
    images: usize,
}

/// How many image parts `message` has.
fn images_of(message: &Message) -> usize {
    let images = message.content.iter();
    images
        .filter(|p| matches!(p, Part::ImageUrl { .. }))
        .count()
}

/// [`assemble_view`], and the view's [`ViewShape`].
pub fn assemble_shaped(
    inputs: &ViewInputs<'_>,
    documents: &dyn DocumentExtractor,
) -> (Vec<Message>, ViewShape) {
    // The window and the steered messages are one conversation for attribution.
    let conversation = inputs
        .window
        .iter()
        .chain(inputs.steered.iter().map(|s| &s.message));
    let (plan, end) = attribution::plan_to_end(conversation.clone(), inputs.speakers, inputs.names);
    let notes = plan.as_ref().map_or(0, |p| p.notes.len() + 1);
    let mut view = Vec::with_capacity(
        4 + notes
            + inputs.window.len()
            + inputs.steered.len()
            + usize::from(inputs.notice.is_some()),
    );
    view.extend(inputs.blocks.messages());
    let replace = |m: &Message| replace_documents(&attribution::defused(m), documents);
    match plan {
        Some(plan) => {
            view.push(plan.lead);
            view.extend(attribution::interleave(
                conversation,
                0,
                &plan.notes,
                replace,
            ));
        }
        None => view.extend(conversation.map(replace)),
    }
    notice::append_notice(&mut view, inputs.notice);
    let images = inputs.window.iter().map(images_of).sum::<usize>()
        + inputs
            .steered
            .iter()
            .map(|s| images_of(&s.message))
            .sum::<usize>();
    (view, ViewShape::of(inputs, end, images))
}

impl ViewShape {
    /// The shape of the view of `inputs` holding `images` images, attribution standing at
    /// `attribution` at its end.
    fn of(inputs: &ViewInputs<'_>, attribution: attribution::PlanEnd, images: usize) -> ViewShape {
        ViewShape {
            blocks: inputs.blocks.clone(),
            window: inputs.window.len(),
            steered: inputs.steered.len(),
            noticed: inputs.notice.is_some(),
            attribution,
            images,
        }
    }

    /// How many images the view holds: a request keeps only its newest ones (crate::images),
    /// so a view past that limit is no longer the held one followed by what it appends.
    pub fn images(&self) -> usize {
        self.images
    }
}

/// What the view of `inputs` appends to the view assembled as `shape`, and its own shape; `None`
/// when it is no such extension and must be assembled whole ([`assemble_shaped`]).
///
/// It is one when the blocks are the same, no parallel notice closes the old view, the
/// conversation only grew at its end (new window messages while nothing was steered in yet, or
/// new steered messages), and attribution did not start to render with what was added. Then
/// every message already in the view is built from the same inputs as before (a note depends
/// only on the messages before it, a document's text and the lead are fixed for the turn), so
/// the whole view is exactly the old one followed by what this returns — a test checks it
/// against [`assemble_view`].
pub fn extend_view(
    inputs: &ViewInputs<'_>,
    documents: &dyn DocumentExtractor,
    shape: &ViewShape,
) -> Option<(Vec<Message>, ViewShape)> {
    let grows_at_end = inputs.window.len() >= shape.window
        && inputs.steered.len() >= shape.steered
        && (shape.steered == 0 || inputs.window.len() == shape.window);
    if !grows_at_end || shape.noticed || *inputs.blocks != shape.blocks {
        return None;
    }
    let added = inputs.window[shape.window..]
        .iter()
        .chain(inputs.steered[shape.steered..].iter().map(|s| &s.message));
    let len = shape.window + shape.steered;
    let mut end = shape.attribution.clone();
    let notes = end.plan_more(added.clone(), len, inputs.speakers, inputs.names)?;
    let replace = |m: &Message| replace_documents(&attribution::defused(m), documents);
    let images = shape.images + added.clone().map(images_of).sum::<usize>();
    let mut messages = attribution::interleave(added, len, &notes, replace);
    notice::append_notice(&mut messages, inputs.notice);
    Some((messages, ViewShape::of(inputs, end, images)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attribution::{ROLE_CONTEXT_MARKER, SPEAKER_SWITCH_MARKER};
    use crate::notice::PARALLEL_NOTICE_HEADER;

    use crate::fixtures::{assistant, user, user_parts};

    fn document(name: &str) -> Part {
        crate::fixtures::pdf(name, 2048)
    }

    fn steered(id: &str, seq: u64, text: &str) -> SteeredMessage {
        SteeredMessage {
            id: id.into(),
            seq,
            message: user(text),
        }
    }

    fn all_blocks() -> ContextBlocks {
        ContextBlocks {
            instructions: "instructions".into(),
            time: "time".into(),
            working_memory: "working memory".into(),
            memory: "memory".into(),
        }
    }

    struct Fixture {
        blocks: ContextBlocks,
        window: Vec<Message>,
        speakers: SpeakerEnv,
        names: PersonaNames,
        steered: Vec<SteeredMessage>,
        notice: Option<ParallelNotice>,
    }

    impl Fixture {
        fn new(window: Vec<Message>) -> Fixture {
            Fixture {
                blocks: all_blocks(),
                window,
                speakers: SpeakerEnv::new(false, "cyrene"),
                names: [("cyrene", "昔涟"), ("hoshi", "星")].into_iter().collect(),
                steered: Vec::new(),
                notice: None,
            }
        }

        fn inputs(&self) -> ViewInputs<'_> {
            ViewInputs {
                blocks: &self.blocks,
                window: &self.window,
                speakers: &self.speakers,
                names: &self.names,
                steered: &self.steered,
                notice: self.notice.as_ref(),
            }
        }

        fn view(&self) -> Vec<Message> {
            assemble_view(&self.inputs(), &NoExtraction)
        }

        fn texts(&self) -> Vec<(Role, String)> {
            self.view()
                .iter()
                .map(|m| (m.role, m.text_content()))
                .collect()
        }
    }

    fn sys(text: &str) -> (Role, String) {
        (Role::System, text.to_owned())
    }

    fn line(role: Role, text: &str) -> (Role, String) {
        (role, text.to_owned())
    }

    fn is_note(entry: &(Role, String)) -> bool {
        entry.0 == Role::System && entry.1.starts_with(SPEAKER_SWITCH_MARKER)
    }

    #[test]
    fn blocks_come_first_in_fixed_order_then_the_conversation() {
        let fx = Fixture::new(vec![user("hi"), assistant("hello")]);
        assert_eq!(
            fx.texts(),
            vec![
                sys("instructions"),
                sys("time"),
                sys("working memory"),
                sys("memory"),
                line(Role::User, "hi"),
                line(Role::Assistant, "hello"),
            ]
        );
    }

    #[test]
    fn the_time_block_names_the_minute_and_weekday_in_utc() {
        let at = chrono::DateTime::parse_from_rfc3339("2026-11-30T03:01:41+00:00")
            .unwrap()
            .with_timezone(&chrono::Utc);
        assert_eq!(time_block(at), "[当前时间] 2026-11-30 03:01（UTC，星期一）");
    }

    #[test]
    fn empty_blocks_are_omitted_and_order_is_kept() {
        let mut fx = Fixture::new(vec![user("hi")]);
        fx.blocks = ContextBlocks {
            instructions: String::new(),
            time: "time".into(),
            working_memory: String::new(),
            memory: "memory".into(),
        };
        assert_eq!(
            fx.texts(),
            vec![sys("time"), sys("memory"), line(Role::User, "hi")]
        );
        fx.blocks = ContextBlocks::default();
        assert_eq!(fx.texts(), vec![line(Role::User, "hi")]);
    }

    #[test]
    fn attribution_lead_follows_the_blocks_and_notes_precede_their_messages() {
        let fx = Fixture::new(vec![user("q"), assistant("a").sender("hoshi")]);
        let texts = fx.texts();
        assert_eq!(
            texts[..4],
            [
                sys("instructions"),
                sys("time"),
                sys("working memory"),
                sys("memory"),
            ]
        );
        assert!(
            texts[4].1.starts_with(ROLE_CONTEXT_MARKER),
            "{:?}",
            texts[4]
        );
        assert_eq!(texts[4].0, Role::System);
        assert_eq!(texts[5], line(Role::User, "q"));
        assert!(is_note(&texts[6]));
        assert!(texts[6].1.contains("「星」（hoshi）"));
        assert_eq!(texts[7], line(Role::Assistant, "a"));
        assert_eq!(texts.len(), 8);
    }

    #[test]
    fn unlabelled_conversation_gets_no_attribution() {
        let fx = Fixture::new(vec![user("q"), assistant("a")]);
        assert!(
            fx.texts()
                .iter()
                .all(|(_, t)| !t.starts_with(ROLE_CONTEXT_MARKER)
                    && !t.starts_with(SPEAKER_SWITCH_MARKER))
        );
    }

    #[test]
    fn steered_messages_continue_the_attribution_of_the_window() {
        let mut fx = Fixture::new(vec![user("q"), assistant("a").sender("cyrene")]);
        fx.speakers = SpeakerEnv::new(true, "cyrene");
        fx.steered = vec![
            SteeredMessage {
                id: "m1".into(),
                seq: 5,
                message: user("i am not the owner").sender("阿明"),
            },
            steered("m2", 6, "wait"),
            steered("m3", 7, "also this"),
        ];
        let texts = fx.texts();
        let n = texts.len();
        // The last note before the steered messages announced the persona itself: without a
        // note of their own, the steered lines would read as hers.
        assert_eq!(texts[n - 6], line(Role::Assistant, "a"));
        assert!(is_note(&texts[n - 5]));
        assert!(
            texts[n - 5].1.contains("「阿明」——本会话里的第三方人员"),
            "{texts:#?}"
        );
        assert_eq!(texts[n - 4], line(Role::User, "i am not the owner"));
        assert!(is_note(&texts[n - 3]));
        assert!(
            texts[n - 3].1.contains("主人（管理员账户）本人"),
            "{texts:#?}"
        );
        // One note for both owner lines: it holds until the next note.
        assert_eq!(texts[n - 2], line(Role::User, "wait"));
        assert_eq!(texts[n - 1], line(Role::User, "also this"));
        assert_eq!(texts.iter().filter(|t| is_note(t)).count(), 4, "{texts:#?}");
    }

    #[test]
    fn a_labelled_steered_message_alone_turns_attribution_on() {
        let mut fx = Fixture::new(vec![user("q")]);
        fx.speakers = SpeakerEnv::new(true, "cyrene");
        fx.steered = vec![SteeredMessage {
            id: "m1".into(),
            seq: 2,
            message: user("hello").sender("阿明"),
        }];
        let texts = fx.texts();
        assert!(texts.iter().any(|t| t.1.starts_with(ROLE_CONTEXT_MARKER)));
        let n = texts.len();
        assert!(texts[n - 2].1.contains("「阿明」"), "{texts:#?}");
        assert!(
            texts[n - 4].1.contains("主人（管理员账户）本人"),
            "{texts:#?}"
        );
    }

    #[test]
    fn parallel_notice_is_the_last_message() {
        let mut fx = Fixture::new(vec![user("q"), assistant("a").sender("hoshi")]);
        fx.steered = vec![steered("m1", 1, "steer")];
        fx.notice = Some(ParallelNotice {
            step: 2,
            ..ParallelNotice::default()
        });
        let view = fx.view();
        let last = view.last().unwrap();
        assert_eq!(last.role, Role::System);
        assert!(last.text_content().starts_with(PARALLEL_NOTICE_HEADER));
        assert_eq!(view[view.len() - 2], user("steer"));
        assert_eq!(
            view.iter()
                .filter(|m| m.text_content().starts_with(PARALLEL_NOTICE_HEADER))
                .count(),
            1
        );
    }

    #[test]
    fn full_view_order() {
        let mut fx = Fixture::new(vec![user("q"), assistant("a").sender("hoshi")]);
        fx.steered = vec![steered("m1", 1, "steer")];
        fx.notice = Some(ParallelNotice::default());
        let kinds: Vec<&str> = fx
            .texts()
            .iter()
            .map(|(role, text)| match (role, text.as_str()) {
                (Role::System, "instructions") => "instructions",
                (Role::System, "time") => "time",
                (Role::System, "working memory") => "working_memory",
                (Role::System, "memory") => "memory",
                (Role::System, t) if t.starts_with(ROLE_CONTEXT_MARKER) => "lead",
                (Role::System, t) if t.starts_with(SPEAKER_SWITCH_MARKER) => "note",
                (Role::System, t) if t.starts_with(PARALLEL_NOTICE_HEADER) => "notice",
                (Role::User, "q") => "window_user",
                (Role::Assistant, "a") => "window_assistant",
                (Role::User, "steer") => "steered",
                _ => "unexpected",
            })
            .collect();
        assert_eq!(
            kinds,
            vec![
                "instructions",
                "time",
                "working_memory",
                "memory",
                "lead",
                "window_user",
                "note",
                "window_assistant",
                "steered",
                "notice",
            ]
        );
    }

    #[test]
    fn window_is_unchanged_by_assembly() {
        let mut fx = Fixture::new(vec![
            user_parts(vec![Part::text("read"), document("d-1")]),
            assistant("a").sender("hoshi"),
        ]);
        fx.steered = vec![steered("m1", 1, "steer")];
        fx.notice = Some(ParallelNotice::default());
        let before = fx.window.clone();
        let view = fx.view();
        assert_eq!(fx.window, before);
        assert!(view.len() > fx.window.len());
        assert!(!fx.window.iter().any(|m| m.text_content() == "steer"));
        // Assembling twice gives the same view: nothing accumulated anywhere.
        assert_eq!(fx.view(), view);
    }

    #[test]
    fn documents_are_replaced_by_extracted_text_in_place() {
        let fx = Fixture::new(vec![
            user_parts(vec![
                Part::text("before "),
                document("d-1"),
                Part::text(" after"),
            ])
            .sender("阿明"),
        ]);
        let extractor = |doc: DocumentRef<'_>| Some(format!("text of {}", doc.name));
        let view = assemble_view(&fx.inputs(), &extractor);
        let message = view.iter().find(|m| m.role == Role::User).unwrap();
        assert_eq!(
            message.content,
            vec![
                Part::text("before "),
                Part::text("text of d-1"),
                Part::text(" after"),
            ]
        );
        assert_eq!(message.sender_name, "阿明");
    }

    #[test]
    fn documents_without_text_become_a_manifest_line() {
        let fx = Fixture::new(vec![user_parts(vec![document("d-9")])]);
        let view = fx.view();
        assert_eq!(
            view.last().unwrap().content,
            vec![Part::text(
                "[文档] d-9（application/pdf，2048 字节）：未能提取文字内容。"
            )]
        );
    }

    #[test]
    fn blank_extraction_counts_as_none() {
        let doc = DocumentRef {
            name: "d-1",
            mime: "text/plain",
            url: "cyrene-doc://d-1",
            size: 3,
        };
        let message = user_parts(vec![document("d-1")]);
        let blank = |_: DocumentRef<'_>| Some("  \n".to_owned());
        let out = replace_documents(&message, &blank);
        assert_eq!(out.content.len(), 1);
        assert!(out.text_content().starts_with("[文档] d-1"));
        assert_eq!(
            manifest_line(doc),
            "[文档] d-1（text/plain，3 字节）：未能提取文字内容。"
        );
    }

    #[test]
    fn documents_in_steered_messages_are_replaced_too() {
        let mut fx = Fixture::new(vec![user("q")]);
        fx.steered = vec![SteeredMessage {
            id: "m1".into(),
            seq: 1,
            message: user_parts(vec![document("d-2")]),
        }];
        let view = fx.view();
        assert!(
            view.iter()
                .flat_map(|m| &m.content)
                .all(|p| !matches!(p, Part::Document { .. }))
        );
        assert!(view.last().unwrap().text_content().contains("d-2"));
        // The steered list itself keeps its document.
        assert!(matches!(
            fx.steered[0].message.content[0],
            Part::Document { .. }
        ));
    }

    #[test]
    fn messages_without_documents_are_copied_exactly() {
        let message = Message::image(Role::User, "look", "https://x/a.png").sender("阿明");
        assert_eq!(replace_documents(&message, &NoExtraction), message);
        let tool = Message::tool_result("c1", "t", "r", true);
        assert_eq!(replace_documents(&tool, &NoExtraction), tool);
    }

    #[test]
    fn merge_steered_appends_in_order_and_reports_new_ids() {
        let mut list = Vec::new();
        let added = merge_steered(
            &mut list,
            vec![steered("m1", 3, "a"), steered("m2", 4, "b")],
        );
        assert_eq!(added, vec!["m1", "m2"]);
        let added = merge_steered(&mut list, vec![steered("m3", 5, "c")]);
        assert_eq!(added, vec!["m3"]);
        let ids: Vec<&str> = list.iter().map(|s| s.id.as_str()).collect();
        assert_eq!(ids, vec!["m1", "m2", "m3"]);
    }

    #[test]
    fn merge_steered_skips_ids_already_merged() {
        let mut list = vec![steered("m1", 3, "a")];
        // A resumed turn's steer reply repeats every message this turn claimed.
        let added = merge_steered(
            &mut list,
            vec![
                steered("m1", 3, "a"),
                steered("m2", 4, "b"),
                steered("m2", 4, "b"),
            ],
        );
        assert_eq!(added, vec!["m2"]);
        assert_eq!(list.len(), 2);
        assert_eq!(merge_steered(&mut list, Vec::new()), Vec::<String>::new());
    }

    #[test]
    fn merge_steered_never_dedupes_messages_without_ids() {
        let mut list = Vec::new();
        merge_steered(&mut list, vec![steered("", 0, "a"), steered("", 0, "b")]);
        assert_eq!(list.len(), 2);
    }

    #[test]
    fn last_seq_is_the_highest_seen() {
        assert_eq!(last_seq(&[]), 0);
        assert_eq!(last_seq(&[steered("m1", 7, "a"), steered("m2", 9, "b")]), 9);
    }

    /// A random conversation growing step by step: whenever [`extend_view`] says the new view
    /// extends the last one, the last one followed by what it returns is exactly the view
    /// assembled whole, with the same shape (its image count included, which is the view's).
    #[test]
    fn an_extended_view_is_the_view_assembled_whole() {
        let mut seed = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let documents =
            |d: DocumentRef<'_>| (d.name != "unread").then(|| format!("text of {}", d.name));
        let (mut extended, mut whole) = (0, 0);
        for run in 0..200 {
            let message = |next: &mut dyn FnMut(u64) -> u64| -> Message {
                let mut m = match next(7) {
                    0 => user("a user line"),
                    1 => user_parts(vec![
                        Part::text("see"),
                        document(["a", "unread"][next(2) as usize]),
                    ]),
                    3 => user_parts(
                        (0..=next(2))
                            .map(|i| crate::fixtures::image(&format!("https://x/{i}.png")))
                            .collect(),
                    ),
                    2 => Message {
                        tool_call_id: "c1".into(),
                        ..Message::text(Role::Tool, "a result")
                    },
                    _ => assistant("an answer"),
                };
                if next(8) == 0 {
                    m.sender_name = ["hoshi", "cyrene", "小王", " "][next(4) as usize].into();
                }
                if next(12) == 0 {
                    m.sender_kind = cyrene_protocol::message::SenderKind::Agent;
                }
                m
            };
            let mut fx = Fixture::new((0..next(6)).map(|_| message(&mut next)).collect());
            fx.speakers = SpeakerEnv::new(run % 3 == 0, "cyrene");
            if run % 2 == 0 {
                fx.blocks = ContextBlocks::default();
            }
            let (mut view, mut shape) = assemble_shaped(&fx.inputs(), &documents);
            for step in 0..12u64 {
                match next(10) {
                    0 => fx.steered.push(SteeredMessage {
                        id: format!("m{step}"),
                        seq: step,
                        message: message(&mut next),
                    }),
                    1 => fx.notice = Some(ParallelNotice::default()),
                    2 => fx.blocks.memory.push_str(" more"),
                    _ => {}
                }
                if fx.notice.is_some() && next(2) == 0 {
                    fx.notice = None;
                }
                for _ in 0..next(3) {
                    fx.window.push(message(&mut next));
                }
                let (all, all_shape) = assemble_shaped(&fx.inputs(), &documents);
                let images: usize = all.iter().map(images_of).sum();
                assert_eq!(all_shape.images(), images, "run {run} step {step}");
                match extend_view(&fx.inputs(), &documents, &shape) {
                    Some((added, added_shape)) => {
                        extended += 1;
                        view.extend(added);
                        assert_eq!(view, all, "run {run} step {step}");
                        assert_eq!(added_shape, all_shape, "run {run} step {step}");
                    }
                    None => whole += 1,
                }
                (view, shape) = (all, all_shape);
            }
        }
        assert!(
            extended > 1000 && whole > 100,
            "{extended} extended, {whole} whole"
        );
    }
}
