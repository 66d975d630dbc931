//! A one-line progress bar on stderr, drawn only when stderr is a terminal
//! and only for work that takes a while.

use std::io::{self, IsTerminal, Write};
use std::time::{Duration, Instant};

/// Work shorter than this never shows a bar.
const DELAY: Duration = Duration::from_millis(300);
/// Minimum time between redraws.
const REDRAW: Duration = Duration::from_millis(80);
const BAR_WIDTH: usize = 30;

/// A progress bar; cleared when finished or dropped.
pub struct Progress {
    enabled: bool,
    label: String,
    start: Instant,
    last_draw: Option<Instant>,
}

impl Progress {
    /// A bar labelled `label`, shown if stderr is a terminal.
    pub fn new(label: &str) -> Self {
        Self::with_enabled(label, io::stderr().is_terminal())
    }

    fn with_enabled(label: &str, enabled: bool) -> Self {
        let label: String = if label.chars().count() > 32 {
            let tail: Vec<char> = label.chars().rev().take(31).collect();
            std::iter::once('…').chain(tail.into_iter().rev()).collect()
        } else {
            label.to_string()
        };
        Progress {
            enabled,
            label,
            start: Instant::now(),
            last_draw: None,
        }
    }

    /// Sets the fraction done (0 to 1) and a short detail text.
    pub fn set(&mut self, fraction: f64, detail: &str) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        if now.duration_since(self.start) < DELAY {
            return;
        }
        if self
            .last_draw
            .is_some_and(|t| now.duration_since(t) < REDRAW)
        {
            return;
        }
        self.last_draw = Some(now);
        let line = render(&self.label, fraction, detail);
        let mut err = io::stderr().lock();
        let _ = write!(err, "\r{line}\x1b[K");
        let _ = err.flush();
    }

    /// Clears the bar if it was drawn.
    pub fn finish(&mut self) {
        if self.last_draw.take().is_some() {
            let mut err = io::stderr().lock();
            let _ = write!(err, "\r\x1b[K");
            let _ = err.flush();
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

fn render(label: &str, fraction: f64, detail: &str) -> String {
    let f = if fraction.is_finite() {
        fraction.clamp(0.0, 1.0)
    } else {
        0.0
    };
    let filled = (f * BAR_WIDTH as f64).round() as usize;
    format!(
        "{label} [{}{}] {:>3}% {detail}",
        "#".repeat(filled),
        "-".repeat(BAR_WIDTH - filled),
        (f * 100.0).floor() as u32
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders() {
        assert_eq!(
            render("x", 0.5, "3/6"),
            format!("x [{}{}]  50% 3/6", "#".repeat(15), "-".repeat(15))
        );
        assert!(render("x", f64::NAN, "").contains("  0%"));
        assert!(render("x", 7.0, "").contains("100%"));
    }

    #[test]
    fn long_labels_keep_their_end() {
        let p = Progress::with_enabled(&"a/".repeat(40), false);
        assert_eq!(p.label.chars().count(), 32);
        assert!(p.label.starts_with('…'));
    }
}
