use clap::Parser;
use konnectivity_bench::Cli;

fn main() -> anyhow::Result<()> {
    konnectivity_bench::main(Cli::parse())
}
