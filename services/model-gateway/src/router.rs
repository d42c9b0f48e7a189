//! Routing and fallback: which chain serves a request, in which order its steps are tried, and
//! which providers are cooling down.
//!
//! Chain choice (docs/architecture.md §2, §9): an explicit `model` → every provider declaring that
//! model (in provider-name order); else the persona's chain (`persona_providers`), else the active
//! group's default chain. An image-bearing request keeps only the vision-capable steps of that
//! chain, followed by the `vision` chain.
//!
//! # Invariants
//! - Fallback happens only on retryable failures (transport, timeout, 429, 5xx, an unreadable
//!   2xx); any other 4xx is answered at once with code `upstream` and the provider's message.
//! - A provider cools down after `cooldown.failures` consecutive retryable failures (for
//!   `cooldown.cooldown_ms`), or at once for as long as its `Retry-After` says. A success resets
//!   the count. After a cooldown one failure is enough to cool down again (half-open probe).
//! - Cooling steps are skipped — unless *every* step of the chain is cooling, in which case all
//!   are tried in order anyway: a request is never refused without at least one attempt.
//! - The whole request, all attempts included, is bounded by its deadline (`total_timeout_ms`,
//!   else the config default). Each attempt — one HTTP call — is also bounded by the request's
//!   `timeout_ms` (docs/semantics.md#model-vocabulary), else by its provider's `timeout_ms`; a
//!   per-call timeout of 0 means that provider default.
//!
//! # Pitfalls
//! - Health is per gateway process: replicas learn about a failing provider independently.

use crate::config::{ModelsConfig, Step};
use crate::providers::{DeltaSink, Provider, ProviderError};
use cyrene_protocol::message::{Part, Role};
use cyrene_protocol::model::{ModelRequest, ModelResponse};
use cyrene_protocol::{ErrorBody, ErrorCode};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Per-provider failure accounting.
#[derive(Debug, Default)]
struct Health {
    consecutive_failures: u32,
    cooling_until: Option<Instant>,
}

/// A registered provider with its health.
#[derive(Debug)]
struct Entry {
    provider: Arc<dyn Provider>,
    timeout: Option<Duration>,
    failures_to_cool: u32,
    cooldown: Duration,
    health: Mutex<Health>,
}

/// Routes requests over the configured chains.
#[derive(Debug)]
pub struct Router {
    config: ModelsConfig,
    providers: BTreeMap<String, Entry>,
}

impl Router {
    /// A router over `config` (already validated) with one provider per config entry.
    pub fn new(config: ModelsConfig, providers: BTreeMap<String, Arc<dyn Provider>>) -> Router {
        let providers = providers
            .into_iter()
            .filter_map(|(name, provider)| {
                let p = config.providers.get(&name)?;
                let entry = Entry {
                    provider,
                    timeout: p.timeout(),
                    failures_to_cool: p.cooldown.failures,
                    cooldown: Duration::from_millis(p.cooldown.cooldown_ms),
                    health: Mutex::new(Health::default()),
                };
                Some((name, entry))
            })
            .collect();
        Router { config, providers }
    }

    pub fn config(&self) -> &ModelsConfig {
        &self.config
    }

    /// The chain that serves `req`, in order.
    pub fn route(&self, req: &ModelRequest) -> Result<Vec<Step>, ErrorBody> {
        let images = req.messages.iter().any(|m| m.has_image());
        if !req.model.is_empty() {
            let steps: Vec<Step> = self
                .config
                .providers
                .iter()
                .filter(|(_, p)| p.models.contains_key(&req.model))
                .map(|(name, _)| Step::new(name.clone(), req.model.clone()))
                .collect();
            if steps.is_empty() {
                return Err(bad_request(format!(
                    "unknown model {:?}: no provider declares it",
                    req.model
                )));
            }
            if images {
                let vision: Vec<Step> = steps.into_iter().filter(|s| self.vision(s)).collect();
                if vision.is_empty() {
                    return Err(bad_request(format!(
                        "model {:?} has no vision capability and the request holds images",
                        req.model
                    )));
                }
                return Ok(vision);
            }
            return Ok(steps);
        }
        let chain = match self.config.persona_providers.get(&req.persona_id) {
            Some(chain) if !req.persona_id.is_empty() => chain.as_slice(),
            _ => self.config.default_chain(),
        };
        if !images {
            return Ok(chain.to_vec());
        }
        let mut steps: Vec<Step> = chain.iter().filter(|s| self.vision(s)).cloned().collect();
        for step in &self.config.vision {
            if !steps.contains(step) {
                steps.push(step.clone());
            }
        }
        if steps.is_empty() {
            return Err(bad_request(
                "the request holds images but no vision-capable model is configured \
                 (declare \"vision\": true on a model and add it to the vision chain)",
            ));
        }
        Ok(steps)
    }

