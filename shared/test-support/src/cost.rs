//! The summary every bench ends with (issue 37, docs/performance.md "Against the floor"): each
//! row of the cost table with its figure, the floor or anchor measured in the same run, its
//! target and whether it was met — once as a block a person reads, once as one `COST` line per
//! row that `grep '^COST'` collects for docs/performance.md.
//!
//! A target is stated against the floor of the same run wherever the issue states it so: this
//! machine's floors move by 2× within an hour, so a figure without its floor says little.

use std::fmt::Write as _;
use std::time::SystemTime;

/// One row of the cost table.
#[derive(Debug, Clone)]
pub struct Row {
    /// A short stable key (`http_added_1_in_flight`): what `grep` and the docs match on.
    pub key: &'static str,
    /// What the row measures, in words.
    pub what: String,
    /// The figure, with its unit (`0.135 ms`).
    pub figure: String,
    /// The floor or anchor it is stated against, from the same run (`proxy +0.060 ms`).
    pub floor: String,
    /// The target, in words a person checks against the figure (`≤ floor + 0.25 ms = 1.1 ms`).
    pub target: String,
    /// Whether the figure meets the target.
    pub met: bool,
}

impl Row {
    pub fn new(
        key: &'static str,
        what: impl Into<String>,
        figure: impl Into<String>,
        floor: impl Into<String>,
        target: impl Into<String>,
        met: bool,
    ) -> Row {
        Row {
            key,
            what: what.into(),
            figure: figure.into(),
            floor: floor.into(),
            target: target.into(),
            met,
        }
    }
}

/// `met` or `missed`.
pub fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "missed" }
}

/// The summary block of `bench`'s `rows`: a heading with the time of the run, one readable line
/// per row, then one `COST <key> figure=… floor=… target=… met|missed` line per row (spaces in a
/// value become `_`, so each line splits on spaces).
pub fn summary(bench: &str, rows: &[Row]) -> String {
    let mut out = String::new();
    let when = humantime::format_rfc3339_seconds(SystemTime::now());
    let _ = writeln!(
        out,
        "== cost against the floor: {bench} ({when}, same run) =="
    );
    for row in rows {
        let _ = writeln!(
            out,
            "  {:<7} {}: {} | floor/anchor {} | target {}",
            verdict(row.met),
            row.what,
            row.figure,
            row.floor,
            row.target
        );
    }
    let squash = |s: &str| s.split_whitespace().collect::<Vec<_>>().join("_");
    for row in rows {
        let _ = writeln!(
            out,
            "COST {} figure={} floor={} target={} {}",
            row.key,
            squash(&row.figure),
            squash(&row.floor),
            squash(&row.target),
            verdict(row.met)
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_row_is_one_greppable_line_of_five_fields() {
        let rows = [
            Row::new(
                "a_row",
                "a thing",
                "1.5 ms",
                "echo 1.2 ms",
                "≤ 1.4 ms",
                false,
            ),
            Row::new("b_row", "b", "2×", "—", "≤ 3×", true),
        ];
        let text = summary("bench", &rows);
        let cost: Vec<&str> = text.lines().filter(|l| l.starts_with("COST ")).collect();
        assert_eq!(
            cost,
            [
                "COST a_row figure=1.5_ms floor=echo_1.2_ms target=≤_1.4_ms missed",
                "COST b_row figure=2× floor=— target=≤_3× met"
            ]
        );
        assert!(text.contains("  missed  a thing: 1.5 ms | floor/anchor echo 1.2 ms"));
    }
}
