//! What an MCP tool is to Cyrene (pure): its endpoint name and metadata, and its result as a
//! Cyrene tool reply (docs/tools.md, "Bridging MCP servers").
//!
//! # Invariants
//! - A tool's endpoint is `cyrene.tool.<server>__<tool>`, the names as given; a tool whose name
//!   cannot be a subject token (dots, spaces, over 128 characters together) is left out, logged.
//! - Annotations are hints from the server: `readOnlyHint` or `idempotentHint` true →
//!   `cyrene.tool.idempotent` = `true` (else `false`); `destructiveHint` true (and not read-only)
//!   → `cyrene.tool.approval` = `required`. Enforcing the approval is not the bridge's.
//! - A reply fits the bus: text is cut at [`MAX_TEXT_BYTES`], images past [`MAX_IMAGE_BYTES`]
//!   in all become a note in the text.

use cyrene_protocol::ids::{self, IdKind};
use rmcp::model::{CallToolResult, ContentBlock, ResourceContents, Tool};
use serde::Serialize;
use serde_json::Value;

/// Endpoint metadata key of a tool's description (as the worker reads it).
pub const META_DESCRIPTION: &str = "cyrene.tool.description";
/// Endpoint metadata key of a tool's JSON-schema parameters (a JSON string).
pub const META_PARAMETERS: &str = "cyrene.tool.parameters";
/// Endpoint metadata key: whether running a call twice does no more than once (`true`/`false`).
pub const META_IDEMPOTENT: &str = "cyrene.tool.idempotent";
/// Endpoint metadata key: `required` when a person should approve each call (issue 35's).
pub const META_APPROVAL: &str = "cyrene.tool.approval";
/// Endpoint metadata key: the MCP server a bridged tool comes from.
pub const META_MCP_SERVER: &str = "cyrene.tool.mcp_server";

/// The longest description kept, in bytes (cut at a character boundary).
pub const MAX_DESCRIPTION_BYTES: usize = 4 * 1024;
/// The largest input schema bridged; a tool with a larger one is left out.
pub const MAX_SCHEMA_BYTES: usize = 32 * 1024;
/// The longest result text, in bytes.
pub const MAX_TEXT_BYTES: usize = 256 * 1024;
/// The most image bytes (as `data:` URIs) one result carries.
pub const MAX_IMAGE_BYTES: usize = 512 * 1024;

/// A bridged tool: its endpoint name and metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bridged {
    /// The tool's name at its server.
    pub tool: String,
    /// `<server>__<tool>`: the endpoint's name and the subject's last token.
    pub endpoint: String,
    pub metadata: Vec<(String, String)>,
}

/// Why a tool was left out.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Skipped {
    #[error("its name cannot be a tool name: {0}")]
    Name(#[source] ids::IdError),
    #[error("its input schema is larger than {MAX_SCHEMA_BYTES} bytes")]
    Schema,
}

/// The endpoint of `tool` of server `server`.
pub fn bridge(server: &str, tool: &Tool) -> Result<Bridged, Skipped> {
    let endpoint = format!("{server}__{}", tool.name);
    ids::validate(IdKind::Tool, &endpoint).map_err(Skipped::Name)?;
    let schema = serde_json::to_string(&*tool.input_schema).unwrap_or_else(|_| "{}".into());
    if schema.len() > MAX_SCHEMA_BYTES {
        return Err(Skipped::Schema);
    }
    let description = tool
        .description
        .as_deref()
        .filter(|d| !d.trim().is_empty())
        .or(tool.title.as_deref())
        .or_else(|| tool.annotations.as_ref().and_then(|a| a.title.as_deref()))
        .unwrap_or_default();
    let hints = tool.annotations.as_ref();
    let read_only = hints.and_then(|a| a.read_only_hint) == Some(true);
    let idempotent = read_only || hints.and_then(|a| a.idempotent_hint) == Some(true);
    let destructive = !read_only && hints.and_then(|a| a.destructive_hint) == Some(true);
    let mut metadata = vec![
        (
            META_DESCRIPTION.to_owned(),
            cut(description, MAX_DESCRIPTION_BYTES).to_owned(),
        ),
        (META_PARAMETERS.to_owned(), schema),
        (META_IDEMPOTENT.to_owned(), idempotent.to_string()),
        (META_MCP_SERVER.to_owned(), server.to_owned()),
    ];
    if destructive {
        metadata.push((META_APPROVAL.to_owned(), "required".to_owned()));
    }
    Ok(Bridged {
        tool: tool.name.to_string(),
        endpoint,
        metadata,
    })
}