    fn vision(&self, step: &Step) -> bool {
        self.config.caps(step).is_some_and(|c| c.vision)
    }

    /// Serves `req`: routes it, tries the chain, and returns the first success.
    pub async fn complete(&self, req: &ModelRequest) -> Result<ModelResponse, ErrorBody> {
        self.attempts(req, None).await
    }

    /// [`Router::complete`], streaming each attempt's output into `sink`. Fallback and cooldown
    /// apply only while `sink` has seen no output: once a delta went out, a failure of that
    /// attempt is the answer (code `timeout` for its deadline, else `unavailable`), the next
    /// step is not tried (the caller has shown that provider's words already) and the failure
    /// does not count towards the provider's cooldown.
    pub async fn complete_stream(
        &self,
        req: &ModelRequest,
        sink: &DeltaSink,
    ) -> Result<ModelResponse, ErrorBody> {
        self.attempts(req, Some(sink)).await
    }

    async fn attempts(
        &self,
        req: &ModelRequest,
        sink: Option<&DeltaSink>,
    ) -> Result<ModelResponse, ErrorBody> {
        let chain = self.route(req)?;
        let timeout = req
            .total_timeout_ms
            .filter(|ms| *ms > 0)
            .map(Duration::from_millis)
            .unwrap_or_else(|| self.config.default_timeout());
        // One HTTP call; 0 = the provider's own timeout (docs/semantics.md#model-vocabulary).
        let per_call = req
            .timeout_ms
            .filter(|ms| *ms > 0)
            .map(Duration::from_millis);
        let deadline = Instant::now() + timeout;
        let now = Instant::now();
        let mut causes: Vec<String> = Vec::new();
        let ready: Vec<&Step> = chain.iter().filter(|s| !self.cooling(s, now)).collect();
        let order: Vec<&Step> = if ready.is_empty() {
            tracing::warn!("every step of the chain is cooling down; trying them anyway");
            chain.iter().collect()
        } else {
            for step in chain.iter().filter(|s| self.cooling(s, now)) {
                metrics::counter!(
                    "cyrene_provider_skipped_cooling_total",
                    "provider" => step.provider.clone(),
                    "model" => step.model.clone()
                )
                .increment(1);
                causes.push(format!("{step}: skipped, provider cooling down"));
            }
            ready
        };
        for step in order {
            let Some(entry) = self.providers.get(&step.provider) else {
                causes.push(format!("{step}: provider not running"));
                continue;
            };
            let started = Instant::now();
            if started >= deadline {
                causes.push(format!("{step}: not tried, request deadline passed"));
                continue;
            }
            let attempt_deadline = match per_call.or(entry.timeout) {
                Some(t) => deadline.min(started + t),
                None => deadline,
            };
            let outcome = match sink {
                Some(sink) => {
                    entry
                        .provider
                        .stream(req, step, attempt_deadline, sink)
                        .await
                }
                None => entry.provider.complete(req, step, attempt_deadline).await,
            };
            record_call(step, &outcome, started.elapsed());
            match outcome {
                Err(err) if sink.is_some_and(DeltaSink::started) => {
                    tracing::warn!(step = %step, error = %err, "stream broke after output started; not falling back");
                    let code = match err {
                        ProviderError::Timeout(_) => ErrorCode::Timeout,
                        _ => ErrorCode::Unavailable,
                    };
                    return Err(ErrorBody::new(
                        code,
                        format!(
                            "provider {} (model {}) failed after its output started \
                             (no fallback once output was streamed): {err}",
                            step.provider, step.model
                        ),
                    ));
                }
                Ok(mut response) => {
                    entry.succeeded();
                    response.provider = step.provider.clone();
                    if response.model.is_empty() {
                        response.model = step.model.clone();
                    }
                    return Ok(response);
                }
                Err(err) if err.is_retryable() => {
                    tracing::warn!(step = %step, error = %err, "attempt failed; trying the next step");
                    metrics::counter!(
                        "cyrene_provider_fallbacks_total",
                        "provider" => step.provider.clone(),
                        "model" => step.model.clone()
                    )
                    .increment(1);
                    entry.failed(&err, &step.provider);
                    causes.push(format!("{step}: {err}"));
                }
                Err(ProviderError::Invalid(msg)) => {
                    return Err(bad_request(format!("{step}: {msg}")));
                }
                Err(err) => {
                    entry.succeeded(); // the provider answered: it is up.
                    return Err(ErrorBody::new(
                        ErrorCode::Upstream,
                        format!(
                            "provider {} (model {}) refused the request: {err}",
                            step.provider, step.model
                        ),
                    ));
                }
            }
        }
        let (code, what) = if Instant::now() >= deadline {
            (
                ErrorCode::Timeout,
                format!("no provider answered within {} ms", timeout.as_millis()),
            )
        } else {
            (
                ErrorCode::Unavailable,
                "every step of the chain failed".to_owned(),
            )
        };
        Err(ErrorBody::new(
            code,
            format!("{what}: {}", causes.join("; ")),
        ))
    }

