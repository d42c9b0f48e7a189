//! The model config (`CYRENE_GATEWAY_MODELS`, docs/architecture.md §9): providers and their
//! models' capabilities, groups with a default chain, the active group, persona chains and the
//! vision chain — plus the secrets (API keys) resolved from the environment by `main`.
//!
//! # Invariants
//! - Unknown fields are refused everywhere ([`serde(deny_unknown_fields)`]).
//! - [`ModelsConfig::validate`] reports *every* problem at once, one per line, so a broken config
//!   is fixed in one edit rather than one restart per mistake.
//! - API keys never live in the config file: only the *name* of an env var does. The values are
//!   held in [`Secrets`], whose `Debug` prints the names only.

use serde::{Deserialize, Serialize};
use serde_with::skip_serializing_none;
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::time::Duration;

/// Request timeout used when neither the request nor the config gives one.
pub const DEFAULT_TIMEOUT_MS: u64 = 60_000;
/// Consecutive failures after which a provider cools down, unless configured.
pub const DEFAULT_COOLDOWN_FAILURES: u32 = 3;
/// How long a provider cools down, unless configured or told by `Retry-After`.
pub const DEFAULT_COOLDOWN_MS: u64 = 30_000;

/// The whole model config file.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelsConfig {
    /// Providers by name (the name is what chains, call records and responses refer to).
    pub providers: BTreeMap<String, ProviderConfig>,
    /// Named chains; the active one is the default chain.
    #[serde(default)]
    pub groups: BTreeMap<String, Vec<Step>>,
    /// The group whose chain serves requests without a persona chain.
    pub active_group: String,
    /// Per-persona chains (`persona_id` → chain).
    #[serde(default)]
    pub persona_providers: BTreeMap<String, Vec<Step>>,
    /// Serves image-bearing requests when the routed chain has no vision-capable step.
    #[serde(default)]
    pub vision: Vec<Step>,
    /// Whole-request deadline when the request gives no `total_timeout_ms`.
    pub default_timeout_ms: Option<u64>,
}

/// One step of a chain: a model at a provider.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    pub provider: String,
    pub model: String,
}

impl Step {
    pub fn new(provider: impl Into<String>, model: impl Into<String>) -> Step {
        Step {
            provider: provider.into(),
            model: model.into(),
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.provider, self.model)
    }
}

/// The wire dialect a provider speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// OpenAI-compatible `/chat/completions`.
    Openai,
    /// Anthropic `/v1/messages`.
    Anthropic,
    /// The offline, deterministic provider.
    Scripted,
}

/// Which OpenAI-compatible service this is: decides the thinking switch and the default
/// `reasoning_effort` whitelist. Inferred from `base_url` when not given.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Vendor {
    Openai,
    Deepseek,
    Dashscope,
    /// vLLM, Ollama, local proxies: no vendor-specific knobs.
    Generic,
}

/// One provider.
#[skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    pub protocol: Protocol,
    /// Used as given; `/chat/completions` (openai) or `/v1/messages` (anthropic) is appended.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub base_url: String,
    /// The env var holding the API key; empty = no key (local vLLM/Ollama).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub api_key_env: String,
    /// Models served here, with their capabilities.
    pub models: BTreeMap<String, ModelCaps>,
    /// OpenAI-compatible vendor; inferred from `base_url` when absent.
    pub vendor: Option<Vendor>,
    /// Per-attempt timeout at this provider when the request gives no `timeout_ms` (always
    /// bounded by the request deadline).
    pub timeout_ms: Option<u64>,
    #[serde(default)]
    pub cooldown: CooldownConfig,
    /// Overrides the recognised `reasoning_effort` values (after alias normalisation).
    pub reasoning_efforts: Option<Vec<String>>,
    /// The script of a `scripted` provider.
    pub script: Option<Script>,
}

impl ProviderConfig {
    /// The vendor: as configured, else inferred from the base URL's host.
    pub fn vendor(&self) -> Vendor {
        if let Some(v) = self.vendor {
            return v;
        }
        let url = self.base_url.to_ascii_lowercase();
        if url.contains("deepseek.com") {
            Vendor::Deepseek
        } else if url.contains("api.openai.com") {
            Vendor::Openai
        } else if url.contains("dashscope") {
            Vendor::Dashscope
        } else {
            Vendor::Generic
        }
    }