/// A Cyrene tool reply (docs/loop-worker.md, "Tools"): `images` are `data:` URIs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Reply {
    pub text: String,
    pub is_error: bool,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub images: Vec<String>,
}

impl Reply {
    /// An error result with `text`.
    pub fn error(text: impl Into<String>) -> Reply {
        Reply {
            text: text.into(),
            is_error: true,
            images: Vec::new(),
        }
    }
}

/// An MCP result as a reply: text blocks (and embedded text resources) joined by line breaks,
/// images as `data:` URIs, what has no place a short note; `structuredContent` as JSON text when
/// there is no content; `isError` kept.
pub fn reply(result: &CallToolResult) -> Reply {
    let mut texts = Vec::new();
    let mut images = Vec::new();
    let mut image_bytes = 0;
    for block in &result.content {
        match block {
            ContentBlock::Text(t) => texts.push(t.text.clone()),
            ContentBlock::Image(image) => {
                let uri = format!("data:{};base64,{}", image.mime_type, image.data);
                if !image.mime_type.starts_with("image/") || !is_base64(&image.data) {
                    texts.push("[an image the server sent was not valid; left out]".into());
                } else if image_bytes + uri.len() > MAX_IMAGE_BYTES {
                    texts.push(format!(
                        "[an image of {} bytes was left out: a result carries at most {MAX_IMAGE_BYTES} bytes of images]",
                        uri.len()
                    ));
                } else {
                    image_bytes += uri.len();
                    images.push(uri);
                }
            }
            ContentBlock::Audio(a) => texts.push(format!("[audio ({}) left out]", a.mime_type)),
            ContentBlock::Resource(r) => match &r.resource {
                ResourceContents::TextResourceContents { text, uri, .. } => {
                    texts.push(format!("[resource {uri}]\n{text}"))
                }
                other => texts.push(format!(
                    "[binary resource {} left out]",
                    resource_uri(other)
                )),
            },
            ContentBlock::ResourceLink(link) => {
                texts.push(format!("[resource link {} ({})]", link.uri, link.name))
            }
            _ => texts.push("[content of a kind the bridge does not know left out]".into()),
        }
    }
    if texts.is_empty()
        && images.is_empty()
        && let Some(structured) = &result.structured_content
    {
        texts.push(structured.to_string());
    }
    let mut text = texts.join("\n");
    if text.len() > MAX_TEXT_BYTES {
        let kept = cut(&text, MAX_TEXT_BYTES).len();
        text.truncate(kept);
        text.push_str("\n[… the rest of the result was cut]");
    }
    Reply {
        text,
        is_error: result.is_error == Some(true),
        images,
    }
}

fn resource_uri(r: &ResourceContents) -> &str {
    match r {
        ResourceContents::TextResourceContents { uri, .. } => uri,
        ResourceContents::BlobResourceContents { uri, .. } => uri,
        _ => "?",
    }
}

fn is_base64(data: &str) -> bool {
    !data.is_empty()
        && data
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'='))
}