    fn cooling(&self, step: &Step, now: Instant) -> bool {
        self.providers.get(&step.provider).is_some_and(|e| {
            e.health
                .lock()
                .map(|h| h.cooling_until.is_some_and(|until| until > now))
                .unwrap_or(false)
        })
    }
}

impl Entry {
    fn succeeded(&self) {
        if let Ok(mut h) = self.health.lock() {
            h.consecutive_failures = 0;
            h.cooling_until = None;
        }
    }

    fn failed(&self, err: &ProviderError, name: &str) {
        let Ok(mut h) = self.health.lock() else {
            return;
        };
        h.consecutive_failures = h.consecutive_failures.saturating_add(1);
        let cool_for = match err.retry_after() {
            Some(after) => Some(after),
            None if self.failures_to_cool > 0
                && h.consecutive_failures >= self.failures_to_cool =>
            {
                Some(self.cooldown)
            }
            None => None,
        };
        if let Some(d) = cool_for.filter(|d| !d.is_zero()) {
            tracing::warn!(
                provider = name,
                failures = h.consecutive_failures,
                cooldown_ms = d.as_millis() as u64,
                "provider cooling down"
            );
            h.cooling_until = Some(Instant::now() + d);
            metrics::counter!("cyrene_provider_cooldowns_total", "provider" => name.to_owned())
                .increment(1);
        }
    }
}

/// One provider attempt in the metrics (docs/operations.md): its latency by outcome and, when
/// it answered, the tokens it counted.
fn record_call(step: &Step, outcome: &Result<ModelResponse, ProviderError>, took: Duration) {
    let (provider, model) = (step.provider.clone(), step.model.clone());
    let result = match outcome {
        Ok(_) => "ok",
        Err(err) if err.is_retryable() => "retryable_error",
        Err(_) => "error",
    };
    metrics::histogram!(
        "cyrene_provider_call_duration_seconds",
        "provider" => provider.clone(), "model" => model.clone(), "outcome" => result
    )
    .record(took.as_secs_f64());
    if let Ok(response) = outcome {
        for (kind, count) in [
            ("prompt", response.prompt_tokens),
            ("completion", response.completion_tokens),
            ("cache_hit", response.cache_hit_tokens),
            ("cache_miss", response.cache_miss_tokens),
            ("reasoning", response.reasoning_tokens),
        ] {
            metrics::counter!(
                "cyrene_provider_tokens_total",
                "provider" => provider.clone(), "model" => model.clone(), "kind" => kind
            )
            .increment(count);
        }
    }
}