    /// The per-attempt timeout, if configured.
    pub fn timeout(&self) -> Option<Duration> {
        self.timeout_ms.map(Duration::from_millis)
    }
}

/// Per-model capabilities.
#[skip_serializing_none]
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelCaps {
    /// Accepts image parts.
    #[serde(default)]
    pub vision: bool,
    /// How an Anthropic model takes `thinking` (default `budget`).
    pub thinking: Option<ThinkingStyle>,
}

/// Anthropic thinking styles: `budget_tokens`, or `{"type":"adaptive"}` on the newest models.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ThinkingStyle {
    #[default]
    Budget,
    Adaptive,
}

/// When a provider is skipped for a while.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CooldownConfig {
    /// Consecutive retryable failures that start a cooldown (0 = never cool down).
    #[serde(default = "default_failures")]
    pub failures: u32,
    /// Cooldown length when the provider sent no `Retry-After`.
    #[serde(default = "default_cooldown_ms")]
    pub cooldown_ms: u64,
}

impl Default for CooldownConfig {
    fn default() -> Self {
        CooldownConfig {
            failures: DEFAULT_COOLDOWN_FAILURES,
            cooldown_ms: DEFAULT_COOLDOWN_MS,
        }
    }
}

fn default_failures() -> u32 {
    DEFAULT_COOLDOWN_FAILURES
}

fn default_cooldown_ms() -> u64 {
    DEFAULT_COOLDOWN_MS
}

/// What the scripted provider answers when its script gives no reply (no rule matched and no
/// `default_reply`); `{input}` is the last user text.
pub const FALLBACK_REPLY: &str = "(offline scripted reply) You said: {input}";

/// The script of the offline provider: rules tried in order against the last user text.
#[skip_serializing_none]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Script {
    #[serde(default)]
    pub rules: Vec<Rule>,
    /// Reply when no rule matches; `{input}` is replaced by the last user text.
    pub default_reply: Option<String>,
    /// Pause between the streamed words of an answer, in milliseconds (0, the default: all at
    /// once). The offline demo sets it so an answer arrives word by word, as from a real model;
    /// the gateway merges deltas that are already waiting, so without it a streamed answer is
    /// one delta.
    #[serde(default)]
    pub word_delay_ms: u64,
}

/// One scripted rule. Exactly one of `contains`/`equals` selects it (plain text, no regex).
#[skip_serializing_none]
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub contains: Option<String>,
    pub equals: Option<String>,
    /// Text reply (`{input}` = the last user text).
    pub reply: Option<String>,
    /// Tool calls to ask for while the conversation has no tool result after the user text.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ScriptedCall>,
    /// Further rounds of tool calls, asked for one per step after the first round's results
    /// arrived (so a script can drive a multi-step turn); `after_tools` follows the last round.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub more_rounds: Vec<Vec<ScriptedCall>>,
    /// Final text once tool results arrived (`{tool_results}` = their texts, `{input}` too).
    pub after_tools: Option<String>,
    /// The call fails instead, with this message (not retryable): how the offline demo shows a
    /// failed turn (docs/model-gateway.md).
    pub fail: Option<String>,
}

/// A tool call the scripted provider asks for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScriptedCall {
    pub name: String,
    #[serde(default)]
    pub args: serde_json::Map<String, serde_json::Value>,
}

/// Why a config cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read the model config {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid model config {origin}: {source}")]
    Parse {
        origin: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("invalid model config {origin}: {source}")]
    ParseToml {
        origin: String,
        #[source]
        source: toml::de::Error,
    },
    /// Every problem found, one per line.
    #[error("invalid model config:\n  - {}", .0.join("\n  - "))]
    Invalid(Vec<String>),
}

impl ModelsConfig {
    /// Parses a JSON config.
    pub fn from_json(text: &str, origin: &str) -> Result<ModelsConfig, ConfigError> {
        serde_json::from_str(text).map_err(|source| ConfigError::Parse {
            origin: origin.to_owned(),
            source,
        })
    }

