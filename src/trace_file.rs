//! Trace files on disk: plain text or gzip, streamed.
