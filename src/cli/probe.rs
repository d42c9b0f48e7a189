//! `cyrene probe`: which micro services are on the bus (`$SRV.INFO` and `$SRV.STATS`).

use super::{CliError, parse_duration};
use async_nats::Client;
use clap::Args;
use cyrene_bus::discovery::{self, Verb};
use serde_json::Value;
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(Debug, Args)]
pub struct ProbeArgs {
    /// Only services with this name.
    pub name: Option<String>,
    /// How long to collect answers (every instance answers once).
    #[arg(long, default_value = "500ms", value_parser = parse_duration)]
    pub wait: Duration,
    /// Print one JSON object per instance instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One service instance as INFO and STATS describe it.
#[derive(Debug, Default)]
struct Instance {
    info: Value,
    stats: Value,
}

pub async fn run(client: Client, args: ProbeArgs) -> Result<(), CliError> {
    let name = args.name.as_deref();
    let (infos, stats) = tokio::join!(
        gather(&client, Verb::Info, name, args.wait),
        gather(&client, Verb::Stats, name, args.wait),
    );
    let mut instances: BTreeMap<(String, String), Instance> = BTreeMap::new();
    for info in infos? {
        let k = key(&info);
        instances.entry(k).or_default().info = info;
    }
    for stat in stats? {
        let k = key(&stat);
        instances.entry(k).or_default().stats = stat;
    }
    if instances.is_empty() {
        eprintln!(
            "no micro services answered within {}",
            humantime::format_duration(args.wait)
        );
        return Ok(());
    }
    if args.json {
        for inst in instances.values() {
            println!(
                "{}",
                serde_json::json!({"info": inst.info, "stats": inst.stats})
            );
        }
        return Ok(());
    }
    println!(
        "{:<26} {:<24} {:<9} {:>9} {:>7}  ENDPOINTS",
        "NAME", "ID", "VERSION", "REQUESTS", "ERRORS"
    );
    for ((name, id), inst) in &instances {
        let (requests, errors) = totals(&inst.stats);
        let version =
            str_field(&inst.info, "version").or_else(|| str_field(&inst.stats, "version"));
        println!(
            "{:<26} {:<24} {:<9} {:>9} {:>7}  {}",
            name,
            id,
            version.unwrap_or("?"),
            requests,
            errors,
            endpoints(&inst.info)
        );
    }
    Ok(())
}

fn key(v: &Value) -> (String, String) {
    let name = str_field(v, "name").unwrap_or("?").to_owned();
    let id = str_field(v, "id").unwrap_or("?").to_owned();
    (name, id)
}

fn str_field<'a>(v: &'a Value, field: &str) -> Option<&'a str> {
    v.get(field).and_then(Value::as_str)
}

fn totals(stats: &Value) -> (u64, u64) {
    let mut totals = (0, 0);
    for ep in stats
        .get("endpoints")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        totals.0 += ep.get("num_requests").and_then(Value::as_u64).unwrap_or(0);
        totals.1 += ep.get("num_errors").and_then(Value::as_u64).unwrap_or(0);
    }
    totals
}

fn endpoints(info: &Value) -> String {
    let list = info
        .get("endpoints")
        .and_then(Value::as_array)
        .into_iter()
        .flatten();
    list.map(|ep| {
        format!(
            "{}={}",
            str_field(ep, "name").unwrap_or("?"),
            str_field(ep, "subject").unwrap_or("?")
        )
    })
    .collect::<Vec<_>>()
    .join(" ")
}

/// Every answer to `verb` within `wait`.
async fn gather(
    client: &Client,
    verb: Verb,
    name: Option<&str>,
    wait: Duration,
) -> Result<Vec<Value>, CliError> {
    discovery::gather(client, verb, name, wait, None)
        .await
        .map_err(|e| CliError::Failed(format!("{}: {e}", discovery::subject(verb, name))))
}
