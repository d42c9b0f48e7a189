//! The image resolver (docs/loop-worker.md, "Images"): when a step's view holds images and the turn's main
//! model has no vision, each image becomes a text description from the gateway's vision chain.
//!
//! # Invariants
//! - Only the view changes: the window (and so every checkpoint) keeps the image itself.
//! - The main model's vision is asked once per turn, and only when a view first holds an image;
//!   when the gateway cannot tell, images pass through (it routes image requests to a vision
//!   step by itself).
//! - Each image URL is described once per turn; a failed or empty description becomes
//!   [`IMAGE_UNREADABLE`], never an error of the turn.

use crate::ports::TurnPorts;
use cyrene_protocol::message::{Message, Part, Role};
use cyrene_protocol::model::ModelRequest;
use std::collections::HashMap;

/// The prompt that asks the vision chain to describe one image (docs/semantics.md#our-wording).
pub const IMAGE_PROMPT: &str = "请用一两句话客观描述这张图片的内容，不要推测图片之外的事。";
/// What replaces an image for a main model without vision: this prefix and the description.
pub const IMAGE_DESCRIPTION_PREFIX: &str = "[图片描述] ";
/// What replaces an image that could not be described.
pub const IMAGE_UNREADABLE: &str = "[图片] （未能识别这张图片）";

/// What one turn knows about images: its main model's vision and the descriptions made so far.
#[derive(Debug, Default)]
pub struct ImageResolver {
    /// Whether the main model takes images (asked once per turn, when a view first has one).
    main_vision: Option<bool>,
    /// Image URL → its description, so each image is described once per turn.
    descriptions: HashMap<String, String>,
}

impl ImageResolver {
    /// `request` with its images replaced by descriptions when the main model of `persona` has
    /// no vision; unchanged otherwise.
    pub async fn resolve<P: TurnPorts>(
        &mut self,
        ports: &P,
        persona: &str,
        mut request: ModelRequest,
    ) -> ModelRequest {
        if !request.messages.iter().any(Message::has_image) {
            return request;
        }
        if self.main_vision.is_none() {
            let vision = match ports.main_model_vision(persona).await {
                Ok(vision) => vision,
                Err(err) => {
                    // The gateway routes image requests to a vision step by itself: let it.
                    tracing::warn!(error = %err, "cannot tell whether the main model sees images");
                    true
                }
            };
            self.main_vision = Some(vision);
        }
        if self.main_vision == Some(true) {
            return request;
        }
        for message in &mut request.messages {
            for part in &mut message.content {
                let Part::ImageUrl { image_url } = part else {
                    continue;
                };
                let text = match self.descriptions.get(image_url.as_str()) {
                    Some(text) => text.clone(),
                    None => {
                        let text = describe(ports, image_url).await;
                        self.descriptions.insert(image_url.clone(), text.clone());
                        text
                    }
                };
                *part = Part::Text { text };
            }
        }
        request
    }
}

