//! The time budget of the release rules (`release_time_budget`).
//!
//! Releasing a free segment before growing keeps reserved memory near its
//! peak, but when the program needs that memory again the driver is called
//! twice (`cuMemFree`, then `cuMemAlloc`), and a free waits for the device.
//! [`ChurnBudget`] adds up the driver time of that churn against the time
//! the program ran; past the budget the release rules pause, so reserved
//! memory grows instead (as PyTorch's would) until the churn is back under it.

/// Every this much run time, both sums are halved: the budget follows what
/// the program does now, not what it did at start-up.
const WINDOW_NS: u64 = 10_000_000_000;

/// The run time the budget is measured against at least, so that the first
/// release of a run is not judged against the few microseconds before it.
const MIN_RUN_NS: u64 = 1_000_000_000;

/// Driver time spent giving memory back and taking it again, against run time.
#[derive(Debug, Default)]
pub(crate) struct ChurnBudget {
    /// Share of run time the churn may take; 0: no limit.
    budget: f64,
    /// Clock reading at which the current window started (set at the first reading).
    start: Option<u64>,
    /// Driver time of churn in the window, in nanoseconds.
    spent: u64,
    /// Whether the last check found the budget spent (the release rules pause).
    paused: bool,
}

impl ChurnBudget {
    pub(crate) fn new(budget: f64) -> Self {
        ChurnBudget {
            budget,
            ..Self::default()
        }
    }

    /// Whether a budget is set: without one the clock is never read.
    #[inline]
    pub(crate) fn limited(&self) -> bool {
        self.budget > 0.0
    }

    /// Adds the time a churn call took, from clock readings before and after
    /// it (nothing without a clock).
    #[inline]
    pub(crate) fn charge(&mut self, before: Option<u64>, after: Option<u64>) {
        if let (Some(t0), Some(t1)) = (before, after) {
            self.start.get_or_insert(t0);
            self.spent = self.spent.saturating_add(t1.saturating_sub(t0));
        }
    }

    /// Whether churn took more than the budget's share of the run time up to
    /// `now`; remembered for [`ChurnBudget::paused`]. Never without a clock
    /// or a budget.
    pub(crate) fn check(&mut self, now: Option<u64>) -> bool {
        self.paused = match now {
            Some(now) if self.budget > 0.0 => {
                let start = *self.start.get_or_insert(now);
                let mut run = now.saturating_sub(start);
                if run > WINDOW_NS {
                    run /= 2;
                    self.start = Some(now - run);
                    self.spent /= 2;
                }
                self.spent as f64 > self.budget * run.max(MIN_RUN_NS) as f64
            }
            _ => false,
        };
        self.paused
    }

    /// What the last [`ChurnBudget::check`] found.
    #[inline]
    pub(crate) fn paused(&self) -> bool {
        self.paused
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    #[test]
    fn no_clock_or_no_budget_never_pauses() {
        let mut b = ChurnBudget::new(0.01);
        b.charge(None, None);
        assert!(!b.check(None));
        let mut off = ChurnBudget::new(0.0);
        off.charge(Some(0), Some(10_000 * MS));
        assert!(!off.check(Some(10_000 * MS)));
    }

    #[test]
    fn pauses_once_churn_passes_its_share_of_run_time() {
        let mut b = ChurnBudget::new(0.01);
        assert!(!b.check(Some(0)));
        // 5 ms of churn in the first second: within 1% of the one-second floor.
        b.charge(Some(100 * MS), Some(105 * MS));
        assert!(!b.check(Some(200 * MS)));
        // 15 ms by 1.2 s: over 1%.
        b.charge(Some(1_000 * MS), Some(1_010 * MS));
        assert!(b.check(Some(1_200 * MS)));
        assert!(b.paused());
        // Run time goes on without churn: back under the budget.
        assert!(!b.check(Some(2_000 * MS)));
        assert!(!b.paused());
    }

    #[test]
    fn old_churn_fades_with_the_window() {
        let mut b = ChurnBudget::new(0.01);
        assert!(!b.check(Some(0)));
        b.charge(Some(0), Some(90 * MS));
        // 90 ms is more than 1% of 8 s and less than 1% of 9.5 s.
        assert!(b.check(Some(8_000 * MS)));
        assert!(!b.check(Some(9_500 * MS)));
        // Past the window both sums halve: the share stays the same at once...
        b.charge(Some(9_500 * MS), Some(9_600 * MS));
        assert!(b.check(Some(12_000 * MS)));
        // ...and without new churn it falls below the budget.
        assert!(!b.check(Some(40_000 * MS)));
    }
}
