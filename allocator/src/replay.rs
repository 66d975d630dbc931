//! Trace replay (filled in by the replay issue).
