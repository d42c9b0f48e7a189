//! The offline demo `cyrene up` runs when no model config or personas are given: the scripted
//! model's demo script, the two demo personas and the demo tools the script calls.
//!
//! # Invariants
//! - One source each: the demo models are the gateway's offline config
//!   ([`ModelsConfig::offline_with`]) around `demo-script.json`, whose unmatched input gets the
//!   scripted provider's own default reply; the demo personas are the orchestrator's built-in
//!   persona plus 星 (`hoshi`), whom the script's `星` rule asks.
//! - Every tool the script calls exists while the demo runs: `current_time` and `ask_agent` are
//!   the worker's built-ins, `search_notes` and `send_postcard` are served by [`tools`].

use cyrene_bus::host::{Endpoint, Host, HostError, ServiceSpec};
use cyrene_bus::service::RequestContext;
use cyrene_model_gateway::config::{ModelCaps, ModelsConfig, Script};
use cyrene_orchestrator::{Persona, Personas};
use cyrene_protocol::ErrorBody;
use serde_json::{Value, json};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The demo script of the offline model: rules and the pause between streamed words.
const DEMO_SCRIPT: &str = include_str!("demo-script.json");

/// The micro service name of the demo tools.
pub const TOOLS_SERVICE: &str = "cyrene-demo-tools";

/// The offline demo's model config: the scripted provider following the demo script.
pub fn models() -> Result<ModelsConfig, serde_json::Error> {
    let script: Script = serde_json::from_str(DEMO_SCRIPT)?;
    Ok(ModelsConfig::offline_with(script, ModelCaps::default()))
}

/// The demo personas: the built-in 昔涟 (`cyrene`, the default) and 星 (`hoshi`), so asks
/// between agents can be shown.
pub fn personas() -> Personas {
    let mut personas = Personas::builtin();
    personas.personas.push(Persona {
        id: "hoshi".to_owned(),
        name: "星".to_owned(),
        instructions: "You are 星 (Hoshi), cheerful and curious. Answer briefly.".to_owned(),
        ..Persona::default()
    });
    personas
}

/// Serves the demo tools until `shutdown`: `search_notes` on `cyrene.tool.search_notes`, which
/// takes 1.5 s (so a message typed meanwhile is visibly steered into the running turn), and
/// `send_postcard`, whose every call waits for the person's approval
/// (`cyrene.tool.approval` = `required`).
pub async fn tools(
    client: async_nats::Client,
    shutdown: CancellationToken,
) -> Result<(), HostError> {
    let spec = ServiceSpec::new(
        TOOLS_SERVICE,
        env!("CARGO_PKG_VERSION"),
        "Cyrene demo tools (offline mode)",
    );
    let search_notes = |args: Value, _ctx: RequestContext| async move {
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let query = text_arg(&args, "query");
        Ok::<_, ErrorBody>(
            json!({"text": format!("3 notes mention {query:?}: the picnic, the tea shop, the lighthouse"), "is_error": false}),
        )
    };
    let send_postcard = |args: Value, _ctx: RequestContext| async move {
        let to = text_arg(&args, "to");
        Ok::<_, ErrorBody>(
            json!({"text": format!("a postcard is on its way to {to}"), "is_error": false}),
        )
    };
    let endpoints = vec![
        Endpoint::json("send_postcard", "cyrene.tool.send_postcard", send_postcard).metadata(&[
            (
                "cyrene.tool.description",
                "Send a postcard (demo; every call waits for the person's approval).",
            ),
            (
                "cyrene.tool.parameters",
                r#"{"type":"object","properties":{"to":{"type":"string"},"text":{"type":"string"}},"required":["to","text"]}"#,
            ),
            ("cyrene.tool.approval", "required"),
        ]),
        Endpoint::json("search_notes", "cyrene.tool.search_notes", search_notes).metadata(&[
            (
                "cyrene.tool.description",
                "Search the user's notes (demo; takes 1.5 s).",
            ),
            (
                "cyrene.tool.parameters",
                r#"{"type":"object","properties":{"query":{"type":"string"}},"required":["query"]}"#,
            ),
        ]),
    ];
    Host::start(&client, spec, endpoints, shutdown)
        .await?
        .run()
        .await;
    Ok(())
}

/// The text argument `key` of a demo tool's call, empty when absent or not a string.
fn text_arg(args: &Value, key: &str) -> String {
    args.get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_demo_models_and_personas_are_valid() {
        models().unwrap().validate(&|_| false).unwrap();
        let personas = personas();
        personas.validate().unwrap();
        assert_eq!(
            personas.names().into_keys().collect::<Vec<_>>(),
            ["cyrene", "hoshi"]
        );
    }
}