    /// Parses a TOML config: the same document as the JSON one, in TOML.
    pub fn from_toml(text: &str, origin: &str) -> Result<ModelsConfig, ConfigError> {
        toml::from_str(text).map_err(|source| ConfigError::ParseToml {
            origin: origin.to_owned(),
            source,
        })
    }

    /// Reads and parses a config file: TOML when its name ends in `.toml`, JSON otherwise.
    pub fn from_file(path: &Path) -> Result<ModelsConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let origin = path.display().to_string();
        if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("toml"))
        {
            ModelsConfig::from_toml(&text, &origin)
        } else {
            ModelsConfig::from_json(&text, &origin)
        }
    }

    /// The built-in offline config: one scripted provider, echoing what it is told
    /// ([`FALLBACK_REPLY`]).
    pub fn offline() -> ModelsConfig {
        ModelsConfig::offline_with(
            Script {
                default_reply: Some(FALLBACK_REPLY.to_owned()),
                ..Script::default()
            },
            ModelCaps::default(),
        )
    }

    /// The offline config with `script`: one scripted provider `offline` with one model
    /// `scripted` (`caps`), the only step of the active group `default`. The one shape of every
    /// offline config (the built-in one, `cyrene up`'s demo, the tests' scripted models).
    pub fn offline_with(script: Script, caps: ModelCaps) -> ModelsConfig {
        let provider = ProviderConfig {
            protocol: Protocol::Scripted,
            base_url: String::new(),
            api_key_env: String::new(),
            models: BTreeMap::from([("scripted".to_owned(), caps)]),
            vendor: None,
            timeout_ms: None,
            cooldown: CooldownConfig::default(),
            reasoning_efforts: None,
            script: Some(script),
        };
        let chain = vec![Step::new("offline", "scripted")];
        ModelsConfig {
            providers: BTreeMap::from([("offline".to_owned(), provider)]),
            groups: BTreeMap::from([("default".to_owned(), chain)]),
            active_group: "default".to_owned(),
            persona_providers: BTreeMap::new(),
            vision: Vec::new(),
            default_timeout_ms: None,
        }
    }

    /// The whole-request deadline when a request gives none.
    pub fn default_timeout(&self) -> Duration {
        Duration::from_millis(self.default_timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS))
    }

    /// The active group's chain (empty when the config is invalid).
    pub fn default_chain(&self) -> &[Step] {
        self.groups
            .get(&self.active_group)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// The capabilities of `step`, if both provider and model exist.
    pub fn caps(&self, step: &Step) -> Option<&ModelCaps> {
        self.providers.get(&step.provider)?.models.get(&step.model)
    }

    /// Checks everything at once; `env` answers whether an env var is set (and non-empty).
    pub fn validate(&self, env: &dyn Fn(&str) -> bool) -> Result<(), ConfigError> {
        let mut problems = Vec::new();
        if self.providers.is_empty() {
            problems.push("no providers are declared".to_owned());
        }
        for (name, p) in &self.providers {
            self.validate_provider(name, p, env, &mut problems);
        }
        match self.groups.get(&self.active_group) {
            None => problems.push(format!(
                "active_group {:?} is not one of the groups ({})",
                self.active_group,
                list(self.groups.keys())
            )),
            Some(chain) if chain.is_empty() => problems.push(format!(
                "the active group {:?} has an empty chain",
                self.active_group
            )),
            Some(_) => {}
        }
        for (group, chain) in &self.groups {
            self.validate_chain(&format!("groups.{group}"), chain, &mut problems);
        }
        for (persona, chain) in &self.persona_providers {
            if chain.is_empty() {
                problems.push(format!("persona_providers.{persona} is an empty chain"));
            }
            self.validate_chain(
                &format!("persona_providers.{persona}"),
                chain,
                &mut problems,
            );
        }
        self.validate_chain("vision", &self.vision, &mut problems);
        for (i, step) in self.vision.iter().enumerate() {
            if self.caps(step).is_some_and(|c| !c.vision) {
                problems.push(format!(
                    "vision[{i}]: {step} is not declared vision-capable (\"vision\": true)"
                ));
            }
        }
        if self.default_timeout_ms == Some(0) {
            problems.push("default_timeout_ms must be positive".to_owned());
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(problems))
        }
    }

    fn validate_provider(
        &self,
        name: &str,
        p: &ProviderConfig,
        env: &dyn Fn(&str) -> bool,
        problems: &mut Vec<String>,
    ) {
        let at = format!("providers.{name}");
        if p.models.is_empty() {
            problems.push(format!("{at}: declares no models"));
        }
        match p.protocol {
            Protocol::Openai | Protocol::Anthropic => {
                if p.base_url.is_empty() {
                    problems.push(format!("{at}: base_url is required"));
                } else if !(p.base_url.starts_with("http://") || p.base_url.starts_with("https://"))
                {
                    problems.push(format!(
                        "{at}: base_url {:?} must start with http:// or https://",
                        p.base_url
                    ));
                }
                if p.script.is_some() {
                    problems.push(format!("{at}: a script is only for protocol \"scripted\""));
                }
            }
            Protocol::Scripted => {
                if !p.base_url.is_empty() || !p.api_key_env.is_empty() {
                    problems.push(format!(
                        "{at}: a scripted provider takes no base_url or api_key_env"
                    ));
                }
                if let Some(script) = &p.script {
                    for (i, rule) in script.rules.iter().enumerate() {
                        if rule.contains.is_some() == rule.equals.is_some() {
                            problems.push(format!(
                                "{at}.script.rules[{i}]: give exactly one of contains/equals"
                            ));
                        }
                        if rule.reply.is_none() && rule.tool_calls.is_empty() && rule.fail.is_none()
                        {
                            problems.push(format!(
                                "{at}.script.rules[{i}]: give a reply, tool_calls or fail"
                            ));
                        }
                    }
                }
            }
        }
        if p.protocol != Protocol::Anthropic && p.models.values().any(|m| m.thinking.is_some()) {
            problems.push(format!(
                "{at}: a thinking style is only meaningful for protocol \"anthropic\""
            ));
        }
        if !p.api_key_env.is_empty() && !env(&p.api_key_env) {
            problems.push(format!(
                "{at}: the API key env var {} is not set",
                p.api_key_env
            ));
        }
        if p.timeout_ms == Some(0) {
            problems.push(format!("{at}: timeout_ms must be positive"));
        }
    }

    fn validate_chain(&self, at: &str, chain: &[Step], problems: &mut Vec<String>) {
        for (i, step) in chain.iter().enumerate() {
            match self.providers.get(&step.provider) {
                None => problems.push(format!(
                    "{at}[{i}]: unknown provider {:?} (declared: {})",
                    step.provider,
                    list(self.providers.keys())
                )),
                Some(p) if !p.models.contains_key(&step.model) => problems.push(format!(
                    "{at}[{i}]: provider {:?} declares no model {:?} (declared: {})",
                    step.provider,
                    step.model,
                    list(p.models.keys())
                )),
                Some(_) => {}
            }
        }
    }
}