fn bad_request(message: impl Into<String>) -> ErrorBody {
    ErrorBody::new(ErrorCode::BadRequest, message)
}

/// Checks what serde cannot: the request is something a provider could be asked.
pub fn check_request(req: &ModelRequest) -> Result<(), ErrorBody> {
    if req.messages.is_empty() {
        return Err(bad_request("messages must not be empty"));
    }
    if let Some(t) = req.temperature
        && !(0.0..=2.0).contains(&t)
    {
        return Err(bad_request(format!("temperature {t} is outside 0..=2")));
    }
    for (i, tool) in req.tools.iter().enumerate() {
        if tool.name.is_empty() {
            return Err(bad_request(format!("tools[{i}]: name must not be empty")));
        }
        if !tool.parameters.is_object() {
            return Err(bad_request(format!(
                "tools[{i}] ({}): parameters must be a JSON schema object",
                tool.name
            )));
        }
    }
    for (i, m) in req.messages.iter().enumerate() {
        for part in &m.content {
            let fits = match part {
                Part::Text { .. } => true,
                Part::ImageUrl { image_url } => {
                    if let Err(e) = crate::providers::parse_data_uri(image_url) {
                        return Err(bad_request(format!("messages[{i}]: {e}")));
                    }
                    if !(image_url.starts_with("data:")
                        || image_url.starts_with("http://")
                        || image_url.starts_with("https://"))
                    {
                        return Err(bad_request(format!(
                            "messages[{i}]: image_url must be a data: URI or an http(s) URL"
                        )));
                    }
                    // A person's image, or one a tool returned (docs/tools.md, "Results").
                    matches!(m.role, Role::User | Role::Tool)
                }
                Part::ToolCall { .. } | Part::Reasoning { .. } => m.role == Role::Assistant,
                Part::ToolResult { .. } => m.role == Role::Tool,
                Part::Document { .. } => {
                    return Err(bad_request(format!(
                        "messages[{i}]: document parts never reach a provider; \
                         replace them by their text before calling the model"
                    )));
                }
            };
            if !fits {
                return Err(bad_request(format!(
                    "messages[{i}]: a {} part cannot appear on a {} message",
                    part_kind(part),
                    role_name(m.role)
                )));
            }
        }
    }
    Ok(())
}

