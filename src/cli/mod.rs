//! The command line: argument parsing, dispatch, errors and exit codes.
//!
//! Exit codes: 0 success, 1 runtime error (a trace that cannot be read or
//! replayed, an output that cannot be written), 2 usage error (clap's).

mod compare;
mod format;
mod jobs;
mod min_capacity;
mod plot;
mod progress;
mod replay;
mod scoreboard;

use cachealloc::core::{parse_size, Config};
use clap::{Args, Parser, Subcommand};
use std::io::{self, Write};
use std::path::PathBuf;

/// Replays allocation traces through cachealloc's caching allocator on a
/// simulated device, to see what a policy does to memory before a training
/// run depends on it.
#[derive(Parser, Debug)]
#[command(name = "cachealloc", version, about, long_about = None)]
#[command(after_help = after_help())]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

fn after_help() -> String {
    format!(
        "\
Traces are text, optionally gzip-compressed, one event per line:
  a <id> <bytes> <stream>   allocate <bytes>; <id> names it until it is freed
  f <id>                    free the allocation <id>
  e                         empty_cache()
Configurations: a preset ({}) or a key:value,... string in the
syntax of PYTORCH_CUDA_ALLOC_CONF, optionally starting with a preset
(e.g. `pytorch,max_split_size_mb:64`). The command line takes its
configurations from -c only: CACHEALLOC_CONF is read by the library
(the C ABI, the Python loader), not here, and a note says so when it is set.
Sizes: plain bytes, or with a unit: KB MB GB TB (powers of 1000), KiB MiB GiB TiB.",
        Config::PRESETS.join(", ")
    )
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Replay one trace and report peaks, driver calls, retries, OOMs and
    /// the fragmentation at the peak of reserved memory.
    Replay(Box<ReplayArgs>),
    /// Replay traces under several configurations and print one table.
    Compare(CompareArgs),
    /// Find the smallest device capacity on which a trace runs without
    /// out-of-memory (flush-and-retry allowed), by bisection.
    MinCapacity(MinCapacityArgs),
    /// Replay every trace of a folder, and jittered copies, under several
    /// configurations: per-trace ratios, worst case and geometric mean.
    Scoreboard(ScoreboardArgs),
}

/// A configuration as given on the command line, and what it parses to.
#[derive(Clone, Debug)]
pub struct ConfigArg {
    /// The preset name or conf string as given (what reports call it).
    pub label: String,
    /// The parsed configuration.
    pub config: Config,
}

fn parse_config(text: &str) -> Result<ConfigArg, String> {
    if text.trim().is_empty() {
        return Err(format!(
            "an empty configuration: give a preset ({}) or key:value,...",
            Config::PRESETS.join(", ")
        ));
    }
    let config = Config::parse(text).map_err(|e| e.to_string())?;
    let label = if text.trim().is_empty() {
        config.name().to_string()
    } else {
        text.trim().to_string()
    };
    Ok(ConfigArg { label, config })
}

fn preset(name: &str) -> ConfigArg {
    parse_config(name).expect("built-in preset")
}

fn parse_capacity(text: &str) -> Result<u64, String> {
    if text.trim_start().starts_with('-') {
        return Err(format!("`{text}`: the capacity must be a positive size"));
    }
    match parse_size(text)? {
        0 => Err("the capacity must be more than 0 bytes".into()),
        n => Ok(n),
    }
}

#[derive(Args, Debug)]
struct ReplayArgs {
    /// Trace file (plain text or gzip).
    #[arg(value_name = "TRACE")]
    trace: PathBuf,
    /// Allocator configuration: a preset or a key:value,... string.
    #[arg(long, short = 'c', value_name = "NAME|CONF", value_parser = parse_config, default_value = "default")]
    config: ConfigArg,
    /// Capacity of the simulated device (default: unlimited), e.g. 16GiB.
    #[arg(long, value_name = "BYTES", value_parser = parse_capacity, allow_hyphen_values = true)]
    capacity: Option<u64>,
    /// Simulate a GPU that runs N allocations and frees behind the host: an
    /// event recorded on a stream completes only N trace events later
    /// (default: at once), so the allocator's waits for streams show.
    #[arg(long, value_name = "N")]
    gpu_lag: Option<u64>,
    /// Print one JSON object instead of the summary.
    #[arg(long)]
    json: bool,
    /// Write an SVG plot of allocated, reserved and requested bytes over the trace.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
}