fn list<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let names: Vec<&str> = names.map(String::as_str).collect();
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

/// API keys by env var name, resolved once at start by `main`. `Debug` shows names only.
#[derive(Clone, Default)]
pub struct Secrets(BTreeMap<String, String>);

impl Secrets {
    /// Resolves every `api_key_env` of `config` through `lookup` (main passes `std::env::var`).
    /// Unset and empty variables are left out; [`ModelsConfig::validate`] reports them.
    pub fn resolve(config: &ModelsConfig, lookup: impl Fn(&str) -> Option<String>) -> Secrets {
        let mut keys = BTreeMap::new();
        for p in config.providers.values() {
            if p.api_key_env.is_empty() {
                continue;
            }
            if let Some(value) = lookup(&p.api_key_env).filter(|v| !v.is_empty()) {
                keys.insert(p.api_key_env.clone(), value);
            }
        }
        Secrets(keys)
    }

    /// Secrets from explicit pairs (tests).
    pub fn from_pairs<I, K, V>(pairs: I) -> Secrets
    where
        I: IntoIterator<Item = (K, V)>,
        K: Into<String>,
        V: Into<String>,
    {
        Secrets(
            pairs
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
        )
    }

    pub fn get(&self, env_name: &str) -> Option<&str> {
        self.0.get(env_name).map(String::as_str)
    }

