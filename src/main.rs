//! The `cachealloc` command-line tool: replay allocation traces through the
//! caching allocator on a simulated device, compare policies, find the
//! smallest device that runs a trace. `cachealloc --help` says more.

mod cli;

fn main() {
    std::process::exit(cli::main());
}
