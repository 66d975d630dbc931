//! Runs independent jobs (replays, searches) on a few threads and hands the
//! results back in order, with a progress bar over all of them.

use super::progress::Progress;
use super::CliError;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;

/// Where a job reports how far it is (0 to 1).
pub struct Slot(AtomicU32);

impl Slot {
    /// Records the fraction done.
    pub fn set(&self, fraction: f64) {
        let f = if fraction.is_finite() {
            fraction.clamp(0.0, 1.0)
        } else {
            0.0
        };
        self.0.store((f * 1e6) as u32, Ordering::Relaxed);
    }

    fn get(&self) -> f64 {
        self.0.load(Ordering::Relaxed) as f64 / 1e6
    }
}

/// Runs `work` on every item with `threads` threads; calls `done` with each
/// result in the order of `items`, as soon as it and those before it are
/// ready. Stops starting new jobs once `done` fails.
pub fn run<T, R, W, D>(
    items: &[T],
    threads: usize,
    label: &str,
    work: W,
    mut done: D,
) -> Result<(), CliError>
where
    T: Sync,
    R: Send,
    W: Fn(&T, &Slot) -> R + Sync,
    D: FnMut(usize, R) -> Result<(), CliError>,
{
    let n = items.len();
    let slots: Vec<Slot> = (0..n).map(|_| Slot(AtomicU32::new(0))).collect();
    let next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let mut progress = Progress::new(label);
    std::thread::scope(|scope| {
        let (tx, rx) = mpsc::channel::<(usize, R)>();
        for _ in 0..threads.clamp(1, n.max(1)) {
            let tx = tx.clone();
            let (next, stop, slots, work) = (&next, &stop, &slots, &work);
            scope.spawn(move || loop {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let r = work(&items[i], &slots[i]);
                slots[i].set(1.0);
                if tx.send((i, r)).is_err() {
                    break;
                }
            });
        }
        drop(tx);
        let mut ready: Vec<Option<R>> = (0..n).map(|_| None).collect();
        let mut emitted = 0;
        let mut outcome = Ok(());
        while emitted < n {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok((i, r)) => ready[i] = Some(r),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            }
            while emitted < n {
                let Some(r) = ready[emitted].take() else {
                    break;
                };
                progress.finish();
                if let Err(e) = done(emitted, r) {
                    stop.store(true, Ordering::Relaxed);
                    outcome = Err(e);
                    break;
                }
                emitted += 1;
            }
            if outcome.is_err() {
                break;
            }
            let total: f64 = slots.iter().map(Slot::get).sum();
            progress.set(total / n as f64, &format!("{emitted}/{n} done"));
        }
        progress.finish();
        outcome
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_come_in_order() {
        let items: Vec<u64> = (0..20).collect();
        let mut seen = Vec::new();
        run(
            &items,
            4,
            "t",
            |&i, slot| {
                slot.set(0.5);
                std::thread::sleep(Duration::from_millis((20 - i) * 2));
                i * 10
            },
            |i, r| {
                seen.push((i, r));
                Ok(())
            },
        )
        .unwrap();
        assert_eq!(
            seen,
            (0..20).map(|i| (i as usize, i * 10)).collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_failing_consumer_stops_the_work() {
        let items: Vec<u32> = (0..1000).collect();
        let started = AtomicUsize::new(0);
        let r = run(
            &items,
            2,
            "t",
            |_, _| {
                started.fetch_add(1, Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(1));
            },
            |i, ()| {
                if i == 3 {
                    Err(CliError::BrokenPipe)
                } else {
                    Ok(())
                }
            },
        );
        assert!(matches!(r, Err(CliError::BrokenPipe)));
        assert!(started.load(Ordering::Relaxed) < 1000);
    }
}