fn part_kind(part: &Part) -> &'static str {
    match part {
        Part::Text { .. } => "text",
        Part::ImageUrl { .. } => "image_url",
        Part::ToolCall { .. } => "tool_call",
        Part::ToolResult { .. } => "tool_result",
        Part::Document { .. } => "document",
        Part::Reasoning { .. } => "reasoning",
    }
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cyrene_protocol::message::Message;

    const CONFIG: &str = r#"{"providers":{
       "a":{"protocol":"scripted","models":{"text":{}}},
       "b":{"protocol":"scripted","models":{"eyes":{"vision":true},"text":{}}},
       "c":{"protocol":"scripted","models":{"big-eyes":{"vision":true}}}},
     "groups":{"default":[{"provider":"a","model":"text"},{"provider":"b","model":"eyes"}]},
     "active_group":"default",
     "persona_providers":{"hoshi":[{"provider":"b","model":"text"}]},
     "vision":[{"provider":"c","model":"big-eyes"}]}"#;

    fn router() -> Router {
        let config = ModelsConfig::from_json(CONFIG, "test").unwrap();
        config.validate(&|_| true).unwrap();
        Router::new(config, BTreeMap::new())
    }

    fn req(persona: &str, model: &str, image: bool) -> ModelRequest {
        let m = if image {
            Message::image(Role::User, "look", "https://x/y.png")
        } else {
            Message::text(Role::User, "hi")
        };
        ModelRequest {
            messages: vec![m],
            persona_id: persona.into(),
            model: model.into(),
            ..Default::default()
        }
    }

    /// A request's persona, model and whether it carries an image; the chain it goes along, as
    /// (provider, model) steps.
    type RouteCase<'a> = (&'a str, &'a str, bool, &'a [(&'a str, &'a str)]);

    /// [`router`] routes each case's request along the case's chain.
    fn assert_routes(cases: &[RouteCase<'_>]) {
        let r = router();
        for &(persona, model, image, chain) in cases {
            let want: Vec<Step> = chain.iter().map(|&(p, m)| Step::new(p, m)).collect();
            assert_eq!(
                r.route(&req(persona, model, image)).unwrap(),
                want,
                "persona {persona:?}, model {model:?}, image {image}"
            );
        }
    }

    #[test]
    fn chains_follow_model_persona_and_group() {
        assert_routes(&[
            ("", "", false, &[("a", "text"), ("b", "eyes")]),
            ("hoshi", "", false, &[("b", "text")]),
            ("", "text", false, &[("a", "text"), ("b", "text")]),
        ]);
        let r = router();
        assert_eq!(r.route(&req("nobody", "", false)).unwrap().len(), 2);
        let err = r.route(&req("", "gpt-9", false)).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
    }

    #[test]
    fn images_go_to_vision_steps_then_the_vision_chain() {
        assert_routes(&[
            ("", "", true, &[("b", "eyes"), ("c", "big-eyes")]),
            ("hoshi", "", true, &[("c", "big-eyes")]),
        ]);
        let err = router().route(&req("", "text", true)).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadRequest);
    }

    #[test]
    fn requests_that_no_provider_could_take_are_refused() {
        let refused = |request: &ModelRequest| check_request(request).unwrap_err();
        let ok = req("", "", false);
        assert!(check_request(&ok).is_ok());
        let mut empty = ok.clone();
        empty.messages.clear();
        assert!(refused(&empty).message.contains("empty"));
        let mut doc = ok.clone();
        doc.messages[0].content.push(Part::Document {
            name: "d".into(),
            mime: "application/pdf".into(),
            url: "cyrene-doc://d".into(),
            size: 1,
        });
        assert!(refused(&doc).message.contains("document"));
        let mut bad_uri = ok.clone();
        bad_uri.messages[0] = Message::image(Role::User, "", "data:image/png,xx");
        assert_eq!(refused(&bad_uri).code, ErrorCode::BadRequest);
        let mut result_on_user = ok.clone();
        result_on_user.messages[0].content.push(Part::ToolResult {
            tool_call_id: "c".into(),
            text: "x".into(),
            is_error: false,
        });
        assert!(
            refused(&result_on_user)
                .message
                .contains("tool_result part cannot appear on a user message")
        );
        // An image a tool returned rides on its message; on an assistant message it is refused.
        let mut tool_image = ok.clone();
        let mut result = Message::tool_result("c", "t", "x", false);
        result.content.push(Part::ImageUrl {
            image_url: "data:image/png;base64,AAAA".into(),
        });
        tool_image.messages.push(result);
        assert!(check_request(&tool_image).is_ok());
        let mut assistant_image = ok.clone();
        assistant_image.messages.push(Message::image(
            Role::Assistant,
            "",
            "data:image/png;base64,AAAA",
        ));
        assert!(
            refused(&assistant_image)
                .message
                .contains("image_url part cannot appear on a assistant message")
        );
        // A per-call timeout of 0 and a `max_tokens` of 0 are the provider's default
        // (docs/semantics.md#model-vocabulary), not an error.
        let mut default_timeout = ok;
        default_timeout.timeout_ms = Some(0);
        default_timeout.total_timeout_ms = Some(0);
        default_timeout.max_tokens = Some(0);
        assert!(check_request(&default_timeout).is_ok());
    }

    /// A provider that fails retryably (with `retry_after` when set) while `failing` is set,
    /// and counts its calls.
    #[derive(Debug, Default)]
    struct Flaky {
        failing: std::sync::atomic::AtomicBool,
        retry_after: Option<Duration>,
        calls: std::sync::atomic::AtomicUsize,
    }

    impl Provider for Flaky {
        fn complete<'a>(
            &'a self,
            _request: &'a ModelRequest,
            _step: &'a Step,
            _deadline: Instant,
        ) -> futures::future::BoxFuture<'a, Result<ModelResponse, ProviderError>> {
            use std::sync::atomic::Ordering::SeqCst;
            self.calls.fetch_add(1, SeqCst);
            let outcome = if self.failing.load(SeqCst) {
                Err(match self.retry_after {
                    Some(after) => ProviderError::Status {
                        status: 429,
                        message: "slow down".into(),
                        retry_after: Some(after),
                    },
                    None => ProviderError::stream_ended("down"),
                })
            } else {
                Ok(serde_json::from_value(serde_json::json!({
                    "model": "text",
                    "message": {"role": "assistant", "content": "ok"}
                }))
                .unwrap())
            };
            Box::pin(async move { outcome })
        }
    }

    /// Chain `a` then `b`; `a` cools for a minute after two failures in a row.
    fn flaky_router(a: Arc<Flaky>) -> Router {
        let config = ModelsConfig::from_json(
            r#"{"providers":{
               "a":{"protocol":"scripted","models":{"text":{}},
                    "cooldown":{"failures":2,"cooldown_ms":60000}},
               "b":{"protocol":"scripted","models":{"text":{}}}},
             "groups":{"default":[{"provider":"a","model":"text"},{"provider":"b","model":"text"}]},
             "active_group":"default"}"#,
            "test",
        )
        .unwrap();
        config.validate(&|_| true).unwrap();
        let b: Arc<dyn Provider> = Arc::new(Flaky::default());
        let a: Arc<dyn Provider> = a;
        Router::new(config, BTreeMap::from([("a".into(), a), ("b".into(), b)]))
    }

    async fn served_by(router: &Router) -> String {
        router.complete(&req("", "", false)).await.unwrap().provider
    }

    fn calls(p: &Flaky) -> usize {
        p.calls.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// In paused time: a cooling provider is skipped until its cooldown has passed, not a
    /// moment longer; then one failure cools it again (half-open), and a success clears it.
    #[tokio::test(start_paused = true)]
    async fn a_cooldown_ends_when_its_time_has_passed_and_one_failure_starts_it_again() {
        let a = Arc::new(Flaky::default());
        a.failing.store(true, std::sync::atomic::Ordering::SeqCst);
        let router = flaky_router(a.clone());
        assert_eq!(served_by(&router).await, "b");
        assert_eq!(served_by(&router).await, "b");
        assert_eq!(calls(&a), 2, "two failures in a row start the cooldown");
        tokio::time::advance(Duration::from_secs(59)).await;
        assert_eq!(served_by(&router).await, "b");
        assert_eq!(calls(&a), 2, "skipped while cooling");
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert_eq!(served_by(&router).await, "b");
        assert_eq!(calls(&a), 3, "tried once the minute has passed");
        assert_eq!(served_by(&router).await, "b");
        assert_eq!(calls(&a), 3, "one failure after a cooldown cools it again");

        a.failing.store(false, std::sync::atomic::Ordering::SeqCst);
        tokio::time::advance(Duration::from_secs(61)).await;
        assert_eq!(served_by(&router).await, "a");
        // A success cleared the count: one failure is no longer enough.
        a.failing.store(true, std::sync::atomic::Ordering::SeqCst);
        assert_eq!(served_by(&router).await, "b");
        assert_eq!(served_by(&router).await, "b");
        assert_eq!(calls(&a), 6, "tried again after a single failure");
    }

    /// In paused time: a `Retry-After` cools the provider at once, for exactly that long.
    #[tokio::test(start_paused = true)]
    async fn a_retry_after_cools_a_provider_for_as_long_as_it_says() {
        let a = Arc::new(Flaky {
            retry_after: Some(Duration::from_secs(30)),
            ..Flaky::default()
        });
        a.failing.store(true, std::sync::atomic::Ordering::SeqCst);
        let router = flaky_router(a.clone());
        assert_eq!(served_by(&router).await, "b");
        tokio::time::advance(Duration::from_secs(29)).await;
        assert_eq!(served_by(&router).await, "b");
        assert_eq!(
            calls(&a),
            1,
            "one 429 with Retry-After: 30 cools it at once"
        );
        a.failing.store(false, std::sync::atomic::Ordering::SeqCst);
        tokio::time::advance(Duration::from_millis(1001)).await;
        assert_eq!(served_by(&router).await, "a");
    }
}