/// `text` cut to at most `max` bytes at a character boundary.
pub fn cut(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// The arguments object of a request body: an object, or an error text for the caller.
pub fn arguments(body: Value) -> Result<serde_json::Map<String, Value>, String> {
    match body {
        Value::Object(map) => Ok(map),
        Value::Null => Ok(serde_json::Map::new()),
        other => Err(format!(
            "the arguments must be a JSON object, not {}",
            match other {
                Value::Array(_) => "an array",
                Value::String(_) => "a string",
                Value::Number(_) => "a number",
                _ => "a boolean",
            }
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rmcp::model::ToolAnnotations;
    use serde_json::json;

    fn tool(value: Value) -> Tool {
        serde_json::from_value(value).unwrap()
    }

    fn meta(b: &Bridged, key: &str) -> Option<String> {
        b.metadata
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.clone())
    }

    #[test]
    fn a_tool_becomes_an_endpoint_with_the_worker_s_metadata() {
        let t = tool(json!({"name": "get_current_time", "description": "Now.",
            "inputSchema": {"type": "object", "properties": {"timezone": {"type": "string"}}}}));
        let b = bridge("time", &t).unwrap();
        assert_eq!(b.endpoint, "time__get_current_time");
        assert_eq!(meta(&b, META_DESCRIPTION).unwrap(), "Now.");
        let schema: Value = serde_json::from_str(&meta(&b, META_PARAMETERS).unwrap()).unwrap();
        assert_eq!(schema["properties"]["timezone"]["type"], "string");
        assert_eq!(meta(&b, META_IDEMPOTENT).unwrap(), "false");
        assert_eq!(meta(&b, META_APPROVAL), None);
        let dashed = tool(json!({"name": "get-sum", "inputSchema": {"type": "object"}}));
        assert_eq!(
            bridge("every-thing", &dashed).unwrap().endpoint,
            "every-thing__get-sum"
        );
    }

    #[test]
    fn annotations_map_to_idempotent_and_approval() {
        let with = |a: Value| {
            let t = tool(json!({"name": "t", "inputSchema": {"type": "object"}, "annotations": a}));
            let b = bridge("s", &t).unwrap();
            (meta(&b, META_IDEMPOTENT).unwrap(), meta(&b, META_APPROVAL))
        };
        assert_eq!(with(json!({"readOnlyHint": true})), ("true".into(), None));
        assert_eq!(with(json!({"idempotentHint": true})), ("true".into(), None));
        assert_eq!(
            with(json!({"destructiveHint": true})),
            ("false".into(), Some("required".into()))
        );
        // read-only wins: destructiveHint means nothing on a read-only tool (the spec's words)
        assert_eq!(
            with(json!({"readOnlyHint": true, "destructiveHint": true})),
            ("true".into(), None)
        );
        let _ = ToolAnnotations::default();
    }

    #[test]
    fn names_that_cannot_be_subjects_and_huge_schemas_are_left_out() {
        for name in ["files.read", "a b", "x>", &"n".repeat(200)] {
            let t = tool(json!({"name": name, "inputSchema": {"type": "object"}}));
            assert!(matches!(bridge("s", &t), Err(Skipped::Name(_))), "{name}");
        }
        let big = tool(json!({"name": "t", "inputSchema": {"type": "object",
            "description": "x".repeat(MAX_SCHEMA_BYTES)}}));
        assert_eq!(bridge("s", &big), Err(Skipped::Schema));
        let long = tool(
            json!({"name": "t", "description": "é".repeat(MAX_DESCRIPTION_BYTES),
            "inputSchema": {"type": "object"}}),
        );
        assert!(
            meta(&bridge("s", &long).unwrap(), META_DESCRIPTION)
                .unwrap()
                .len()
                <= MAX_DESCRIPTION_BYTES
        );
    }

    #[test]
    fn results_keep_text_images_and_errors() {
        let mut result = CallToolResult::success(vec![
            ContentBlock::text("one"),
            ContentBlock::image("aGk=", "image/png"),
            ContentBlock::text("two"),
        ]);
        let r = reply(&result);
        assert_eq!(r.text, "one\ntwo");
        assert_eq!(r.images, ["data:image/png;base64,aGk="]);
        assert!(!r.is_error);
        result.is_error = Some(true);
        assert!(reply(&result).is_error);
        let bad = CallToolResult::success(vec![ContentBlock::image("<script>", "text/html")]);
        let r = reply(&bad);
        assert!(r.images.is_empty() && r.text.contains("not valid"), "{r:?}");
        let huge = CallToolResult::success(vec![
            ContentBlock::image("A".repeat(MAX_IMAGE_BYTES - 100), "image/png"),
            ContentBlock::image("A".repeat(1000), "image/png"),
        ]);
        let r = reply(&huge);
        assert_eq!(r.images.len(), 1);
        assert!(r.text.contains("left out"));
        let long = CallToolResult::success(vec![ContentBlock::text("ü".repeat(MAX_TEXT_BYTES))]);
        assert!(reply(&long).text.len() < MAX_TEXT_BYTES + 100);
        let structured = CallToolResult::structured(json!({"a": 1}));
        assert!(reply(&structured).text.contains("\"a\""));
    }

    #[test]
    fn only_objects_are_arguments() {
        assert!(arguments(json!({"a": 1})).is_ok());
        assert!(arguments(Value::Null).unwrap().is_empty());
        assert!(arguments(json!([1])).unwrap_err().contains("array"));
        assert!(arguments(json!("x")).is_err());
    }
}