#[derive(Args, Debug)]
struct CompareArgs {
    /// Trace files (plain text or gzip).
    #[arg(value_name = "TRACE", required = true)]
    traces: Vec<PathBuf>,
    /// Configuration to compare (repeat the option for several; default:
    /// pytorch, default, segments and no-caching).
    #[arg(long = "config", short = 'c', value_name = "NAME|CONF", value_parser = parse_config)]
    configs: Vec<ConfigArg>,
    /// Capacity of the simulated device (default: unlimited), e.g. 16GiB.
    #[arg(long, value_name = "BYTES", value_parser = parse_capacity, allow_hyphen_values = true)]
    capacity: Option<u64>,
    /// Simulate a GPU that runs N allocations and frees behind the host: an
    /// event recorded on a stream completes only N trace events later
    /// (default: at once), so the allocator's waits for streams show.
    #[arg(long, value_name = "N")]
    gpu_lag: Option<u64>,
    /// Print one JSON object per line per trace and configuration.
    #[arg(long)]
    json: bool,
    /// Replays to run at once (default: the number of CPUs; -j1 for undisturbed timings).
    #[arg(long, short = 'j', value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    jobs: Option<u32>,
}

#[derive(Args, Debug)]
struct MinCapacityArgs {
    /// Trace files (plain text or gzip).
    #[arg(value_name = "TRACE", required = true)]
    traces: Vec<PathBuf>,
    /// Configuration (repeat the option for several; default: default).
    #[arg(long = "config", short = 'c', value_name = "NAME|CONF", value_parser = parse_config)]
    configs: Vec<ConfigArg>,
    /// Print one JSON object per line per trace and configuration.
    #[arg(long)]
    json: bool,
    /// Searches to run at once (default: the number of CPUs; -j1 for undisturbed timings).
    #[arg(long, short = 'j', value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    jobs: Option<u32>,
}

#[derive(Args, Debug)]
struct ScoreboardArgs {
    /// Folder of traces (`*.trace`, `*.trace.gz`, PyTorch memory snapshots `*.pickle`).
    #[arg(value_name = "DIR")]
    dir: PathBuf,
    /// Jittered copies of each trace (sizes ±5%, order shuffled within steps).
    #[arg(long, value_name = "N", default_value_t = 1)]
    jitter: u32,
    /// Divide every request size by N (at least 1 byte): the same programs
    /// with smaller models, to see whether a rule holds at another scale.
    #[arg(long, value_name = "N", default_value_t = 1,
          value_parser = clap::value_parser!(u64).range(1..))]
    scale_down: u64,
    /// Configuration (repeat for several; default: pytorch,
    /// pytorch,expandable_segments:True, default, segments).
    #[arg(long = "config", short = 'c', value_name = "NAME|CONF", value_parser = parse_config)]
    configs: Vec<ConfigArg>,
    /// Skip the smallest-capacity search (one replay per cell).
    #[arg(long)]
    no_min_capacity: bool,
    /// Also write every jittered (or scaled-down) copy to this folder, as
    /// `NAME.jN.trace.gz` (`NAME.rec.trace.gz` for a scaled recorded trace),
    /// to replay or inspect one cell on its own.
    #[arg(long, value_name = "DIR")]
    write_copies: Option<PathBuf>,
    /// Print one JSON object per line per cell, then one per summary (and,
    /// with `pytorch` among the configurations, one per other configuration
    /// listing its figures above `pytorch`'s).
    #[arg(long)]
    json: bool,
    /// Replays to run at once (default: the number of CPUs).
    #[arg(long, short = 'j', value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    jobs: Option<u32>,
}

