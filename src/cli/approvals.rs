//! `cyrene approvals`, `cyrene approve`, `cyrene deny`: the tool calls of a session that wait
//! for a person's decision (docs/orchestrator.md, "Approvals"). Without `--person` they use
//! the operator's subjects (`cyrene.session.approve`, `.approvals`), with it the person's.

use super::session::ask;
use super::{CliError, parse_duration, person};
use async_nats::Client;
use clap::Args;
use cyrene_protocol::approval::{
    Approval, ApprovalsRequest, ApprovalsResponse, ApproveRequest, ApproveResponse, Decision,
};
use cyrene_protocol::subjects;
use serde_json::Value;
use std::time::Duration;

#[derive(Debug, Args)]
pub struct ApprovalsArgs {
    /// The session.
    #[arg(long, short)]
    pub session: String,
    /// Print the approvals as JSON lines.
    #[arg(long)]
    pub json: bool,
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub timeout: Duration,
}

#[derive(Debug, Args)]
pub struct DecideArgs {
    /// The session.
    #[arg(long, short)]
    pub session: String,
    /// Why (the model sees a denial's reason; at most 1024 bytes).
    #[arg(long)]
    pub reason: Option<String>,
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub timeout: Duration,
    /// The call's id (as `cyrene approvals` or the `approval_requested` event names it).
    pub call: String,
}

/// `cyrene approvals -s S`: the pending calls first, then the last decided ones.
pub async fn list(client: Client, args: ApprovalsArgs) -> Result<(), CliError> {
    let request = ApprovalsRequest {
        session_id: person::session(&args.session),
    };
    let list: ApprovalsResponse = ask(
        &client,
        subjects::SESSION_APPROVALS,
        subjects::PERSON_SESSION_APPROVALS,
        &request,
        args.timeout,
    )
    .await?;
    if list.approvals.is_empty() && !args.json {
        println!("no tool call of {} asked for approval", request.session_id);
    }
    for approval in &list.approvals {
        match args.json {
            true => println!("{}", serde_json::to_string(approval).unwrap_or_default()),
            false => println!("{}", line(approval)),
        }
    }
    Ok(())
}

/// One approval as `cyrene approvals` prints it.
fn line(a: &Approval) -> String {
    let call = format!("{}({})", a.tool, Value::Object(a.arguments.clone()));
    match (a.decision, &a.decided_by) {
        (None, _) => format!(
            "waiting   {}  {call}  denied by itself at {}",
            a.call_id,
            at(a.deadline_ms)
        ),
        (Some(d), by) => format!(
            "{:<9} {}  {call}  by {}{}",
            past(d),
            a.call_id,
            by.as_deref().unwrap_or_default(),
            a.reason
                .as_deref()
                .map(|r| format!(": {r}"))
                .unwrap_or_default()
        ),
    }
}

fn past(decision: Decision) -> &'static str {
    match decision {
        Decision::Approve => "approved",
        Decision::Deny => "denied",
    }
}

fn at(unix_ms: i64) -> String {
    match u64::try_from(unix_ms) {
        Ok(ms) => {
            let t = std::time::UNIX_EPOCH + Duration::from_millis(ms);
            humantime::format_rfc3339_seconds(t).to_string()
        }
        Err(_) => unix_ms.to_string(),
    }
}

/// `cyrene approve` / `cyrene deny`: prints the decision that holds; fails (exit 1) when it is
/// not the one asked for (somebody, or the deadline, decided first).
pub async fn decide(client: Client, args: DecideArgs, decision: Decision) -> Result<(), CliError> {
    let request = ApproveRequest {
        session_id: person::session(&args.session),
        call_id: args.call,
        decision,
        reason: args.reason,
    };
    let held: ApproveResponse = ask(
        &client,
        subjects::SESSION_APPROVE,
        subjects::PERSON_SESSION_APPROVE,
        &request,
        args.timeout,
    )
    .await?;
    let said = format!(
        "{} {} (by {})",
        past(held.decision),
        held.call_id,
        held.decided_by
    );
    match (held.already_decided, held.decision == decision) {
        (false, _) => {
            println!("{said}");
            Ok(())
        }
        (true, true) => {
            println!("already {said}");
            Ok(())
        }
        (true, false) => Err(CliError::Failed(format!("already {said}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_line_says_what_holds() {
        let mut a: Approval = serde_json::from_value(json!({"turn_id":"t","call_id":"c1",
            "tool":"send_email","arguments":{"to":"x"},"requested_at_ms":0,
            "deadline_ms":86400000}))
        .unwrap();
        assert_eq!(
            line(&a),
            r#"waiting   c1  send_email({"to":"x"})  denied by itself at 1970-01-02T00:00:00Z"#
        );
        a.decision = Some(Decision::Deny);
        a.decided_by = Some("person:alice".into());
        a.reason = Some("not now".into());
        assert_eq!(
            line(&a),
            r#"denied    c1  send_email({"to":"x"})  by person:alice: not now"#
        );
    }
}
