//! Number formatting, tables and the JSON records of the CLI.

use super::ConfigArg;
use cachealloc::core::replay::ReplayResult;
use serde_json::{json, Map, Value};
use std::path::Path;

const GIB: f64 = (1u64 << 30) as f64;

/// `12.34 GiB` (binary gigabytes, two decimals).
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / GIB)
}

/// Table cells: GiB with two decimals from 1 GiB up, smaller units below
/// (`250.00 MiB`), so that small traces stay readable.
pub fn size(bytes: u64) -> String {
    if bytes as f64 >= GIB {
        gib(bytes)
    } else {
        human(bytes)
    }
}

/// Bytes with a readable unit: `512 B`, `3.50 MiB`, `12.34 GiB`.
pub fn human(bytes: u64) -> String {
    cachealloc::core::human_bytes(bytes)
}

/// `12,278,053,376`.
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `5.1 M events/s`.
pub fn rate(events: u64, seconds: f64) -> String {
    if seconds <= 0.0 {
        return "– events/s".into();
    }
    let r = events as f64 / seconds;
    if r >= 1e6 {
        format!("{:.1} M events/s", r / 1e6)
    } else if r >= 1e3 {
        format!("{:.1} k events/s", r / 1e3)
    } else {
        format!("{r:.0} events/s")
    }
}

/// How a trace path is shown and recorded.
pub fn trace_name(path: &Path) -> String {
    path.display().to_string()
}

/// The keys every JSON record has, from one replay.
pub fn record(
    trace: &Path,
    config: &ConfigArg,
    capacity: Option<u64>,
    r: &ReplayResult,
) -> Map<String, Value> {
    let s = &r.stats;
    let value = json!({
        "trace": trace_name(trace),
        "config": config.label,
        "config_string": config.config.to_conf_string(),
        "capacity_bytes": capacity,
        "events": r.events,
        "peak_allocated_bytes": r.peak_allocated,
        "peak_reserved_bytes": r.peak_reserved,
        "peak_requested_bytes": r.peak_requested,
        "num_device_alloc": s.num_device_alloc,
        "num_device_free": s.num_device_free,
        "device_calls": r.device_calls(),
        "num_vmm_map": s.num_map,
        "num_vmm_unmap": s.num_unmap,
        "num_page_create": s.num_page_create,
        "num_page_release": s.num_page_release,
        "num_sync_all_streams": s.num_sync_all_streams,
        "num_marker_waits": s.num_marker_waits,
        "num_blocks_borrowed": s.num_blocks_borrowed,
        "num_releases_paused": s.num_releases_paused,
        "num_pages_reused_early": s.num_pages_reused_early,
        "num_pages_revived": s.num_pages_revived,
        "num_stream_waits": s.num_stream_waits,
        "num_other_kind_fits": s.num_other_kind_fits,
        "num_segments_paged": s.num_segments_paged,
        "num_pages_rebacked": s.num_pages_rebacked,
        "num_pages_shared": s.num_pages_shared,
        "num_event_waits": s.num_event_waits,
        "num_events_recorded": s.num_events_recorded,
        "num_alloc_retries": s.num_alloc_retries,
        "num_ooms": s.num_ooms,
        "reserved_over_allocated": r.reserved_over_allocated(),
        "peak_segments": s.segment.all().peak,
        "seconds": r.seconds,
        "events_per_second": if r.seconds > 0.0 { Some(r.events as f64 / r.seconds) } else { None },
    });
    match value {
        Value::Object(m) => m,
        _ => unreachable!("json! of an object"),
    }
}

/// Column alignment.
#[derive(Copy, Clone, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A plain-text table whose column widths are known before any row is
/// printed, so rows can be printed as they come.
pub struct Table {
    columns: Vec<(String, usize, Align)>,
}

impl Table {
    /// Columns as (header, minimum width, alignment).
    pub fn new(columns: &[(&str, usize, Align)]) -> Self {
        Table {
            columns: columns
                .iter()
                .map(|&(h, w, a)| (h.to_string(), w.max(h.chars().count()), a))
                .collect(),
        }
    }

    /// The header line and a rule under it.
    pub fn header(&self) -> String {
        let cells: Vec<String> = self.columns.iter().map(|(h, _, _)| h.clone()).collect();
        let line = self.row(&cells);
        let rule: String = self
            .columns
            .iter()
            .map(|(_, w, _)| "-".repeat(*w))
            .collect::<Vec<_>>()
            .join("  ");
        format!("{line}\n{rule}")
    }

    /// One row.
    pub fn row(&self, cells: &[String]) -> String {
        let mut out = String::new();
        for (i, ((_, width, align), cell)) in self.columns.iter().zip(cells).enumerate() {
            if i > 0 {
                out.push_str("  ");
            }
            let pad = width.saturating_sub(cell.chars().count());
            match align {
                Align::Left => {
                    out.push_str(cell);
                    if i + 1 < self.columns.len() {
                        out.push_str(&" ".repeat(pad));
                    }
                }
                Align::Right => {
                    out.push_str(&" ".repeat(pad));
                    out.push_str(cell);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers() {
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1000), "1,000");
        assert_eq!(grouped(22_261_268_480), "22,261,268,480");
        assert_eq!(gib(3 << 29), "1.50 GiB");
        assert_eq!(size(12_278_747_136), "11.44 GiB");
        assert_eq!(size(250 << 20), "250.00 MiB");
        assert_eq!(size(0), "0 B");
        assert_eq!(rate(5_000_000, 1.0), "5.0 M events/s");
    }

    #[test]
    fn table_aligns() {
        let t = Table::new(&[("name", 6, Align::Left), ("n", 3, Align::Right)]);
        assert_eq!(t.header(), "name      n\n------  ---");
        assert_eq!(t.row(&["ab".into(), "7".into()]), "ab        7");
    }
}
