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

/// The prompt that asks the vision chain to describe one image (the seeds define no wording).
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