/// One image described by the gateway's vision chain.
async fn describe<P: TurnPorts>(ports: &P, image_url: &str) -> String {
    let request = ModelRequest {
        messages: vec![Message::image(Role::User, IMAGE_PROMPT, image_url)],
        purpose: "vision".to_owned(),
        ..Default::default()
    };
    match ports.complete(request).await {
        Ok(reply) if !reply.content.trim().is_empty() => {
            format!("{IMAGE_DESCRIPTION_PREFIX}{}", reply.content.trim())
        }
        Ok(_) => IMAGE_UNREADABLE.to_owned(),
        Err(err) => {
            tracing::warn!(error = %err, "image description failed");
            IMAGE_UNREADABLE.to_owned()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ports::{ToolContext, ToolOutput, TurnInput};
    use crate::runner::tests::reply_text;
    use cyrene_protocol::checkpoint::Checkpoint;
    use cyrene_protocol::message::ToolCall;
    use cyrene_protocol::model::{ModelResponse, ToolSpec};
    use cyrene_protocol::session::SessionEvent;
    use cyrene_protocol::turn::{SteerRequest, SteerResponse};
    use cyrene_protocol::{ErrorBody, ErrorCode};
    use std::sync::Mutex;

    /// Only vision and model calls: what the resolver asks.
    #[derive(Default)]
    struct Gateway {
        vision: Option<bool>,
        /// Replies of the vision chain, in order; `None` = an error.
        replies: Mutex<Vec<Option<&'static str>>>,
        vision_asks: Mutex<usize>,
        described: Mutex<Vec<String>>,
    }

    impl TurnPorts for Gateway {
        async fn turn_checkpoint(
            &self,
            _: &str,
            _: &str,
            _: u32,
        ) -> Result<Option<Checkpoint>, ErrorBody> {
            Ok(None)
        }
        async fn save_checkpoint(&self, _: Checkpoint) -> Result<(), ErrorBody> {
            Ok(())
        }
        async fn turn_input(&self, _: &str) -> TurnInput {
            TurnInput::none()
        }
        async fn steer(&self, _: SteerRequest) -> Result<SteerResponse, ErrorBody> {
            Ok(SteerResponse::default())
        }
        async fn main_model_vision(&self, _persona: &str) -> Result<bool, ErrorBody> {
            *self.vision_asks.lock().unwrap() += 1;
            self.vision
                .ok_or_else(|| ErrorBody::new(ErrorCode::Unavailable, "no gateway"))
        }
        async fn complete(&self, request: ModelRequest) -> Result<ModelResponse, ErrorBody> {
            assert_eq!(request.purpose, "vision");
            let url = request.messages[0].content.iter().find_map(|p| match p {
                Part::ImageUrl { image_url } => Some(image_url.clone()),
                _ => None,
            });
            self.described.lock().unwrap().push(url.unwrap_or_default());
            match self.replies.lock().unwrap().remove(0) {
                Some(text) => reply_text(text),
                None => Err(ErrorBody::new(ErrorCode::Upstream, "vision chain down")),
            }
        }
        fn tool_specs(&self, _: Option<&[String]>) -> Vec<ToolSpec> {
            Vec::new()
        }
        async fn call_tool(&self, _: &ToolContext, _: &ToolCall) -> ToolOutput {
            ToolOutput::error("no tools here")
        }
        async fn publish(&self, _: SessionEvent) {}
    }

    fn request(urls: &[&str]) -> ModelRequest {
        ModelRequest {
            messages: urls
                .iter()
                .map(|url| Message::image(Role::User, "look", *url))
                .collect(),
            ..Default::default()
        }
    }

    fn texts(request: &ModelRequest) -> Vec<String> {
        request
            .messages
            .iter()
            .flat_map(|m| &m.content)
            .filter_map(|p| match p {
                Part::Text { text } if text != "look" => Some(text.clone()),
                _ => None,
            })
            .collect()
    }

    #[tokio::test]
    async fn a_view_without_images_asks_nothing() {
        let gateway = Gateway::default();
        let plain = ModelRequest {
            messages: vec![Message::text(Role::User, "hi")],
            ..Default::default()
        };
        let out = ImageResolver::default()
            .resolve(&gateway, "cyrene", plain.clone())
            .await;
        assert_eq!(out, plain);
        assert_eq!(*gateway.vision_asks.lock().unwrap(), 0);
    }

    #[tokio::test]
    async fn each_image_is_described_once_per_turn_and_failures_become_unreadable() {
        let gateway = Gateway {
            vision: Some(false),
            replies: Mutex::new(vec![Some(" a kite "), None, Some("  ")]),
            ..Default::default()
        };
        let mut images = ImageResolver::default();
        let first = images
            .resolve(&gateway, "cyrene", request(&["k.png", "x.png", "k.png"]))
            .await;
        assert_eq!(
            texts(&first),
            [
                format!("{IMAGE_DESCRIPTION_PREFIX}a kite"),
                IMAGE_UNREADABLE.to_owned(),
                format!("{IMAGE_DESCRIPTION_PREFIX}a kite"),
            ]
        );
        assert!(!first.messages.iter().any(Message::has_image));
        // The next step's view: known images are not described again, a new one is (and an
        // empty description is unreadable too); vision is not asked again.
        let second = images
            .resolve(&gateway, "cyrene", request(&["x.png", "new.png"]))
            .await;
        assert_eq!(
            texts(&second),
            [IMAGE_UNREADABLE.to_owned(), IMAGE_UNREADABLE.to_owned()]
        );
        assert_eq!(
            *gateway.described.lock().unwrap(),
            ["k.png", "x.png", "new.png"]
        );
        assert_eq!(*gateway.vision_asks.lock().unwrap(), 1);
    }

    #[tokio::test]
    async fn images_pass_through_when_the_model_sees_or_nobody_can_tell() {
        for vision in [Some(true), None] {
            let gateway = Gateway {
                vision,
                ..Default::default()
            };
            let mut images = ImageResolver::default();
            for _ in 0..2 {
                let out = images
                    .resolve(&gateway, "cyrene", request(&["k.png"]))
                    .await;
                assert_eq!(out, request(&["k.png"]));
            }
            assert_eq!(*gateway.vision_asks.lock().unwrap(), 1, "{vision:?}");
            assert!(gateway.described.lock().unwrap().is_empty());
        }
    }
}