/// Why a command failed.
#[derive(Debug)]
pub enum CliError {
    /// A message for `error: …` on stderr.
    Message(String),
    /// Errors were already printed; exit with status 1.
    Reported,
    /// Standard output was closed (e.g. piped into `head`); exit quietly.
    BrokenPipe,
}

impl From<cachealloc::trace_file::FileError> for CliError {
    fn from(e: cachealloc::trace_file::FileError) -> Self {
        CliError::Message(e.to_string())
    }
}

impl From<io::Error> for CliError {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::BrokenPipe {
            CliError::BrokenPipe
        } else {
            CliError::Message(format!("cannot write the output: {e}"))
        }
    }
}

/// Prints an error line on stderr.
pub fn report_error(message: &str) {
    let _ = writeln!(io::stderr().lock(), "error: {message}");
}

/// Runs the command line; returns the exit status.
pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    if std::env::var_os("CACHEALLOC_CONF").is_some_and(|v| !v.is_empty()) {
        let _ = writeln!(
            io::stderr().lock(),
            "note: CACHEALLOC_CONF is not read by the command line; pass a configuration with -c"
        );
    }
    let result = match cli.command {
        Command::Replay(a) => replay::run(*a),
        Command::Compare(a) => compare::run(a),
        Command::MinCapacity(a) => min_capacity::run(a),
        Command::Scoreboard(a) => scoreboard::run(a),
    };
    match result {
        Ok(()) => 0,
        Err(CliError::Message(m)) => {
            report_error(&m);
            1
        }
        Err(CliError::Reported) => 1,
        Err(CliError::BrokenPipe) => 0,
    }
}

/// The configurations to use: those given, or the defaults.
fn configs_or(given: Vec<ConfigArg>, defaults: &[&str]) -> Vec<ConfigArg> {
    if given.is_empty() {
        defaults.iter().map(|n| preset(n)).collect()
    } else {
        given
    }
}

/// Every (trace, configuration) pair, traces outermost, with the widths of
/// the trace and configuration columns of a table listing them.
fn trace_config_jobs<'a>(
    traces: &'a [PathBuf],
    configs: &'a [ConfigArg],
) -> (Vec<(&'a PathBuf, &'a ConfigArg)>, usize, usize) {
    let jobs = traces
        .iter()
        .flat_map(|t| configs.iter().map(move |c| (t, c)))
        .collect();
    let trace_width = traces
        .iter()
        .map(|t| format::trace_name(t).chars().count())
        .max()
        .unwrap_or(5);
    let config_width = configs
        .iter()
        .map(|c| c.label.chars().count())
        .max()
        .unwrap_or(6);
    (jobs, trace_width, config_width)
}

/// How many worker threads to use for `jobs` jobs.
fn threads(requested: Option<u32>, jobs: usize) -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    (requested.map_or(cpus, |n| n as usize)).clamp(1, jobs.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_valid() {
        Cli::command().debug_assert();
    }

    #[test]
    fn configs_keep_their_label() {
        let c = parse_config("pytorch,max_split_size_mb:64").unwrap();
        assert_eq!(c.label, "pytorch,max_split_size_mb:64");
        assert_eq!(c.config.max_split_size(), 64 << 20);
        assert_eq!(parse_config("no-caching").unwrap().label, "no-caching");
        assert!(parse_config("bogus").is_err());
        assert!(parse_config("max_split_size_mb:1").is_err());
    }

    #[test]
    fn capacities() {
        assert_eq!(parse_capacity("16GiB").unwrap(), 16 << 30);
        assert_eq!(parse_capacity("512MB").unwrap(), 512_000_000);
        assert_eq!(parse_capacity("1048576").unwrap(), 1 << 20);
        assert!(parse_capacity("0").is_err());
        assert!(parse_capacity("12 parsecs").is_err());
        assert!(parse_capacity("").is_err());
    }
}