    pub fn has(&self, env_name: &str) -> bool {
        self.0.contains_key(env_name)
    }
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set()
            .entries(self.0.keys().map(|k| format!("{k}=<redacted>")))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOCUMENTED_EXAMPLE: &str = r#"{"providers":{
   "primary":{"protocol":"openai","base_url":"https://api.deepseek.com","api_key_env":"DEEPSEEK_API_KEY",
              "models":{"deepseek-chat":{"vision":false}}},
   "claude":{"protocol":"anthropic","base_url":"https://api.anthropic.com","api_key_env":"ANTHROPIC_API_KEY",
             "models":{"claude-sonnet-4-5":{"vision":true}}},
   "offline":{"protocol":"scripted","models":{"scripted":{"vision":false}}}},
 "groups":{"default":[{"provider":"primary","model":"deepseek-chat"},{"provider":"claude","model":"claude-sonnet-4-5"}]},
 "active_group":"default",
 "persona_providers":{"hoshi":[{"provider":"claude","model":"claude-sonnet-4-5"}]},
 "vision":[{"provider":"claude","model":"claude-sonnet-4-5"}]}"#;

    #[test]
    fn the_design_example_parses_and_validates() {
        let config = ModelsConfig::from_json(DOCUMENTED_EXAMPLE, "example").unwrap();
        assert_eq!(config.providers["primary"].vendor(), Vendor::Deepseek);
        assert_eq!(config.default_chain().len(), 2);
        config.validate(&|_| true).unwrap();
    }

    /// The example of docs/model-gateway.md …
    const DOCS_EXAMPLE: &str = r#"{"providers":{
   "primary":{"protocol":"openai","base_url":"https://api.deepseek.com","api_key_env":"DEEPSEEK_API_KEY",
              "models":{"deepseek-chat":{"vision":false}},
              "timeout_ms":20000,"cooldown":{"failures":3,"cooldown_ms":30000}},
   "claude":{"protocol":"anthropic","base_url":"https://api.anthropic.com","api_key_env":"ANTHROPIC_API_KEY",
             "models":{"claude-sonnet-4-5":{"vision":true},"claude-opus-4-6":{"vision":true,"thinking":"adaptive"}}},
   "local":{"protocol":"openai","base_url":"http://127.0.0.1:11434/v1","models":{"qwen3":{}}},
   "offline":{"protocol":"scripted","models":{"scripted":{}},
              "script":{"rules":[
                 {"contains":"time","tool_calls":[{"name":"get_time","args":{"tz":"UTC"}}],
                  "after_tools":"It is {tool_results}."},
                 {"equals":"hi","reply":"hello!"}],
               "default_reply":"(offline) you said: {input}"}}},
 "groups":{"default":[{"provider":"primary","model":"deepseek-chat"},{"provider":"claude","model":"claude-sonnet-4-5"}]},
 "active_group":"default",
 "persona_providers":{"hoshi":[{"provider":"claude","model":"claude-sonnet-4-5"}]},
 "vision":[{"provider":"claude","model":"claude-sonnet-4-5"}],
 "default_timeout_ms":60000}"#;

    /// … written as TOML.
    const TOML_EXAMPLE: &str = r#"active_group = "default"
default_timeout_ms = 60000

[providers.primary]
protocol = "openai"
base_url = "https://api.deepseek.com"
api_key_env = "DEEPSEEK_API_KEY"
timeout_ms = 20000
cooldown = { failures = 3, cooldown_ms = 30000 }
models = { "deepseek-chat" = { vision = false } }

[providers.claude]
protocol = "anthropic"
base_url = "https://api.anthropic.com"
api_key_env = "ANTHROPIC_API_KEY"

[providers.claude.models]
"claude-sonnet-4-5" = { vision = true }
"claude-opus-4-6" = { vision = true, thinking = "adaptive" }

[providers.local]
protocol = "openai"
base_url = "http://127.0.0.1:11434/v1"
models = { qwen3 = {} }

[providers.offline]
protocol = "scripted"
models = { scripted = {} }

[providers.offline.script]
default_reply = "(offline) you said: {input}"

[[providers.offline.script.rules]]
contains = "time"
tool_calls = [{ name = "get_time", args = { tz = "UTC" } }]
after_tools = "It is {tool_results}."

[[providers.offline.script.rules]]
equals = "hi"
reply = "hello!"

[groups]
default = [
  { provider = "primary", model = "deepseek-chat" },
  { provider = "claude", model = "claude-sonnet-4-5" },
]

[persona_providers]
hoshi = [{ provider = "claude", model = "claude-sonnet-4-5" }]

[[vision]]
provider = "claude"
model = "claude-sonnet-4-5"
"#;

    #[test]
    fn a_toml_config_is_the_same_document() {
        let from_toml = ModelsConfig::from_toml(TOML_EXAMPLE, "example.toml").unwrap();
        let from_json = ModelsConfig::from_json(DOCS_EXAMPLE, "example.json").unwrap();
        assert_eq!(from_toml, from_json);

        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("models.toml");
        std::fs::write(&path, TOML_EXAMPLE).unwrap();
        assert_eq!(ModelsConfig::from_file(&path).unwrap(), from_json);

        std::fs::write(&path, "active_group = 3").unwrap();
        let err = ModelsConfig::from_file(&path).unwrap_err().to_string();
        assert!(err.contains("models.toml"), "{err}");
    }

    #[test]
    fn unknown_fields_are_refused() {
        let text =
            DOCUMENTED_EXAMPLE.replace("\"active_group\"", "\"activ_group\":1,\"active_group\"");
        let err = ModelsConfig::from_json(&text, "x").unwrap_err();
        assert!(err.to_string().contains("activ_group"), "{err}");
        let text = DOCUMENTED_EXAMPLE.replace("\"vision\":true", "\"vision\":true,\"colour\":1");
        assert!(ModelsConfig::from_json(&text, "x").is_err());
    }

    #[test]
    fn validation_names_every_problem_at_once() {
        let text = DOCUMENTED_EXAMPLE
            .replace(
                r#""hoshi":[{"provider":"claude","model":"claude-sonnet-4-5"}]"#,
                r#""hoshi":[{"provider":"claude","model":"claude-opus"}]"#,
            )
            .replace(
                r#"{"provider":"claude","model":"claude-sonnet-4-5"}]},"#,
                r#"{"provider":"claud","model":"claude-sonnet-4-5"}]},"#,
            );
        let config = ModelsConfig::from_json(&text, "x").unwrap();
        let err = config
            .validate(&|name| name == "DEEPSEEK_API_KEY")
            .unwrap_err();
        let ConfigError::Invalid(problems) = &err else {
            panic!("{err}")
        };
        assert_eq!(problems.len(), 3, "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains("groups.default[1]: unknown provider \"claud\""),
            "{msg}"
        );
        assert!(msg.contains("persona_providers.hoshi[0]"), "{msg}");
        assert!(msg.contains("claude-opus"), "{msg}");
        assert!(msg.contains("ANTHROPIC_API_KEY is not set"), "{msg}");
    }

    #[test]
    fn a_missing_active_group_and_bad_rules_are_reported() {
        let mut config = ModelsConfig::offline();
        config.active_group = "nope".into();
        config
            .providers
            .get_mut("offline")
            .unwrap()
            .script
            .as_mut()
            .unwrap()
            .rules
            .push(Rule::default());
        let msg = config.validate(&|_| true).unwrap_err().to_string();
        assert!(msg.contains("active_group \"nope\""), "{msg}");
        assert!(msg.contains("exactly one of contains/equals"), "{msg}");
        assert!(msg.contains("a reply, tool_calls or fail"), "{msg}");
    }

    #[test]
    fn the_offline_config_is_valid_without_any_env() {
        ModelsConfig::offline().validate(&|_| false).unwrap();
    }

    #[test]
    fn secrets_debug_never_shows_values() {
        let config = ModelsConfig::from_json(DOCUMENTED_EXAMPLE, "x").unwrap();
        let secrets = Secrets::resolve(&config, |name| {
            (name == "ANTHROPIC_API_KEY").then(|| "sk-ant-secret".to_owned())
        });
        assert!(secrets.has("ANTHROPIC_API_KEY"));
        assert!(!secrets.has("DEEPSEEK_API_KEY"));
        let shown = format!("{secrets:?}");
        assert!(shown.contains("ANTHROPIC_API_KEY"));
        assert!(!shown.contains("sk-ant-secret"));
    }
}
